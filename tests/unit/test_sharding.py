"""Sharded training (FSDP2 via ``modules/policy/sharding.py``) on 2 CPU gloo ranks.

Trainer-level runs (``tests/sharding_run.py``: the real ``PolicyGradientModule``, ``WeightSync`` and
``SaveHFModel``, a fake engine that scores with a plain HF model of the pushed weights) compare
FSDP with DDP on the same batches; one end-to-end ``train.py trainer=fsdp_cpu`` run uses the real
engine. What does not run on the CPU (FSDP1, Lightning's ``strategy=fsdp``) is asserted with its
exact error.
"""

from __future__ import annotations

import pytest

from tests.conftest import compose


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["trainer=fsdp_cpu", "trainer.devices=1"], "trainer.devices"),
        (["trainer=fsdp_cpu", "module/forward=bucketed"], "module.forward"),
        (["trainer=fsdp_cpu", "module.forward.logit_chunk=64"], "module.forward.logit_chunk"),
        (["trainer.strategy=fsdp"], "trainer.strategy"),
        (["trainer.strategy=fsdp2"], "trainer.strategy"),
        (["trainer=fsdp_cpu", "trainer.strategy.layer_classes=7"], "trainer.strategy.layer_classes"),
    ],
)
def test_bad_sharding_configs_fail_at_start_up(overrides, field):
    from modules.config.errors import ConfigError
    from modules.launch.compose import build
    from modules.launch.validate import validate

    cfg = compose(overrides)
    with pytest.raises(ConfigError, match=f"invalid config value {field}="):
        validate(cfg)
        build(cfg.trainer)  # constructor checks (nothing is built before them)


def test_fsdp_config_composes_to_the_strategy():
    from modules.launch.compose import build
    from modules.launch.validate import validate
    from modules.policy.sharding import FSDP2Strategy

    cfg = compose(["trainer=fsdp_cpu"])
    validate(cfg)
    strategy = build(cfg.trainer.strategy)
    assert isinstance(strategy, FSDP2Strategy) and cfg.trainer.devices == 2
    assert strategy.layer_classes is None and not strategy._save_distributed_checkpoint
