"""vLLM general plugin (entry point `vllm.general_plugins`): mends a vLLM CPU defect that
lets one valid request kill the engine. Acts only in vLLM worker processes on CPU.

Seeded sampling: when a step throws away a seeded request's sampled token (a prefill split
across steps), vLLM rewinds that request's generator by its Philox offset. A CPU generator
has no offset, so the rewind raises and the engine dies (vLLM 0.32, `_bookkeeping_sync`).
The mend sets those generators aside for the step: the token that is thrown away is drawn
from the shared generator instead, and the request's own generator is left exactly where a
rewind would have put it, so a seed gives the same tokens whether or not its prefill split.
The patch itself is a reach into vLLM's model runner: `rlserve.worker.vllm_compat`.
"""

from __future__ import annotations


def register() -> None:
    # Imported here, not at the top: vLLM loads a plugin's module in a try that only logs, and
    # calls register() outside it, so another vLLM minor stops the process here, loudly.
    from rlserve.worker import vllm_compat

    # Other processes than a CPU worker need no mend.
    if vllm_compat.is_worker_process() and vllm_compat.is_cpu_platform():
        vllm_compat.install_cpu_seeded_sampling()
