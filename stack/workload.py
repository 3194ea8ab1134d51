"""The demo's workload: documents asked about repeatedly and multi-turn chats, all sharing
prefixes, with more distinct prefixes than an engine's GPU pool holds."""

from __future__ import annotations

import random
from dataclasses import dataclass

WORDS = ["cache", "block", "engine", "router", "memory", "prefix", "token", "layer", "attention", "window", "host", "tier", "daemon", "event", "replay", "snapshot", "offset", "stream", "batch", "store", "load", "evict", "pinned", "arena", "request", "model", "prompt", "decode", "prefill", "latency", "bandwidth", "shared", "fleet", "node", "log", "state"]


@dataclass(frozen=True)
class DemoRequest:
    label: str
    prompt: str
    phase: int


def document(rng: random.Random, i: int, n_words: int) -> str:
    body = " ".join(rng.choice(WORDS) for _ in range(n_words))
    return f"Document {i}. {body}.\n"


def build(short: bool, seed: int = 0) -> list[DemoRequest]:
    """Phase 1: documents read twice (the second time after their blocks left the GPU pools)
    and chats that grow; phase 2: the documents a third time, then two new ones."""
    rng = random.Random(seed)
    n_docs, doc_words, n_chats, n_turns = (6, 60, 2, 3) if short else (12, 80, 4, 5)
    docs = [document(rng, i, doc_words) for i in range(n_docs)]
    out: list[DemoRequest] = []
    for i, doc in enumerate(docs):  # first reads: misses
        out.append(DemoRequest(f"doc{i} q1", doc + "Question: what is it about?", 1))
    for c in range(n_chats):  # each turn extends the last one: GPU hits while it stays resident
        history = f"System: you are chat {c}. Be brief.\n"
        for t in range(n_turns):
            history += f"User: turn {t}, " + " ".join(rng.choice(WORDS) for _ in range(12)) + "\n"
            out.append(DemoRequest(f"chat{c} t{t}", history + "Assistant:", 1))
    for i, doc in enumerate(docs):  # evicted from the GPU pool by now: host-tier hits
        out.append(DemoRequest(f"doc{i} q2", doc + "Question: summarise it.", 1))
    # host-tier hits again, on either engine: in another order than before, so the router's
    # rotation between engines of equal score sends some to the engine that did not compute them
    for i in [*range(1, n_docs), 0]:
        out.append(DemoRequest(f"doc{i} q3", docs[i] + "Question: who wrote it?", 2))
    for i in range(n_docs, n_docs + 2):  # new documents: misses
        out.append(DemoRequest(f"doc{i} q1", document(rng, i, doc_words) + "Question: why?", 2))
    return out
