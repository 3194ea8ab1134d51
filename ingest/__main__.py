"""``python -m ingest``: the kv-ingest process."""

import sys

from ingest.main import main

sys.exit(main())
