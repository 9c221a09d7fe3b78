"""Each side's vLLM compat module refuses a vLLM of another minor version, naming the
reaches to re-check, and accepts the pinned one (whatever its patch or suffix)."""

from __future__ import annotations

import pytest

from rlserve.engine import vllm_compat


@pytest.mark.parametrize("version", ["0.32.0", "0.32.7", "0.32.1rc1", "0.32.0+cpu"])
def test_the_pinned_minor_is_accepted(version):
    vllm_compat.check_version(version)


@pytest.mark.parametrize("version", ["0.33.0", "0.31.2", "1.32.0", "dev", ""])
def test_another_minor_is_refused_naming_every_reach(version):
    with pytest.raises(RuntimeError, match=r"written against vLLM 0\.32\.x") as refused:
        vllm_compat.check_version(version)
    message = str(refused.value)
    assert all(reach in message for reach in vllm_compat.REACHES)
    assert "rlserve.worker.vllm_compat" in message  # the other side has reaches of its own


def test_the_installed_vllm_is_the_pinned_one():
    import vllm

    vllm_compat.check_version(vllm.__version__)


def test_the_worker_side_refuses_another_minor_too():
    from rlserve.worker import vllm_compat as worker_compat

    worker_compat.check_version("0.32.3")
    with pytest.raises(RuntimeError, match="rlserve.engine.vllm_compat") as refused:
        worker_compat.check_version("0.33.0")
    assert all(reach in str(refused.value) for reach in worker_compat.REACHES)
