"""vLLM general plugin (entry point `vllm.general_plugins`): mends a vLLM CPU defect that
lets one valid request kill the engine. Acts only in vLLM worker processes on CPU.

Seeded sampling: when a step throws away a seeded request's sampled token (a prefill split
across steps), vLLM rewinds that request's generator by its Philox offset. A CPU generator
has no offset, so the rewind raises and the engine dies (vLLM 0.32, `_bookkeeping_sync`).
The mend sets those generators aside for the step: the token that is thrown away is drawn
from the shared generator instead, and the request's own generator is left exactly where a
rewind would have put it, so a seed gives the same tokens whether or not its prefill split.
"""

from __future__ import annotations

import contextlib
import functools
import sys

MARK = "_rlserve_cpu_seeded_sampling"


def register() -> None:
    # A worker loads general plugins from worker_base; other processes need no mend.
    if "vllm.v1.worker.worker_base" not in sys.modules:
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner.sample_tokens, MARK, False):
        return
    original = GPUModelRunner.sample_tokens

    @functools.wraps(original)
    def sample_tokens(self, *args, **kwargs):
        with _discarded_generators_set_aside(self):
            return original(self, *args, **kwargs)

    setattr(sample_tokens, MARK, True)
    GPUModelRunner.sample_tokens = sample_tokens


@contextlib.contextmanager
def _discarded_generators_set_aside(runner):
    generators = runner.input_batch.generators
    discard = runner.discard_request_mask.np
    aside = {i: g for i, g in generators.items() if i < len(discard) and discard[i] and g.device.type == "cpu"}
    for i in aside:
        del generators[i]
    try:
        yield
    finally:
        generators.update(aside)
