"""The house is sorted by the process that runs the code, and imports point one way:

- vocabulary (`types`, `errors`, `config`, `caller`, `payloads`, `model_cache`, `parent`, `api/`): every
  side; imports nothing else of rlserve;
- `wire/`: formats every process shares; only the vocabulary;
- `worker/`: inside vLLM's processes; only `wire/` and the vocabulary (and vLLM);
- `sdk/`: the trainer's process; only `wire/`, `api/` and the vocabulary; no vLLM;
- the server's process: `server/` (grpc) over `frontends/` and `lifecycle/` (no grpc, no
  torch) over `engine/` (vLLM); `engine/` names the worker methods it calls in another
  process (`worker.extension`) and nothing else of the worker; no side of it imports the SDK;
- `rl/`: a client; the SDK and gRPC only;
- `integrations/`: RL frameworks over rlserve (TRL); clients of the SDK and `rl/`; no vLLM.

Checked on the source (direct imports), so a servicer that starts touching torch, or a
controller that starts speaking grpc, fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "rlserve"
VOCABULARY = ("types", "errors", "config", "caller", "payloads", "model_cache", "parent", "api")
SIDES = ("wire", "worker", "sdk", "server", "frontends", "lifecycle", "engine", "rl", "integrations", "cli")
# The faces: documented import paths of the SDK, kept where users import them from.
FACES = ("client", "trainer", "ray", "fleet")


def rlserve(*names: str) -> tuple[str, ...]:
    return tuple(f"rlserve.{n}" for n in names)


def but(*allowed: str) -> tuple[str, ...]:
    """Every side of rlserve and its faces except the vocabulary and `allowed`."""
    return rlserve(*(n for n in SIDES + FACES if n not in allowed))


# package (or vocabulary module) -> modules it must not import directly
FORBIDDEN = {
    **{name: but() for name in VOCABULARY if name != "api"},
    "wire": ("grpc", "vllm", *but("wire"), "rlserve.api"),
    "worker": ("grpc", *but("wire", "worker"), "rlserve.api"),
    "sdk": ("vllm", *but("wire", "sdk")),
    "engine": ("grpc", "rlserve.api", *but("wire", "engine", "worker")),
    "lifecycle": ("grpc", "torch", "vllm", "rlserve.api", *but("lifecycle", "engine")),
    # The frontend processes' protocol, the leader's hub and a follower's lifecycle: no grpc.
    "frontends": ("grpc", "torch", "vllm", "rlserve.api", *but("frontends", "lifecycle", "engine")),
    "server": ("torch", "vllm", *but("server", "frontends", "lifecycle", "engine")),
    "rl": ("vllm", *but("rl", "sdk")),
    "integrations": ("vllm", *but("integrations", "rl", "sdk")),
    **{face: ("vllm", *but("sdk")) for face in FACES},
}
# What `engine/` may take of the worker: the extension whose methods it calls by reference.
ENGINE_REACHES_INTO_THE_WORKER = "rlserve.worker.extension"


def imports_of(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def sources(name: str) -> list[Path]:
    if (SRC / f"{name}.py").exists():
        return [SRC / f"{name}.py"]
    return sorted((SRC / name).rglob("*.py"))


def forbidden(package: str, name: str) -> bool:
    if package == "engine" and (name == ENGINE_REACHES_INTO_THE_WORKER):
        return False
    if package == "engine" and (name == "rlserve.worker" or name.startswith("rlserve.worker.")):
        return True
    return any(name == f or name.startswith(f + ".") for f in FORBIDDEN[package])


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_point_one_way(package):
    bad = []
    for path in sources(package):
        for name in imports_of(path):
            if forbidden(package, name):
                bad.append(f"{path.relative_to(SRC)} imports {name}")
    assert not bad, bad


def test_every_module_has_a_rule():
    """A new room is placed in the house, not left outside every rule."""
    ruled = set(FORBIDDEN) | {"api", "__init__", "__main__", "cli"}
    rooms = {
        p.stem if p.is_file() else p.name
        for p in SRC.iterdir()
        if p.suffix == ".py" or (p.is_dir() and p.name != "__pycache__")
    }
    assert rooms <= ruled, sorted(rooms - ruled)


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
    # The trainer's process holds no vLLM and no server or worker code.
    "rlserve.sdk": (
        ["rlserve.sdk.weight_sync", "rlserve.sdk.fleet", "rlserve.sdk.launch", "rlserve.trainer", "rlserve.fleet"],
        ("vllm", "rlserve.server", "rlserve.engine", "rlserve.lifecycle", "rlserve.worker", "rlserve.cli"),
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
