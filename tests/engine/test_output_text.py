"""engine.output_text: the byte tokenizer's text built token by token is the text of decoding
every output token again, stop strings included (random bytes: invalid and split UTF-8)."""

from __future__ import annotations

import random

import pytest
import torch

from engine.output_text import OutputText, next_output
from engine.request import Request
from engine.sampling import SamplingParams
from events.tokenizer import ByteTokenizer

_PIECES = ["a", "é", "€", "😀", "ü", "z"]


def _tokens(rng: random.Random, n: int) -> list[int]:
    out: list[int] = []
    while len(out) < n:
        kind = rng.random()
        if kind < 0.6:
            out.extend(rng.choice(_PIECES).encode())  # whole characters
        elif kind < 0.8:
            out.append(rng.randrange(128, 256))  # stray continuation / lead bytes
        else:
            out.append(rng.choice([256, 300, 10, 32]))  # specials (no text) and ASCII
    return out[:n]


@pytest.mark.parametrize("seed", range(6))
def test_incremental_text_is_the_full_decode(seed: int) -> None:
    rng = random.Random(seed)
    tok = ByteTokenizer()
    ids = _tokens(rng, 300)
    text = OutputText(tok)
    previous = ""
    for i, t in enumerate(ids):
        got, same = text.append(t, ids[: i + 1])
        assert got == tok.decode(ids[: i + 1])
        assert got[:same] == previous[:same]
        previous = got


@pytest.mark.parametrize("seed", range(6))
def test_stop_strings_cut_where_a_full_search_cuts(seed: int) -> None:
    rng = random.Random(100 + seed)
    tok = ByteTokenizer()
    ids = _tokens(rng, 120)
    full = tok.decode(ids)
    starts = [i for i in range(10, len(full) - 3) if "\ufffd" not in full[i : i + 3]]
    start = rng.choice(starts)
    stops = ("never-there", full[start : start + rng.randrange(1, 4)])
    req = Request("r", [1], SamplingParams(stop=stops), 10_000, (), torch.Generator())
    streamed = ""
    for i, t in enumerate(ids):
        out = next_output(req, t, tok, 100_000)
        streamed += out.new_text
        # The rule as it was: decode everything, find each stop string from the start.
        ref = tok.decode(ids[: i + 1])
        cut = next((ref.find(s) for s in stops if ref.find(s) >= 0), -1)
        if cut >= 0:
            assert out.finished and out.finish_reason == "stop" and req.output_text == ref[:cut]
            break
        assert not out.finished and req.output_text == ref
    else:
        raise AssertionError("the stop string was never met")
    assert streamed == req.output_text  # at the stop, everything before it has streamed
