"""``python -m kvctl``."""

from kvctl.main import main

raise SystemExit(main())
