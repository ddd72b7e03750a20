"""Delayed weight sync (``callbacks.weight_sync.lag``): the engine serves exactly version v - K.

No engine here: a recording datamodule stands in for it and scores sequences with the weights
it last received, so the verify pass (trainer logprobs with the delayed weights) is exercised.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from modules.callbacks.weight_sync import WeightSync, WeightSyncError
from modules.policy.hf_policy import build_policy, load_policy, named_weights, token_logprobs
from modules.policy.lora import LoRA, is_lora


class RecordingEngine:
    """What ``WeightSync`` needs of the datamodule: it loads what it is sent into its own copy
    of the model, and scores with that copy."""

    def __init__(self, policy: torch.nn.Module) -> None:
        self.model = copy.deepcopy(policy).eval()
        self.received: list[tuple[int, dict[str, torch.Tensor]]] = []
        self.trainer_version: int | None = None

    def set_trainer_version(self, version: int) -> None:
        self.trainer_version = version

    def sync_weights(self, named: dict[str, torch.Tensor], version: int) -> float:
        self.received.append((version, {k: v.clone() for k, v in named.items()}))
        self.model.load_state_dict(named, strict=False)
        if getattr(self.model.config, "tie_word_embeddings", False):
            self.model.tie_weights()
        return 0.0

    def engine_logprobs(self, seq: list[int]) -> list[float]:
        ids = torch.tensor([seq])
        with torch.no_grad():
            lp, _ = token_logprobs(self.model, ids, torch.ones_like(ids), 1.0)
        return lp[0].tolist()


@pytest.fixture(params=["tied", "untied", "tied-lora"])
def setup(request, models):
    """A trainer-side policy and a recording engine; ``-lora``: the policy trains LoRA adapters
    and the engine (a plain HF model) gets merged weights, delayed ones verified too."""
    name, _, lora = request.param.partition("-")
    policy, _ = load_policy(str(models[name]))
    engine = RecordingEngine(policy)
    if lora:
        torch.manual_seed(0)  # the adapters' A init
        policy, _ = build_policy(str(models[name]), lora=LoRA(rank=4))
        policy.eval()
    trainer = SimpleNamespace(world_size=1, global_rank=0, datamodule=engine, global_step=0)
    module = SimpleNamespace(
        policy=policy,
        tokenizer=None,
        policy_version=0,
        device=torch.device("cpu"),
        weights_for_engine=lambda: named_weights(policy),
        last_weight_sync_s=0.0,
        last_weight_verify_s=0.0,
        last_weight_sync_diff=0.0,
    )
    return trainer, module, engine


def train_one_step(policy: torch.nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            if p.requires_grad:  # LoRA: the adapters
                p.add_(0.05 * torch.randn_like(p))


@pytest.mark.parametrize("lag", [0, 1, 3])
def test_engine_serves_version_minus_lag_with_those_weights(setup, lag):
    trainer, module, engine = setup
    # exact with the same code on both sides; LoRA at lag 0 compares W x + s B A x with the
    # engine's merged (W + s B A) x: float32 rounding
    tolerance = 1e-3 if is_lora(module.policy) else 1e-5  # 1e-3: the shipped float32 default
    cb = WeightSync(verify=True, tolerance=tolerance, lag=lag)
    cb.last_probe = [5, 7, 9, 11, 13, 6, 8]
    snapshots = {0: {k: v.clone() for k, v in named_weights(module.policy).items()}}
    cb._sync(trainer, module, 0)
    for v in range(1, 7):
        train_one_step(module.policy, v)
        snapshots[v] = {k: t.clone() for k, t in named_weights(module.policy).items()}
        cb._sync(trainer, module, v)
        assert module.policy_version == v == engine.trainer_version  # the trainer's moves on
        served, weights = engine.received[-1]
        assert served == max(v - lag, 0)
        for k, t in weights.items():
            assert torch.equal(t, snapshots[served][k]), k
        assert module.last_weight_sync_diff <= tolerance  # verify ran against the delayed weights
    assert len(cb.delay_line) == (lag + 1 if lag else 0)
    # while the served version stands still (the first K syncs) nothing is re-sent
    assert [v for v, _ in engine.received] == sorted({max(v - lag, 0) for v in range(7)})


def test_verify_catches_an_engine_serving_the_wrong_version(setup):
    trainer, module, engine = setup
    cb = WeightSync(verify=True, tolerance=1e-5, lag=2)
    cb.last_probe = [5, 7, 9, 11, 13, 6, 8]
    cb._sync(trainer, module, 0)
    for v in (1, 2):
        train_one_step(module.policy, v)
        cb._sync(trainer, module, v)
    real_sync = engine.sync_weights
    train_one_step(module.policy, 3)
    current = named_weights(module.policy)
    # a broken sync that ships the current weights instead of the delayed ones (version 1)
    engine.sync_weights = lambda named, version: real_sync(current, version)
    with pytest.raises(WeightSyncError, match="after syncing version 1"):
        cb._sync(trainer, module, 3)


def test_delay_line_survives_a_checkpoint(setup, tmp_path):
    trainer, module, engine = setup
    cb = WeightSync(verify=False, lag=2)
    cb._sync(trainer, module, 0)
    snapshots = {}
    for v in range(1, 4):
        train_one_step(module.policy, v)
        cb._sync(trainer, module, v)
        snapshots[v] = {k: t.clone() for k, t in named_weights(module.policy).items()}
    torch.save(cb.state_dict(), tmp_path / "cb.pt")  # as a Lightning checkpoint holds it
    train_one_step(module.policy, 99)  # the checkpoint was taken mid rollout batch: weights moved on
    resumed = WeightSync(verify=False, lag=2)
    resumed.load_state_dict(torch.load(tmp_path / "cb.pt", weights_only=False))
    resumed._sync(trainer, module, 3)  # on_train_start after a resume: same version again
    assert engine.received[-1][0] == 1  # still 3 - 2, not the checkpoint's own weights
    train_one_step(module.policy, 4)
    resumed._sync(trainer, module, 4)
    train_one_step(module.policy, 5)
    resumed._sync(trainer, module, 5)
    served, weights = engine.received[-1]
    assert served == 3  # version 3 is the weights synced as 3, not the moved-on ones
    assert all(torch.equal(weights[k], snapshots[3][k]) for k in weights)


def test_train_end_flushes_the_current_weights(setup):
    trainer, module, engine = setup
    cb = WeightSync(verify=False, lag=2)
    cb.on_train_start(trainer, module)
    for v in range(1, 4):
        train_one_step(module.policy, v)
        cb._sync(trainer, module, v)
        trainer.global_step = v
        cb.synced_step = v
    cb.on_train_end(trainer, module)
    assert engine.received[-1][0] == 3 and module.policy_version == 3
    for k, t in named_weights(module.policy).items():
        assert torch.equal(engine.received[-1][1][k], t)


def test_lag_is_refused_outside_sync_rollout_and_when_negative():
    from modules.config.errors import ConfigError
    from modules.launch.validate import validate
    from tests.conftest import compose

    with pytest.raises(ConfigError, match="callbacks.weight_sync.lag"):
        validate(compose(["recipe=async_grpo", "callbacks.weight_sync.lag=2"]))
    with pytest.raises(ConfigError, match="callbacks.weight_sync.lag"):
        WeightSync(lag=-1)
    validate(compose(["callbacks.weight_sync.lag=2"]))  # sync rollout: allowed


def test_verify_tolerance_follows_the_engine_dtype():
    from modules.config.errors import ConfigError

    assert WeightSync(engine_dtype="float32").tolerance == 1e-3
    assert WeightSync(engine_dtype="bfloat16").tolerance > 0.1
    assert WeightSync(tolerance=0.3, engine_dtype="auto").tolerance == 0.3
    with pytest.raises(ConfigError, match="callbacks.weight_sync.tolerance"):
        WeightSync(engine_dtype="auto")  # what auto means depends on the checkpoint


@pytest.mark.parametrize("off", ["one", "all", "one_far", "one_nan"])
def test_verify_fails_only_when_most_probes_disagree(setup, off):
    """A float32 kernel outlier on one sequence (a few times the tolerance) does not stop the
    run: two more sequences are scored and two of three must fail. An engine off on every
    sequence, or one sequence off by 10x the tolerance or more, or NaN, fails the sync."""
    trainer, module, engine = setup
    cb = WeightSync(verify=True, tolerance=2e-4, lag=0)
    probes = [[5, 7, 9, 11, 13, 6, 8], [6, 8, 10, 12], [7, 9, 11, 13, 15]]
    cb.last_probe, cb.spare_probes = probes[0], probes[1:]
    score = engine.engine_logprobs
    skew = {"one": 1e-3, "all": 1e-3, "one_far": 5.0, "one_nan": float("nan")}[off]

    def skewed(seq):
        lp = score(seq)
        return [x + skew for x in lp] if off == "all" or seq == probes[0] else lp

    engine.engine_logprobs = skewed
    train_one_step(module.policy, 1)
    if off == "one":
        cb._sync(trainer, module, 1)
        assert module.last_weight_sync_diff == pytest.approx(1e-3, rel=0.2)  # the probe's, logged
    else:
        with pytest.raises(WeightSyncError, match="after syncing version 1"):
            cb._sync(trainer, module, 1)
