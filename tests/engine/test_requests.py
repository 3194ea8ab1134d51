"""Request validation, sampling and stop conditions, tokenizers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from engine.config import EngineConfig
from engine.errors import InvalidRequest
from engine.llm import LLM
from engine.model.checkpoint import BYTE_EOS_TOKEN_ID
from engine.sampling import SamplingParams


@pytest.fixture(scope="module")
def llm(plain_model: Path) -> LLM:
    return LLM(str(plain_model), max_model_len=128, num_gpu_blocks=64)


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ("", SamplingParams(), "prompt is empty"),
        ([], SamplingParams(), "prompt is empty"),
        ([1] * 128, SamplingParams(), "prompt is too long: 128 tokens, but max_model_len is 128"),
        ([1, 2, 600], SamplingParams(), r"token ids out of range \[0, 512\): \[600\]"),
        ([-3, 2], SamplingParams(), r"token ids out of range \[0, 512\): \[-3\]"),
        ([1, 2**63, 2**70], SamplingParams(), r"token ids out of range \[0, 512\): \[9223372036854775808, "),
        ("hi", SamplingParams(temperature=-0.5), "temperature must be a finite number >= 0, got -0.5"),
        ("hi", SamplingParams(temperature=float("nan")), "temperature must be a finite number >= 0"),
        ("hi", SamplingParams(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
        ("hi", SamplingParams(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
        ("hi", SamplingParams(max_tokens=0), "max_tokens must be >= 1, got 0"),
        ("hi", SamplingParams(seed=-1), "seed must be in"),
        ("hi", SamplingParams(stop=("",)), "stop strings must not be empty"),
    ],
)
def test_bad_requests_are_refused(llm: LLM, prompt: str | list[int], params: SamplingParams, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        llm.generate([prompt], params)
    assert not llm.engine.has_unfinished


def test_one_bad_prompt_refuses_the_whole_batch(llm: LLM) -> None:
    with pytest.raises(InvalidRequest, match="prompt is empty"):
        llm.generate(["fine", ""], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished


def test_request_larger_than_the_pool_is_refused(plain_model: Path) -> None:
    small = LLM(str(plain_model), num_gpu_blocks=4)
    with pytest.raises(InvalidRequest, match="needs up to 5 KV blocks"):
        small.generate([[1] * 70], SamplingParams(max_tokens=8))


def test_bad_engine_config_is_refused(plain_model: Path) -> None:
    with pytest.raises(ValueError, match="dtype bfloat16 needs a CUDA device"):
        EngineConfig(model_dir=str(plain_model), dtype="bfloat16").validate()
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        EngineConfig(model_dir=str(plain_model), block_size=0).validate()


def test_seeded_sampling_is_reproducible(llm: LLM) -> None:
    def run(seed: int) -> list[int]:
        p = SamplingParams(temperature=1.0, top_p=0.9, seed=seed, max_tokens=10, ignore_eos=True)
        return llm.generate(["abc"], p)[0].outputs[0].token_ids

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_tiny_top_p_is_greedy(llm: LLM) -> None:
    greedy = llm.generate(["abc"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    nucleus = llm.generate(["abc"], SamplingParams(temperature=0.7, top_p=1e-6, seed=1, max_tokens=8, ignore_eos=True))
    assert greedy[0].outputs[0].token_ids == nucleus[0].outputs[0].token_ids


def test_tiny_temperature_is_greedy(llm: LLM) -> None:
    # Found by fuzzing: 2.8e-45 overflowed logits / temperature to inf and failed the step.
    greedy = llm.generate(["abc"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    tiny = llm.generate(["abc"], SamplingParams(temperature=2.8e-45, seed=1, max_tokens=8, ignore_eos=True))
    assert tiny[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids


def test_stop_token_ids_and_length(llm: LLM) -> None:
    ref = llm.generate(["abc"], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0].outputs[0]
    assert ref.finish_reason == "length" and len(ref.token_ids) == 6
    stop_at = ref.token_ids[3]
    first = ref.token_ids.index(stop_at)
    out = llm.generate(["abc"], SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=(stop_at,)))[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == ref.token_ids[: first + 1]


def test_stop_string_truncates_text(llm: LLM) -> None:
    ref = llm.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    byte_ids = [t for t in ref.token_ids if t < 128]
    assert byte_ids, "the greedy output should contain at least one ASCII byte"
    stop = chr(byte_ids[0])
    out = llm.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=12, stop=(stop,), ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "stop"
    n = len(out.outputs[0].token_ids)
    assert stop not in out.outputs[0].text and out.outputs[0].token_ids == ref.token_ids[:n]
    assert ref.token_ids[n - 1] == byte_ids[0]


def test_max_model_len_ends_generation(llm: LLM) -> None:
    out = llm.generate([[5] * 120], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 8


def test_eos_ends_generation(llm: LLM) -> None:
    # Force EOS: make it the only stop-free choice by putting it in stop_token_ids' place.
    engine = llm.engine
    req = engine.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=5))
    req.eos_token_ids = (*req.eos_token_ids, *range(512))
    while engine.has_unfinished:
        engine.step()
    assert req.finish_reason == "eos" and len(req.output_token_ids) == 1
    assert BYTE_EOS_TOKEN_ID in engine.model_config.eos_token_ids


def test_byte_tokenizer_round_trips(llm: LLM) -> None:
    assert llm.tokenizer.encode("héllo") == list("héllo".encode())
    assert llm.tokenizer.decode([*list(b"ok"), BYTE_EOS_TOKEN_ID]) == "ok"


def test_tokenizer_json_is_used_when_present(plain_model: Path, tmp_path: Path) -> None:
    words = ["the", "cat", "sat", "on", "mat", "[UNK]"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    model_dir = tmp_path / "m"
    shutil.copytree(plain_model, model_dir)
    tok.save(str(model_dir / "tokenizer.json"))
    llm = LLM(str(model_dir))
    assert llm.tokenizer.encode("the cat sat") == [0, 1, 2]
    out = llm.generate("the cat sat on", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))[0]
    assert out.prompt_token_ids == [0, 1, 2, 3]
    assert json.loads((model_dir / "tokenizer.json").read_text())["model"]["type"] == "WordLevel"


def test_streamed_text_adds_up_to_the_final_text(llm: LLM) -> None:
    engine = llm.engine
    ref = llm.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    ascii_ids = [t for t in ref.token_ids if t < 128]
    stop = chr(ascii_ids[-1])
    for params in (
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=(stop + "\x00zz",)),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=(stop,)),
    ):
        req = engine.add_request("hello", params)
        streamed = ""
        while engine.has_unfinished:
            streamed += "".join(o.new_text for o in engine.step())
        assert streamed == req.output_text
        assert stop not in streamed or params.stop != (stop,)


def test_int_like_token_ids_become_plain_ints(llm: LLM) -> None:
    import enum

    import numpy as np

    class Tok(enum.IntEnum):
        FIVE = 5

    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    want = llm.generate([5, 6, 7], params)[0]
    for outs in (llm.generate([Tok.FIVE, 6, 7], params), llm.generate([[np.int64(5), 6, 7]], params)):
        (out,) = outs
        assert out.prompt_token_ids == [5, 6, 7]
        assert [type(t) for t in out.prompt_token_ids] == [int, int, int]
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
    caller = [5, 6, 7]
    req = llm.engine.add_request(caller, params)
    caller.append(8)  # the request keeps its own copy
    assert req.prompt_token_ids == [5, 6, 7]
    while llm.engine.has_unfinished:
        llm.engine.step()


def test_a_prompt_is_hashed_from_its_checked_array(llm: LLM) -> None:
    """The prompt check hands the ids on as a read-only int64 array, and the block digests
    made from it equal those made from the list."""
    engine = llm.engine
    prompt = list(range(3, 40))
    req = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    assert req.prompt_array is not None and req.prompt_array.dtype == np.int64
    assert req.prompt_array.tolist() == prompt and not req.prompt_array.flags.writeable
    while engine.has_unfinished:
        engine.step()
    bs = engine.hasher.block_size
    assert req.block_digests(engine.hasher, len(prompt) // bs) == engine.hasher.hash_blocks(prompt)


@pytest.mark.parametrize(("flags", "on"), [([], True), (["--async-scheduling"], True), (["--no-async-scheduling"], False)])
def test_async_scheduling_is_on_unless_turned_off(plain_model: Path, flags: list[str], on: bool) -> None:
    """kv-engine's default and both spellings of the flag reach EngineConfig."""
    from engine.__main__ import _engine_config, _parser

    assert EngineConfig(model_dir=str(plain_model)).async_scheduling
    args = _parser().parse_args(["generate", "--model", str(plain_model), *flags, "--prompt", "hi"])
    assert _engine_config(args).async_scheduling is on


def test_request_seeds_are_the_engines_stream_drawn_one_at_a_time(plain_model: Path) -> None:
    """Seeds are drawn ahead in batches; requests get the values one ``torch.randint`` each
    gave (a given seed takes none of them), across the batch boundary."""
    import torch

    llm = LLM(str(plain_model), seed=11, num_gpu_blocks=64)
    gen = torch.Generator().manual_seed(11)
    want = [int(torch.randint(0, 2**62, (1,), generator=gen)) for _ in range(70)]
    params = SamplingParams(temperature=0.7, max_tokens=1)
    got = []
    for i in range(71):
        req = llm.engine.add_request([1, 2, 3], SamplingParams(temperature=0.7, max_tokens=1, seed=5) if i == 3 else params)
        got.append(req.seed)
        llm.engine.abort(req.request_id)
    assert got[3] == 5 and got[:3] + got[4:] == want
