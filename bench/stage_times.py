"""Host wall time per stage of a measurement, by timing wrappers set on the instances measured
(no profiler overhead): bench_offload's TTFT breakdown and bench_lookup's CPU-hit stages."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


class StageTimes:
    """``spent``: seconds per label since the last ``spent.clear()``."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}

    def wrap(self, obj: Any, name: str, label: str | Callable[[], str] | None = None) -> None:
        """Time ``obj.name`` under ``label`` (the name by default; a callable is asked at each
        call's end, e.g. to tell threads apart). ``delattr(obj, name)`` restores a method."""
        fn = getattr(obj, name)
        spent = self.spent

        def run(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                key = label() if callable(label) else (label or name)
                spent[key] = spent.get(key, 0.0) + time.perf_counter() - t0

        setattr(obj, name, run)
