"""Generate the Python stubs for every .proto under src/rlserve/api, next to each .proto.

The proto path is `src`, so generated imports read `from rlserve.api.vllm import ...` and never
collide with the real `vllm` package. `--check` generates into a temp dir instead and exits 1,
listing every committed file that differs, is missing or is stale (the drift check).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import grpc_tools
from grpc_tools import protoc

SRC = Path(__file__).resolve().parent.parent / "src"
API = SRC / "rlserve" / "api"
WELL_KNOWN_TYPES = Path(grpc_tools.__file__).parent / "_proto"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
API_DOCSTRING = '"""Generated gRPC stubs: do not edit. Regenerate with scripts/gen_protos.py."""\n'
PACKAGE_INITS = {
    "rlserve/api/__init__.py": API_DOCSTRING,
    "rlserve/api/vllm/__init__.py": "",
    "rlserve/api/rlserve/__init__.py": "",
    "rlserve/api/rlserve/v1/__init__.py": "",
}


def generate(out_root: Path) -> None:
    """Write the stubs and package __init__ files for all protos under out_root (a `src`)."""
    protos = sorted(str(p.relative_to(SRC)) for p in API.rglob("*.proto"))
    args = [
        "grpc_tools.protoc",
        f"--proto_path={SRC}",
        f"--proto_path={WELL_KNOWN_TYPES}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed on {protos}")
    for rel, text in PACKAGE_INITS.items():
        (out_root / rel).parent.mkdir(parents=True, exist_ok=True)
        (out_root / rel).write_text(text)


def generated_files(root: Path) -> set[str]:
    """Paths (relative to root) of the files this script owns under root/rlserve/api."""
    api = root / "rlserve" / "api"
    found = {str(p.relative_to(root)) for p in api.rglob("*") if p.name.endswith(GENERATED_SUFFIXES)}
    return found | {rel for rel in PACKAGE_INITS if (root / rel).exists()}


def check() -> int:
    """Return 0 when the committed stubs equal freshly generated ones, else 1 (listing drift)."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        generate(fresh)
        expected, committed = generated_files(fresh), generated_files(SRC)
        drift = sorted(
            rel for rel in expected if rel not in committed or (SRC / rel).read_bytes() != (fresh / rel).read_bytes()
        )
        drift += sorted(f"{rel} (stale: no .proto generates it)" for rel in committed - expected)
    for rel in drift:
        print(f"out of date: src/{rel}", file=sys.stderr)
    if drift:
        print("run: python scripts/gen_protos.py", file=sys.stderr)
    return 1 if drift else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if committed stubs drift")
    if parser.parse_args().check:
        return check()
    generate(SRC)
    return 0


if __name__ == "__main__":
    sys.exit(main())
