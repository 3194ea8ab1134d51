#!/usr/bin/env python3
"""Regenerate the Python code of proto/kvcache/v1 (the one way to do it).

    python scripts/gen_proto.py          # rewrite the generated files
    python scripts/gen_proto.py --check  # exit 1 if they are stale (CI)
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PKG = PROTO_ROOT / "kvcache" / "v1"
GENERATED = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out: Path) -> list[Path]:
    from grpc_tools import protoc  # test extra: grpcio-tools

    protos = sorted(PKG.glob("*.proto"))
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *[str(p.relative_to(PROTO_ROOT)) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted((out / "kvcache" / "v1").glob("*_pb2*.py*"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail when the checked-in code is stale")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        current = sorted(p for p in PKG.iterdir() if p.name.endswith(GENERATED))
        if args.check:
            stale = [p.name for p in fresh if not (PKG / p.name).exists()
                     or not filecmp.cmp(p, PKG / p.name, shallow=False)]
            extra = sorted({p.name for p in current} - {p.name for p in fresh})
            if stale or extra:
                print(f"generated protobuf code is stale: {stale + extra}; run scripts/gen_proto.py",
                      file=sys.stderr)
                return 1
            print("generated protobuf code is up to date")
            return 0
        for p in current:
            p.unlink()
        for p in fresh:
            (PKG / p.name).write_bytes(p.read_bytes())
        print(f"wrote {len(fresh)} files to {PKG.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
