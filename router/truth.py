"""Prediction truth: per request, the cached prefix the router predicted vs the one the engine
reports it reused (``usage.prompt_tokens_details``), and why they differ.

Outcomes:
- ``agree``: the same number of tokens;
- ``event_lag``: the engine reused more, and the router's view shows those blocks by the time
  the request finished, or showed the engine storing them since the decision (their events had
  not reached it when it decided);
- ``hash_mismatch``: the engine reused more, and the router still cannot find them: its hashes
  differ from the engine's (seed, block size, algorithm, tokenizer or chat template);
- ``eviction_race``: the engine reused less: blocks the view showed were evicted (or their
  removal not yet seen) before the engine admitted the request;
- ``eviction_overestimate``: the engine reused more, but no more than the view showed: blocks
  the router expected its requests in flight to evict first were still there (router.pressure).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Any

OUTCOMES = ("agree", "event_lag", "hash_mismatch", "eviction_race", "eviction_overestimate")
MAX_DECISIONS = 50


def classify(predicted: int, reported: int, predicted_now: int, at_risk: int = 0) -> str:
    """``predicted_now``: what the view predicts for the same engine when the request ended;
    ``at_risk``: tokens the view showed that the prediction left out as soon to be evicted."""
    if reported == predicted:
        return "agree"
    if reported > predicted:
        if reported <= predicted + at_risk:
            return "eviction_overestimate"
        return "event_lag" if predicted_now >= reported else "hash_mismatch"
    return "eviction_race"


@dataclass
class Truth:
    """Counts by outcome, tokens predicted and reported, and the most recent decisions."""

    outcomes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    predicted_tokens: int = 0
    reported_tokens: int = 0
    decisions: collections.deque[dict[str, Any]] = field(
        default_factory=lambda: collections.deque(maxlen=MAX_DECISIONS))
    decisions_by_reason: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)

    def decided(self, request_id: str, engine: str, reason: str, predicted: int,
                at_risk: int = 0) -> dict[str, Any]:
        """Record a decision; the returned entry gets its outcome when the engine reports."""
        self.decisions_by_reason[(reason, engine)] += 1
        entry: dict[str, Any] = {"t": time.time(), "request_id": request_id, "engine": engine,
                                 "reason": reason, "predicted_cached_tokens": predicted,
                                 "at_risk_cached_tokens": at_risk, "cached_tokens": None}
        self.decisions.append(entry)
        return entry

    def reported(self, entry: dict[str, Any], reported: int, predicted_now: int) -> str:
        predicted = int(entry["predicted_cached_tokens"])
        outcome = classify(predicted, reported, predicted_now, int(entry.get("at_risk_cached_tokens", 0)))
        entry["cached_tokens"] = reported
        entry["outcome"] = outcome
        self.outcomes[outcome] += 1
        self.predicted_tokens += predicted
        self.reported_tokens += reported
        return outcome

    @property
    def agreement(self) -> float:
        """Share of reported requests whose prediction was exact (1.0 before any)."""
        total = sum(self.outcomes.values())
        return self.outcomes["agree"] / total if total else 1.0
