"""Regenerate the committed Python stubs from protos/specdec/v1/*.proto.

    python protos/generate.py          # write *_pb2.py, *_pb2.pyi, *_pb2_grpc.py next to the protos
    python protos/generate.py --check  # exit 1 if regenerating would change a committed file

Stubs are generated with grpcio-tools 1.84.0 (the oldest grpcio we support, the GPU host's): a stub
refuses to load on a grpcio older than the grpcio-tools that wrote it.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PACKAGE_DIR = PROTO_ROOT / "specdec" / "v1"
GRPCIO_TOOLS_VERSION = "1.84.0"
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Run protoc over every proto into out_dir; return the generated files, relative to out_dir."""
    from grpc_tools import protoc

    protos = sorted(p.relative_to(PROTO_ROOT).as_posix() for p in PACKAGE_DIR.glob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted(p.relative_to(out_dir) for p in out_dir.rglob("*") if p.name.endswith(SUFFIXES))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail if the committed stubs are stale")
    args = parser.parse_args()
    installed = version("grpcio-tools")
    if installed != GRPCIO_TOOLS_VERSION:
        print(f"grpcio-tools {installed} installed; stubs are made with {GRPCIO_TOOLS_VERSION}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        generated = generate(out)
        committed = sorted(p.relative_to(PROTO_ROOT) for p in PACKAGE_DIR.iterdir() if p.name.endswith(SUFFIXES))
        if args.check:
            stale = [
                str(p)
                for p in generated
                if not (PROTO_ROOT / p).exists() or not filecmp.cmp(out / p, PROTO_ROOT / p, shallow=False)
            ]
            stale += [str(p) for p in committed if p not in generated]
            if stale:
                print("stale generated stubs (run python protos/generate.py):", *stale, sep="\n  ", file=sys.stderr)
                return 1
            print(f"{len(generated)} generated stubs are up to date")
            return 0
        for p in committed:
            if p not in generated:
                (PROTO_ROOT / p).unlink()
        for p in generated:
            shutil.copyfile(out / p, PROTO_ROOT / p)
        print(f"wrote {len(generated)} files under {PACKAGE_DIR.relative_to(PROTO_ROOT.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
