"""``kvctl hash``: the 64-bit wire hash of each full block of a token sequence, as vLLM does it."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from events.extra_keys import KEY_FORMS, MultiModalItem, RequestKeys
from events.hashing import DEFAULT_SEED, HASH_ALGOS, BlockHasher, env_hash_seed, to_wire
from kvctl.errors import KvctlError


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "hash",
        help="print the wire hash of each full block of TOKENs",
        description="Print one line per full block: the 64-bit wire hash (decimal) a vLLM engine "
        "with --prefix-caching-hash-algo sha256_cbor publishes for TOKENs, with the same seed "
        "and extra keys. A trailing partial block is skipped.",
        epilog="Extra keys follow vLLM: --lora-name/--lora-path on every block, multimodal items "
        "on the blocks they overlap, --cache-salt on the first block only; vLLM 0.33 tags each "
        "key with its kind (--key-form tagged), older versions mix in the bare values "
        "(--key-form untagged). --extra-key mixes the same untagged tuple into every block.",
    )
    seed = env_hash_seed(os.environ)
    p.add_argument(
        "--seed", default=seed,
        help=f"hash seed, as vLLM's PYTHONHASHSEED; default: $PYTHONHASHSEED, else {DEFAULT_SEED!r} "
        f"as vLLM uses without it (now {seed!r})",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per block; default 16")
    p.add_argument("--algo", choices=HASH_ALGOS, default="sha256_cbor")
    p.add_argument("--lora-name", help="LoRA adapter name (vLLM: every block)")
    p.add_argument("--lora-path", help="LoRA adapter path (hashed with the name in the tagged form)")
    p.add_argument("--cache-salt", help="the request's cache_salt (vLLM: first block only)")
    p.add_argument(
        "--mm", action="append", default=[], metavar="ID:OFFSET:LENGTH",
        help="a multimodal item: its identifier (hash) and the prompt positions of its "
        "placeholder tokens; repeatable, in prompt order",
    )
    p.add_argument("--key-form", choices=KEY_FORMS, default="tagged",
                   help="tagged (vLLM 0.33, default) or untagged (older vLLM) extra keys")
    p.add_argument(
        "--extra-key", action="append", dest="extra_keys", metavar="K",
        help="an untagged key mixed into every block (our older form); repeatable; "
        "excludes the LoRA, salt and multimodal options",
    )
    p.add_argument("tokens", nargs="+", metavar="TOKEN", help="token ids (non-negative ints)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    tokens = [_token(t) for t in args.tokens]
    hasher = BlockHasher(seed=args.seed, block_size=args.block_size, algo=args.algo)
    digests = hasher.hash_request(tokens, request_keys(args))
    if not digests:
        print(
            f"kvctl: note: no full block ({len(tokens)} tokens < block size {args.block_size})",
            file=sys.stderr,
        )
    for digest in digests:
        print(to_wire(digest))
    return 0


def request_keys(args: argparse.Namespace) -> RequestKeys | None:
    """The request's extra keys from the flags; ValueError (a one-line error) when they clash."""
    mm = tuple(_mm_item(text) for text in args.mm)
    keys = RequestKeys(
        lora_name=args.lora_name or None, lora_path=args.lora_path or None,
        cache_salt=args.cache_salt or None, mm_items=mm, form=args.key_form,
        fixed=None if args.extra_keys is None else tuple(args.extra_keys),
    )
    return None if keys.is_empty else keys


def _mm_item(text: str) -> MultiModalItem:
    ident, sep, rest = text.rpartition(":")
    ident, sep2, offset = ident.rpartition(":")
    try:
        if not (sep and sep2):
            raise ValueError
        return MultiModalItem(ident, int(offset, 10), int(rest, 10))
    except ValueError as exc:
        detail = f": {exc}" if str(exc) else ""
        raise KvctlError(f"--mm {text!r} is not ID:OFFSET:LENGTH{detail}") from None


def _token(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise KvctlError(f"token {text!r} is not an integer") from None
    if value < 0:
        raise KvctlError(f"token {value} is negative; token ids are non-negative")
    return value
