"""The worker side's vLLM compat module is the one place worker code reaches into vLLM's and
torch's internals: it refuses another vLLM minor naming each reach (and gloo's torch privates,
which live in wire/), and no other worker module imports vLLM past its plugin interfaces or
names the private tables and flags it wraps. Pure: no engine."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from rlserve.wire import gloo_group
from rlserve.worker import vllm_compat

SRC = Path(__file__).resolve().parent.parent / "src" / "rlserve"
# What worker modules other than vllm_compat may import of vLLM: the interfaces rlserve
# implements (INTERFACES) and the config type.
INTERFACE_MODULES = {
    "vllm.distributed.weight_transfer.base",
    "vllm.distributed.weight_transfer.factory",
    "vllm.config",
}
# Private names of vLLM's and torch's objects that only vllm_compat may spell.
PRIVATE_NAMES = (
    "_parameters",
    "_buffers",
    "_modules",
    "_non_persistent_buffers_set",
    "_already_called_process_weights_after_loading",
    "input_batch",
    "discard_request_mask",
    "sample_tokens",
    "weight_transfer_engine",
)


def worker_modules() -> list[Path]:
    return [p for p in sorted((SRC / "worker").glob("*.py")) if p.name != "vllm_compat.py"]


def names_in(path: Path) -> set[str]:
    """Every identifier, attribute and string constant of a module's code (not its comments)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.add(node.value)
    return found


def vllm_imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.split(".")[0] == "vllm")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
            names.add(node.module)
    return names


@pytest.mark.parametrize("version", ["0.32.0", "0.32.9", "0.32.1rc2", "0.32.0+cpu"])
def test_the_pinned_minor_is_accepted(version):
    vllm_compat.check_version(version)


@pytest.mark.parametrize("version", ["0.33.0", "0.31.9", "1.32.0", "nightly", ""])
def test_another_minor_is_refused_naming_what_to_recheck(version):
    with pytest.raises(RuntimeError, match=r"written against vLLM 0\.32\.x") as refused:
        vllm_compat.check_version(version)
    message = str(refused.value)
    assert all(reach in message for reach in vllm_compat.REACHES)
    assert all(interface in message for interface in vllm_compat.INTERFACES)
    assert "rlserve.engine.vllm_compat" in message


def test_the_gloo_groups_torch_privates_are_among_the_reaches():
    assert gloo_group.TORCH_PRIVATES
    assert set(gloo_group.TORCH_PRIVATES) <= set(vllm_compat.REACHES)


def test_only_the_compat_module_imports_vllm_past_its_interfaces():
    bad = {p.name: sorted(vllm_imports(p) - INTERFACE_MODULES) for p in worker_modules()}
    assert not {name: mods for name, mods in bad.items() if mods}


def test_only_the_compat_module_names_vllm_and_torch_privates():
    bad = {p.name: sorted(names_in(p) & set(PRIVATE_NAMES)) for p in worker_modules()}
    assert not {name: names for name, names in bad.items() if names}


def test_gloos_private_options_are_spelled_in_one_module():
    spelled = [p.relative_to(SRC) for p in sorted(SRC.rglob("*.py")) if "_Options" in names_in(p)]
    assert spelled == [Path("wire/gloo_group.py")]
