"""Imports point one way: api <- server <- lifecycle <- engine/transfer. Checked on the source
(direct imports), so a servicer that starts touching torch, or a controller that starts
speaking grpc, fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "rlserve"
# package -> top-level modules it must not import directly
FORBIDDEN = {
    "lifecycle": ("grpc", "rlserve.server", "rlserve.api", "torch", "vllm"),
    # The frontend processes' protocol, the leader's hub and a follower's lifecycle: no grpc.
    "frontends": ("grpc", "rlserve.server", "rlserve.api", "torch", "vllm"),
    "engine": ("grpc", "rlserve.server", "rlserve.api", "rlserve.lifecycle"),
    "transfer": ("grpc", "rlserve.server", "rlserve.api", "rlserve.lifecycle", "rlserve.engine"),
    "server": ("torch", "vllm", "rlserve.transfer.engines", "rlserve.transfer.gloo_group", "rlserve.transfer.shm"),
    # The RL loop is a client: it reaches the server only through the SDK and gRPC.
    "rl": ("vllm", "rlserve.server", "rlserve.lifecycle", "rlserve.engine", "rlserve.transfer"),
}


def imports_of(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_point_one_way(package):
    bad = []
    for path in sorted((SRC / package).glob("*.py")):
        for name in imports_of(path):
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN[package]):
                bad.append(f"{path.relative_to(SRC)} imports {name}")
    assert not bad, bad


# What each layer may load at all, through any chain of imports (a servicer that reaches torch
# through `convert`, say): checked in a fresh interpreter.
TRANSITIVELY_FORBIDDEN = {
    "rlserve.server.servicers": (
        [
            "rlserve.server.convert",
            "rlserve.server.control",
            "rlserve.server.inference",
            "rlserve.server.lifecycle",
            "rlserve.server.access",
            "rlserve.server.auth",
            "rlserve.server.metrics",
            "rlserve.server.listeners",
        ],
        ("torch", "vllm"),
    ),
    "rlserve.lifecycle": (
        ["rlserve.lifecycle.controller", "rlserve.lifecycle.weight_updates", "rlserve.lifecycle.loras"],
        ("torch", "vllm", "grpc"),
    ),
}


@pytest.mark.parametrize("layer", sorted(TRANSITIVELY_FORBIDDEN))
def test_layers_load_nothing_below_them_transitively(layer):
    import subprocess
    import sys

    modules, forbidden = TRANSITIVELY_FORBIDDEN[layer]
    code = (
        f"import sys\nfor m in {modules!r}: __import__(m)\nprint(sorted(m for m in {forbidden!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", f"{layer} loads {out.stdout.strip()}"
