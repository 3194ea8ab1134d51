"""``kvctl hash``: the 64-bit wire hash of each full block of a token sequence."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from events.hashing import HASH_ALGOS, BlockHasher, to_wire
from kvctl.errors import KvctlError


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "hash",
        help="print the wire hash of each full block of TOKENs",
        description="Print one line per full block: the 64-bit wire hash (decimal), as a vLLM "
        "engine with PYTHONHASHSEED=SEED publishes it. A trailing partial block is skipped.",
    )
    p.add_argument("--seed", default="0", help="hash seed (vLLM's PYTHONHASHSEED); default 0")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block; default 16")
    p.add_argument("--algo", choices=HASH_ALGOS, default="sha256_cbor")
    p.add_argument(
        "--extra-key",
        action="append",
        dest="extra_keys",
        metavar="K",
        help="an extra key mixed into every block (LoRA name, cache salt); repeatable",
    )
    p.add_argument("tokens", nargs="+", metavar="TOKEN", help="token ids (non-negative ints)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    tokens = [_token(t) for t in args.tokens]
    hasher = BlockHasher(seed=args.seed, block_size=args.block_size, algo=args.algo)
    extra = None if args.extra_keys is None else tuple(args.extra_keys)
    digests = hasher.hash_blocks(tokens, extra_keys=extra)
    if not digests:
        print(
            f"kvctl: note: no full block ({len(tokens)} tokens < block size {args.block_size})",
            file=sys.stderr,
        )
    for digest in digests:
        print(to_wire(digest))
    return 0


def _token(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise KvctlError(f"token {text!r} is not an integer") from None
    if value < 0:
        raise KvctlError(f"token {value} is negative; token ids are non-negative")
    return value
