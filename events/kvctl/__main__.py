"""``python -m events.kvctl``."""

from events.kvctl.main import main

raise SystemExit(main())
