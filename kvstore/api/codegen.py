"""Regenerate the committed gRPC code in ``kvstore/api/v1`` from ``proto/kvstore/v1``.

    python3 -m kvstore.api.codegen            # rewrite kvstore/api/v1/
    python3 -m kvstore.api.codegen --check    # exit 1 if the committed code is stale

protoc names the generated modules after the proto package (``kvstore.v1``), but the code lives
at ``kvstore.api.v1`` (``kvstore`` is our only import root), so the one import line protoc writes
into the ``_grpc`` module is rewritten. A test regenerates into a temp dir and compares bytes.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "proto"
PROTO_FILE = Path("kvstore/v1/kvstore.proto")
COMMITTED_DIR = REPO_ROOT / "kvstore" / "api" / "v1"
GENERATED = ("kvstore_pb2.py", "kvstore_pb2.pyi", "kvstore_pb2_grpc.py")


def generate(out_dir: Path, proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Write the generated modules for the proto under ``proto_root`` into ``out_dir``."""
    from grpc_tools import protoc  # dev dependency; imported only when generating

    with tempfile.TemporaryDirectory() as scratch:
        status = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{proto_root}",
                f"--python_out={scratch}",
                f"--pyi_out={scratch}",
                f"--grpc_python_out={scratch}",
                str(proto_root / PROTO_FILE),
            ]
        )
        if status != 0:
            raise RuntimeError(f"protoc failed with status {status} on {PROTO_FILE}")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name in GENERATED:
            text = (Path(scratch) / PROTO_FILE.parent / name).read_text()
            text = text.replace("from kvstore.v1 import", "from kvstore.api.v1 import")
            target = out_dir / name
            target.write_text(text)
            written.append(target)
    return written


def is_fresh() -> bool:
    """True when the committed generated code equals a fresh generation, byte for byte."""
    with tempfile.TemporaryDirectory() as scratch:
        generate(Path(scratch))
        return all(
            (Path(scratch) / name).read_bytes() == (COMMITTED_DIR / name).read_bytes()
            for name in GENERATED
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check that the code is fresh")
    args = parser.parse_args(argv)
    if args.check:
        fresh = is_fresh()
        print("generated code is fresh" if fresh else "generated code is STALE: run codegen")
        return 0 if fresh else 1
    for path in generate(COMMITTED_DIR):
        print(f"wrote {path.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
