"""``kvctl hash`` as a user runs it, against an independent sha256 + hand-written CBOR chain."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import xxhash

from kvctl import main
from tests.events.test_hashing import _cbor, _reference_chain

Digest = Callable[[bytes], bytes]
ROOT = Path(__file__).resolve().parents[2]


def kvctl(*args: str, seed_env: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run kvctl with PYTHONHASHSEED unset, or set to ``seed_env``."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if seed_env is not None:
        env["PYTHONHASHSEED"] = seed_env
    return subprocess.run(
        [sys.executable, "-m", "kvctl", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def _reference(
    tokens: list[int], seed: str, bs: int, extra: tuple[str, ...] | None, h: Digest
) -> list[int]:
    parent = h(_cbor(seed))
    out = []
    for i in range(0, len(tokens) - bs + 1, bs):
        parent = h(_cbor([parent, tokens[i : i + bs], None if extra is None else list(extra)]))
        out.append(int.from_bytes(parent[-8:], "big"))
    return out


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def test_hash_subprocess_matches_reference() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 70000, 9]
    got = kvctl("hash", "--seed", "42", "--block-size", "3", *map(str, tokens))
    assert got.returncode == 0, got.stderr
    want = _reference_chain(tokens, "42", 3)
    assert len(want) == 2
    assert got.stdout == "".join(f"{h}\n" for h in want)
    assert got.stderr == ""


def test_default_seed_is_vllms_and_follows_pythonhashseed() -> None:
    tokens = [str(t) for t in range(8)]
    plain = kvctl("hash", "--block-size", "4", *tokens)
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.split() == [str(h) for h in _reference_chain(list(range(8)), "vllm-none-hash", 4)]
    seeded = kvctl("hash", "--block-size", "4", *tokens, seed_env="0")
    assert seeded.stdout.split() == [str(h) for h in _reference_chain(list(range(8)), "0", 4)]
    explicit = kvctl("hash", "--seed", "0", "--block-size", "4", *tokens)
    assert explicit.stdout == seeded.stdout  # an explicit seed wins and equals the old default
    assert "PYTHONHASHSEED" in kvctl("hash", "--help").stdout


def test_vllm_extra_key_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """LoRA on every block, salt on the first, an image on the blocks it overlaps (tagged)."""
    argv = ["hash", "--seed", "0", "--block-size", "2", "--lora-name", "a", "--lora-path", "/p",
            "--cache-salt", "s", "--mm", "img:x:3:2", "1", "2", "3", "4", "5", "6"]
    assert main(argv) == 0
    keys = [
        [["lora", "a", "/p"], ["cache_salt", "s"]],
        [["lora", "a", "/p"], ["mm", "img:x", 1]],
        [["lora", "a", "/p"], ["mm", "img:x", -1]],
    ]
    parent, want = _sha256(_cbor("0")), []
    for i, k in enumerate(keys):
        parent = _sha256(_cbor([parent, [1, 2, 3, 4, 5, 6][2 * i : 2 * i + 2], k]))
        want.append(int.from_bytes(parent[-8:], "big"))
    assert capsys.readouterr().out.split() == [str(h) for h in want]
    untagged = ["hash", "--seed", "0", "--block-size", "2", "--key-form", "untagged",
                "--cache-salt", "s", "--lora-name", "a", "1", "2"]
    assert main(untagged) == 0
    want1 = _sha256(_cbor([_sha256(_cbor("0")), [1, 2], ["a", "s"]]))
    assert capsys.readouterr().out == f"{int.from_bytes(want1[-8:], 'big')}\n"


def test_hash_algo_and_extra_keys(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "hash",
        "--seed",
        "0",
        "--block-size",
        "2",
        "--extra-key",
        "lora-a",
        "--extra-key",
        "salt",
        "1",
        "2",
        "3",
        "4",
    ]
    assert main(argv) == 0
    want = _reference([1, 2, 3, 4], "0", 2, ("lora-a", "salt"), _sha256)
    assert capsys.readouterr().out.split() == [str(h) for h in want]
    assert main(["hash", "--seed", "0", "--algo", "xxh3_128_cbor", "--block-size", "2", "5", "6"]) == 0
    want = _reference([5, 6], "0", 2, None, xxhash.xxh3_128_digest)
    assert capsys.readouterr().out == f"{want[0]}\n"


def test_partial_block_prints_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["hash", "--block-size", "16", "1", "2"]) == 0
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err == "kvctl: note: no full block (2 tokens < block size 16)\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["hash", "1", "x"], "kvctl: error: token 'x' is not an integer\n"),
        (["hash", "1", "-5"], "kvctl: error: token -5 is negative; token ids are non-negative\n"),
        (["hash", "1.5"], "kvctl: error: token '1.5' is not an integer\n"),
        (["hash", "--block-size", "0", "1"], "kvctl: error: block_size must be > 0, got 0\n"),
        (["hash", "--lora-name", "a", "1"], "kvctl: error: vLLM's tagged form hashes ('lora', name, "
         "path): give the adapter's path too (or use the untagged form of older vLLM versions)\n"),
        (["hash", "--lora-path", "/p", "1"], "kvctl: error: a LoRA path needs a LoRA name\n"),
        (["hash", "--extra-key", "k", "--cache-salt", "s", "1"],
         "kvctl: error: fixed extra keys exclude the LoRA, cache salt and multimodal keys\n"),
        (["hash", "--mm", "img:3", "1"], "kvctl: error: --mm 'img:3' is not ID:OFFSET:LENGTH\n"),
        (["hash", "--mm", "img:3:0", "1"], "kvctl: error: --mm 'img:3:0' is not ID:OFFSET:LENGTH: "
         "multimodal item 'img': offset must be >= 0 and length >= 1, got offset 3, length 0\n"),
        (["hash", "--mm", "a:0:4", "--mm", "b:2:1", "1"], "kvctl: error: multimodal items must be "
         "sorted and not overlap: 'b' at 2 starts before 'a' (0+4) ends\n"),
    ],
)
def test_bad_input_is_a_clear_error(args: list[str], message: str) -> None:
    got = kvctl(*args)
    assert (got.returncode, got.stdout, got.stderr) == (2, "", message)


@pytest.mark.parametrize(
    "args",
    [[], ["hash"], ["hash", "--algo", "md5", "1"], ["hash", "--block-size", "two", "1"], ["nope"]],
)
def test_bad_usage_exits_2_without_traceback(args: list[str]) -> None:
    got = kvctl(*args)
    assert got.returncode == 2
    assert "error:" in got.stderr and "Traceback" not in got.stderr


def test_help_lists_hash() -> None:
    got = kvctl("--help")
    assert got.returncode == 0 and "hash" in got.stdout
