"""``python -m bridge``: the kv-bridge process."""

from bridge.main import main

raise SystemExit(main())
