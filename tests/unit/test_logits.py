"""The chunked output head (modules/policy/logits.py): no full-vocabulary tensor, and a model whose
logits are not head(trunk(x)) is refused. Equality with the full path, for every layout, loss
and gradient in float64, is in tests/unit/test_packing.py (the *_logit_chunks layouts)."""

from __future__ import annotations

import pytest
import torch

from modules.config.errors import ConfigError
from modules.policy.logits import LogitHead
from modules.policy.packing import PackedForward, PaddedForward

V = 97


@pytest.fixture(scope="module")
def model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(cfg).double().train()


def batch(b: int = 6, t: int = 20):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    mask[0, 5:] = 0
    mask[3, 12:] = 0
    return ids, mask


def saved_shapes(fn) -> list[tuple[int, ...]]:
    shapes = []

    def pack(x):
        shapes.append(tuple(x.shape))
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        fn()
    return shapes


@pytest.mark.parametrize("layout", [PaddedForward, PackedForward])
def test_no_full_vocabulary_tensor_is_kept_for_backward(model, layout):
    ids, mask = batch()
    n_targets = int((mask[:, 1:] > 0).sum())
    full = saved_shapes(lambda: layout()(model, ids, mask, 0.7, True))
    chunked = saved_shapes(lambda: layout(logit_chunk=8)(model, ids, mask, 0.7, True))
    vocab_rows = lambda shapes: max((s[0] if len(s) == 2 else s[0] * s[1]) for s in shapes if s[-1] == V)  # noqa: E731
    assert vocab_rows(full) >= n_targets  # the textbook path keeps [N, V] logits
    assert not [s for s in chunked if s[-1] == V], chunked  # checkpointed: only [c, H] inputs saved


def test_chunked_and_full_agree_under_no_grad_too(model):
    ids, mask = batch()
    with torch.no_grad():
        a, ea = PaddedForward()(model, ids, mask, 1.3, True)
        b, eb = PaddedForward(logit_chunk=4)(model, ids, mask, 1.3, True)
    assert torch.allclose(a, b, atol=1e-12) and torch.allclose(ea, eb, atol=1e-12)


def test_a_model_that_post_processes_logits_is_refused(model):
    class SoftCapped(torch.nn.Module):
        """logits = 0.1 tanh(head(trunk(x)) / 0.1): what soft-capping models do (a tight cap, so
        this small random model's logits feel it)."""

        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, **kw):
            out = self.inner(**kw)
            out.logits = 0.1 * torch.tanh(out.logits / 0.1)
            return out

        def get_decoder(self):
            return self.inner.get_decoder()

        def get_output_embeddings(self):
            return self.inner.get_output_embeddings()

    ids, mask = batch()
    with pytest.raises(ConfigError, match="module.forward.logit_chunk"):
        PaddedForward(logit_chunk=8)(SoftCapped(model), ids, mask)


def test_bad_chunk_names_the_field():
    with pytest.raises(ConfigError, match="module.forward.logit_chunk"):
        LogitHead(0)
