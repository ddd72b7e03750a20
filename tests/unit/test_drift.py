"""Drift detector and adaptive controller on synthetic metric streams (no engine, no model)."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch

from modules.algo.corrections import M2PO, MaskedIS, NoCorrection, TokenIS, TruncatedTokenIS, VTrace
from modules.algo.losses import PolicyLoss
from modules.callbacks.drift_controller import DriftCallback, scale_learning_rate
from modules.callbacks.drift_score import DriftDetector, Signal
from modules.callbacks.weight_sync import WeightSync
from modules.config.errors import ConfigError

# far over the default KL ceiling (2.0 nats/token): an alarm from the first step
FAR_KL = 20.0
# a relative behaviour KL with a ceiling (the default signal before issue 38), for the tests of
# the baseline's mechanics (skip, lag ramp) that the default's absolute-only KL does not exercise
RELATIVE_KL = Signal("train/kl_behavior", 1, log=True, min_scale=0.25, floor=1e-6, ceiling=0.2)


def healthy(step: int, rng: random.Random) -> dict[str, float]:
    """Stationary diagnostics with realistic noise: behaviour KL ~1e-3 (log-normal), a clip
    fraction around 5 %, a gradient norm around 0.5, an ESS fraction around 0.9, a policy
    entropy around 0.12 nats (log-normal)."""
    return {
        "train/kl_behavior": 1e-3 * math.exp(rng.gauss(0, 0.3)),
        "train/clip_frac": max(0.0, rng.gauss(0.05, 0.01)),
        "train/grad_norm": 0.5 * math.exp(rng.gauss(0, 0.2)),
        "is/ess_frac": min(1.0, rng.gauss(0.9, 0.01)),
        "train/entropy": 0.12 * math.exp(rng.gauss(0, 0.05)),
        "train/loss": rng.gauss(0, 1),  # not a signal: ignored
        "rollout/staleness_max": 4.0,  # what the trainer saw (the controller reads it)
    }


def drifting(step: int, rng: random.Random, start: int = 40, rate: float = 0.15) -> dict[str, float]:
    """Healthy until ``start``, then the behaviour KL and gradient norm grow geometrically, the
    ESS fraction falls and the entropy rises (what the stored collapses showed)."""
    m = healthy(step, rng)
    if step >= start:
        m["train/kl_behavior"] *= math.exp(rate * (step - start))
        m["train/grad_norm"] *= math.exp(0.5 * rate * (step - start))
        m["is/ess_frac"] *= math.exp(-0.5 * rate * (step - start))
        m["train/entropy"] *= math.exp(0.5 * rate * (step - start))
    return m


def first_alarm(stream, steps: int = 200) -> int | None:
    det = DriftDetector()
    rng = random.Random(0)
    for t in range(steps):
        if det.update(stream(t, rng)).alarm:
            return t
    return None


def test_quiet_on_healthy_streams():
    # 30 seeds x 300 steps of stationary noise: no alarm at the default settings
    for seed in range(30):
        det = DriftDetector()
        rng = random.Random(seed)
        alarms = sum(det.update(healthy(t, rng)).alarm for t in range(300))
        assert alarms == 0, seed


def test_alarms_soon_after_drift_starts_and_names_the_driver():
    for seed in range(10):
        det = DriftDetector()
        rng = random.Random(seed)
        readings = [det.update(drifting(t, rng)) for t in range(120)]
        first = next(r for r in readings if r.alarm)
        # the ESS fraction falls 7 % a step against a spread floor of 0.02: z 2.5 within a few steps
        assert 40 < first.step <= 40 + 20, (seed, first.step)
        assert first.driver in ("is/ess_frac", "train/entropy")
        assert all(not r.alarm for r in readings[:40])


def test_falling_ess_is_drift_and_rising_ess_is_not():
    def ess(direction: int):
        def stream(t, rng):
            x = 0.9 + rng.gauss(0, 0.01)
            if t >= 30:
                x += direction * 0.02 * (t - 30)
            return {"is/ess_frac": min(max(x, 0.0), 1.0)}

        return stream

    assert first_alarm(ess(-1)) is not None
    assert first_alarm(ess(+1)) is None


def test_non_finite_diagnostic_alarms():
    det = DriftDetector(patience=2)
    rng = random.Random(0)
    for t in range(20):
        assert not det.update(healthy(t, rng)).alarm
    m = healthy(20, rng)
    m["train/grad_norm"] = float("nan")
    readings = [det.update(m) for _ in range(6)]
    assert any(r.alarm for r in readings)


def test_missing_signals_are_skipped_and_warmup_scores_zero():
    det = DriftDetector(warmup=5)
    for _ in range(5):
        r = det.update({"train/loss": 1.0})
        assert r.score == 0.0 and not r.alarm and r.z == {}


def test_detector_state_roundtrip():
    rng = random.Random(3)
    a = DriftDetector()
    for t in range(30):
        a.update(drifting(t, rng, start=20))
    b = DriftDetector()
    b.load_state_dict(a.state_dict())
    m = drifting(30, rng, start=20)
    assert a.update(m) == b.update(m)


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"warmup": 2}, "callbacks.drift.detector.warmup"),
        ({"threshold": 0}, "callbacks.drift.detector.threshold"),
        ({"patience": 0}, "callbacks.drift.detector.patience"),
        ({"alpha": 1.5}, "callbacks.drift.detector.alpha"),
        ({"signals": []}, "callbacks.drift.detector.signals"),
    ],
)
def test_detector_bad_config(kw, field):
    with pytest.raises(ConfigError, match=field):
        DriftDetector(**kw)


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"actions": ["staleness", "pray"]}, "callbacks.drift.actions"),
        ({"lr_factor": 1.0}, "callbacks.drift.lr_factor"),
        ({"cooldown": 0}, "callbacks.drift.cooldown"),
        ({"relax_after": 0}, "callbacks.drift.relax_after"),
        ({"truncate_to": 0.5}, "callbacks.drift.truncate_to"),
        ({"truncate_to": math.inf}, "callbacks.drift.truncate_to"),
        ({"truncate_to": True}, "callbacks.drift.truncate_to"),
    ],
)
def test_controller_bad_config(kw, field):
    with pytest.raises(ConfigError, match=field):
        DriftCallback(DriftDetector(), **kw)


class FakeDataModule:
    def __init__(self, bound: int | None) -> None:
        self.bound = bound

    def staleness_bound(self) -> int | None:
        return self.bound

    def set_staleness_bound(self, value: int) -> None:
        self.bound = value


def make_run(
    lag: int = 0,
    bound: int | None = None,
    lr: float = 1e-3,
    loss: PolicyLoss | None = None,
    detector: DriftDetector | None = None,
    **kw,
):
    param = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.AdamW([param], lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    ws = WeightSync(verify=False, lag=lag)
    cb = DriftCallback(detector or DriftDetector(), actions=kw.pop("actions", ["staleness", "lr"]), **kw)
    trainer = SimpleNamespace(
        world_size=1,
        callbacks=[cb, ws],
        optimizers=[opt],
        lr_scheduler_configs=[SimpleNamespace(scheduler=sched)],
        datamodule=FakeDataModule(bound),
        callback_metrics={},
        global_step=0,
    )
    logged: list[dict[str, float]] = []
    module = SimpleNamespace(
        parameters=lambda: [param],
        log=lambda k, v, **_: logged[-1].__setitem__(k, float(v)),
        loss_fn=loss or PolicyLoss(correction=TokenIS(), anchor="decoupled"),
    )
    cb.on_fit_start(trainer, module)
    return cb, trainer, module, ws, opt, sched, logged


def feed(cb, trainer, module, logged, metrics: dict[str, float], skipped: bool = False) -> dict[str, float]:
    """One optimizer step: the gradient (norm = the stream's grad norm), then the step's metrics."""
    metrics = dict(metrics)
    param = module.parameters()[0]
    param.grad = None if skipped else torch.tensor([metrics.pop("train/grad_norm", 1.0), 0.0, 0.0])
    cb.on_before_optimizer_step(trainer, module, trainer.optimizers[0])
    trainer.callback_metrics = {k: torch.tensor(v) for k, v in metrics.items()}
    logged.append({})
    cb.on_train_batch_end(trainer, module, None if skipped else {"loss": torch.tensor(0.0)})
    trainer.global_step += 1
    return logged[-1]


def test_controller_lowers_lag_and_lr_on_drift_then_relaxes_when_quiet():
    cb, trainer, module, ws, opt, sched, logged = make_run(lag=4, cooldown=5, relax_after=15)
    rng = random.Random(0)
    for t in range(40):
        out = feed(cb, trainer, module, logged, healthy(t, rng))
        assert out["controller/notches"] == 0 and out["controller/staleness_bound"] == 4
    actions_at = []
    for t in range(40, 75):  # drift: one action per cooldown while the alarm lasts
        out = feed(cb, trainer, module, logged, drifting(t, rng))
        if cb.since_action == 0:
            actions_at.append(t)
    assert actions_at and all(b - a >= 5 for a, b in zip(actions_at, actions_at[1:]))
    assert ws.lag == 4 >> len(actions_at)  # halved per action: 4 -> 2 -> 1 -> 0
    assert cb.lr_scale < 1 and opt.param_groups[0]["lr"] == pytest.approx(1e-3 * cb.lr_scale)
    assert sched.base_lrs[0] == pytest.approx(1e-3 * cb.lr_scale)
    assert out["controller/lr_scale"] == cb.lr_scale and out["drift/alarm"] == 1.0
    opt.step()
    sched.step()  # a per-step schedule keeps the controller's scale
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * cb.lr_scale)
    # the cause goes away: everything is undone, one notch per relax_after quiet steps
    taken = len(cb.notches)
    quiet_steps = 0
    while cb.notches and quiet_steps < 2000:
        feed(cb, trainer, module, logged, healthy(0, rng))
        quiet_steps += 1
    assert not cb.notches and ws.lag == 4 and cb.lr_scale == pytest.approx(1.0)
    assert quiet_steps >= taken * 15


def test_streaming_bound_comes_down_from_what_the_run_sees():
    cb, trainer, module, ws, opt, sched, logged = make_run(bound=1_000_000, actions=["staleness"])
    rng = random.Random(1)
    for t in range(60):
        m = drifting(t, rng, start=30)
        m["rollout/staleness_max"] = 3.0
        feed(cb, trainer, module, logged, m)
    assert trainer.datamodule.bound < 3  # not 999_999
    assert cb.lr_scale == 1.0 and opt.param_groups[0]["lr"] == pytest.approx(1e-3)  # lr not an action here
    for _ in range(2000):  # quiet again: each notch restores the bound it replaced
        if not cb.notches:
            break
        feed(cb, trainer, module, logged, healthy(0, rng))
    assert trainer.datamodule.bound == 1_000_000


def test_an_unbounded_partial_rollout_is_cut_from_what_it_sees_and_relaxed_back_to_unbounded():
    """Partial rollout's bound is null (unbounded): the datamodule reports inf, the first cut
    starts from the observed staleness, and relaxing the last notch makes it unbounded again."""
    from types import SimpleNamespace

    from data.rollout.datamodule import RolloutDataModule
    from data.rollout.partial import PartialRollout
    from tests.unit.test_rollout_modes import SAMPLING

    partial = PartialRollout(4, 2, SAMPLING)
    dm = SimpleNamespace(rollout=partial)
    assert RolloutDataModule.staleness_bound(dm) == math.inf
    cb, trainer, module, ws, opt, sched, logged = make_run(actions=["staleness"])

    def set_bound(value):
        partial.bound.set_max_staleness(value)

    trainer.datamodule.staleness_bound = lambda: RolloutDataModule.staleness_bound(dm)
    trainer.datamodule.set_staleness_bound = set_bound
    cb.on_fit_start(trainer, module)
    rng = random.Random(1)
    for t in range(60):
        m = drifting(t, rng, start=30)
        m["rollout/staleness_max"] = 3.0
        feed(cb, trainer, module, logged, m)
    assert partial.max_staleness is not None and partial.max_staleness < 3
    for _ in range(2000):
        if not cb.notches:
            break
        feed(cb, trainer, module, logged, healthy(0, rng))
    assert partial.max_staleness is None and not cb.notches


def test_sync_rollout_has_no_bound_to_lower_but_lr_still_acts():
    cb, trainer, module, ws, opt, sched, logged = make_run(bound=None)
    rng = random.Random(2)
    for t in range(60):
        out = feed(cb, trainer, module, logged, drifting(t, rng, start=30))
    assert "controller/staleness_bound" not in out
    assert cb.notches and {n[0] for n in cb.notches} == {"lr"}


def test_lr_never_below_its_floor():
    cb, trainer, module, ws, opt, sched, logged = make_run(actions=["lr"], cooldown=1, min_lr_scale=0.25)
    rng = random.Random(4)
    for t in range(100):
        feed(cb, trainer, module, logged, drifting(t, rng, start=20))
    assert cb.lr_scale == pytest.approx(0.25)


def test_monitor_only_acts_on_nothing():
    cb, trainer, module, ws, opt, sched, logged = make_run(lag=2, actions=[])
    rng = random.Random(5)
    for t in range(80):
        out = feed(cb, trainer, module, logged, drifting(t, rng, start=30))
    assert out["drift/alarm"] == 1.0 and ws.lag == 2 and opt.param_groups[0]["lr"] == 1e-3
    assert not any(k.startswith("controller/") for k in out)
    assert 0 < out["perf/drift_callback_ms"] < 1e3  # its own cost is logged every step


def test_the_callback_times_its_grad_norm_and_its_step_end_once_each(monkeypatch):
    import modules.callbacks.drift_controller as controller

    cb, trainer, module, ws, opt, sched, logged = make_run(lag=2)
    clock = iter([10.0, 10.25, 20.0, 20.5])  # grad norm 0.25 s, step end 0.5 s
    monkeypatch.setattr(controller.time, "perf_counter", lambda: next(clock))
    out = feed(cb, trainer, module, logged, healthy(0, random.Random(0)))
    assert out["perf/drift_callback_ms"] == 750.0


def test_resume_reapplies_the_cut():
    cb, trainer, module, ws, opt, sched, logged = make_run(lag=4, cooldown=1, actions=["staleness"])
    rng = random.Random(6)
    for t in range(70):
        feed(cb, trainer, module, logged, drifting(t, rng, start=30))
    assert ws.lag < 4
    state = cb.state_dict()
    cb2, trainer2, module2, ws2, *_ = make_run(lag=4, cooldown=1, actions=["staleness"])
    cb2.load_state_dict(state)
    cb2.on_fit_start(trainer2, module2)
    assert ws2.lag == ws.lag


def test_grad_norm_is_measured_before_the_step_and_skipped_steps_are_not_fed():
    cb, trainer, module, ws, opt, sched, logged = make_run()
    out = feed(cb, trainer, module, logged, {"train/grad_norm": 5.0})
    assert out["train/grad_norm"] == pytest.approx(5.0) and cb.detector.steps == 1
    out = feed(cb, trainer, module, logged, {"train/grad_norm": 5.0}, skipped=True)
    assert out == {} and cb.detector.steps == 1


def test_detector_waits_for_the_lag_ramp():
    cb, trainer, module, ws, opt, sched, logged = make_run(lag=4, actions=["staleness"])
    rng = random.Random(9)
    for t in range(4):  # staleness 0, 1, 2, 3: the delayed sync is still ramping up
        m = healthy(t, rng)
        m["rollout/staleness_max"] = float(t)
        out = feed(cb, trainer, module, logged, m)
        # no baseline from the ramp; only the absolute ceilings score (far below them here)
        assert not cb.detector.history["is/ess_frac"] and out["drift/score"] < 2.0
    feed(cb, trainer, module, logged, healthy(4, rng))  # staleness 4 = K
    assert len(cb.detector.history["is/ess_frac"]) == 1


def test_a_first_step_baseline_learns_during_the_lag_ramp():
    cb, trainer, module, ws, opt, sched, logged = make_run(lag=4, actions=[], baseline="first")
    rng = random.Random(9)
    for t in range(4):  # the ramp: learned from, unlike the default ``ramp`` baseline
        m = healthy(t, rng)
        m["rollout/staleness_max"] = float(t)
        feed(cb, trainer, module, logged, m)
        assert len(cb.detector.history["is/ess_frac"]) == t + 1
    with pytest.raises(ValueError, match=r"callbacks\.drift\.baseline.*\['ramp', 'first'\]"):
        DriftCallback(DriftDetector(), baseline="start")


def test_scale_learning_rate_without_scheduler():
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=0.1)
    trainer = SimpleNamespace(optimizers=[opt], lr_scheduler_configs=[])
    scale_learning_rate(trainer, 0.5)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)


def test_config_group_composes(tmp_path):
    from modules.launch.compose import build
    from tests.conftest import compose

    cfg = compose(["callbacks/drift=controller", "recipe=async_grpo"])
    cb = build(cfg.callbacks.drift)
    assert isinstance(cb, DriftCallback) and cb.actions == ["staleness", "lr"]
    assert "drift" not in compose([]).callbacks  # opt-in


# the detector shipped before issue 38, for the comparisons below
SHIPPED = [
    RELATIVE_KL,
    Signal("train/clip_frac", 1, min_scale=0.02, ceiling=0.2),
    Signal("train/grad_norm", 1, log=True, min_scale=0.25),
    Signal("is/ess_frac", -1, min_scale=0.02, ceiling=0.1),
]


def slow_healthy(t: int, rng: random.Random) -> dict[str, float]:
    """A healthy lagged run as the stored K = 8 runs that never collapsed: the behaviour KL grows
    6x over 60 steps past its 0.2 ceiling of old, the gradient norm spikes 10x now and then, the
    ESS fraction holds, the entropy falls slowly (the policy sharpens)."""
    return {
        "train/kl_behavior": 0.05 * math.exp(0.03 * t + rng.gauss(0, 0.3)),
        "train/grad_norm": 0.4 * math.exp(rng.gauss(0, 0.3)) * (10.0 if t % 20 == 15 else 1.0),
        "train/clip_frac": 0.0,
        "is/ess_frac": min(1.0, rng.gauss(0.9, 0.01)),
        "train/entropy": 0.12 * math.exp(-0.005 * t + rng.gauss(0, 0.05)),
    }


def precursor(t: int, rng: random.Random, start: int = 20) -> dict[str, float]:
    """The same run drifting into a collapse 20 steps after ``start``: from ``start`` on the ESS
    fraction falls 0.015 a step and the entropy rises 2 % a step."""
    m = slow_healthy(t, rng)
    if t >= start:
        m["is/ess_frac"] -= 0.015 * (t - start)
        m["train/entropy"] *= math.exp(0.02 * (t - start))
    return m


def test_a_slow_healthy_drift_is_quiet_where_the_old_default_alarmed():
    old = 0
    for seed in range(20):
        rng = random.Random(seed)
        stream = [slow_healthy(t, rng) for t in range(60)]
        det, before = DriftDetector(), DriftDetector(signals=SHIPPED, threshold=4.0, patience=2)
        assert not any(det.update(m, learn=t >= 8).alarm for t, m in enumerate(stream)), seed
        old += any(before.update(m, learn=t >= 8).alarm for t, m in enumerate(stream))
    assert old >= 15  # the KL past 0.2 (and the spikes): the old default called these drift


def test_a_collapse_precursor_alarms_at_least_10_steps_ahead():
    for seed in range(20):
        rng = random.Random(seed)
        det = DriftDetector()
        readings = [det.update(precursor(t, rng), learn=t >= 8) for t in range(60)]
        first = next(r for r in readings if r.alarm)
        assert 20 < first.step <= 40 - 10, (seed, first.step)  # collapse at 40: >= 10 steps ahead
        assert first.driver in ("is/ess_frac", "train/entropy")


def test_an_absolute_only_signal_has_no_baseline_and_non_finite_values_count_from_the_first_step():
    det = DriftDetector(
        signals=[Signal("x", 1, ceiling=1.0, relative=False), Signal("y", relative=False)], warmup=3
    )
    for _ in range(10):
        r = det.update({"x": 0.5, "y": 3.0})
        assert not r.alarm and r.relative == 0.0 and r.ceiling == pytest.approx(0.5 * det.threshold)
    assert not det.history["x"] and not det.baseline
    assert DriftDetector(signals=[Signal("y", relative=False)]).update({"y": math.nan}).alarm
    assert DriftDetector(warmup=3).update({"train/entropy": math.inf}).alarm  # a relative one too


def test_on_policy_float_noise_in_the_kl_is_quiet():
    # lag 0, one minibatch: KL(mu || pi) is float noise of either sign around 0
    det = DriftDetector()
    rng = random.Random(7)
    for t in range(300):
        r = det.update({"train/kl_behavior": rng.uniform(-3e-8, 1e-7), "train/clip_frac": 0.0})
        assert not r.alarm, t


def test_skip_keeps_a_lag_ramp_out_of_the_baseline():
    # a delayed sync of K = 4: the KL grows over the first 4 steps, then holds at its level
    def ramp(t, rng):
        return {"train/kl_behavior": 1e-3 * min(t + 1, 5) * math.exp(rng.gauss(0, 0.3))}

    det = DriftDetector(signals=[RELATIVE_KL], skip=4)
    rng = random.Random(8)
    readings = [det.update(ramp(t, rng)) for t in range(200)]
    assert all(r.score < 0.5 for r in readings[:14])  # 4 skipped + 10 of warm-up: ceilings only
    assert len(det.history["train/kl_behavior"]) == 10 and det.baseline
    assert not any(r.alarm for r in readings)
    with pytest.raises(ConfigError, match="callbacks.drift.detector.skip"):
        DriftDetector(skip=-1)


def test_ceiling_alarms_on_a_run_off_policy_from_its_first_step():
    # The lr 1e-2, K = 8 testbed run (docs/estimators.md): the behaviour KL and clip fraction
    # are far outside any trust region from step 1, so a baseline fitted on the first steps
    # calls them normal. The ceilings alarm within the first steps, warm-up included.
    kl = [0.58, 0.41, 9.35, 0.24, 0.19, 0.52, 0.45, 0.45, 0.76, 0.98, 2.84, 1.11, 0.61, 0.82, 0.94]
    clip = [0.13, 0.12, 0.12, 0.10, 0.11, 0.13, 0.14, 0.14, 0.02, 0.22, 0.25, 0.21, 0.16, 0.04, 0.13]
    det = DriftDetector()
    readings = [det.update({"train/kl_behavior": k, "train/clip_frac": c}) for k, c in zip(kl, clip)]
    first = next(r.step for r in readings if r.alarm)
    assert first <= 2 and readings[first].driver == "train/kl_behavior"
    # the relative score alone (no ceilings) stays quiet on the same stream
    from modules.callbacks.drift_score import Signal

    plain = DriftDetector(signals=[Signal("train/kl_behavior", 1, log=True, min_scale=0.25, floor=1e-6)])
    assert not any(plain.update({"train/kl_behavior": k}).alarm for k in kl)


def test_ceiling_scores_threshold_at_the_ceiling_and_a_floor_for_falling_signals():
    from modules.callbacks.drift_score import Signal

    up = Signal("x", 1, ceiling=0.2)
    down = Signal("y", -1, ceiling=0.1)
    assert up.over_ceiling(0.2, 4.0) == pytest.approx(4.0) and up.over_ceiling(0.1, 4.0) == pytest.approx(2.0)
    assert down.over_ceiling(0.1, 4.0) == pytest.approx(4.0) and down.over_ceiling(
        0.05, 4.0
    ) == pytest.approx(8.0)
    assert Signal("z").over_ceiling(1e9, 4.0) == 0.0
    # an ESS fraction that collapses to 5 % alarms during warm-up
    det = DriftDetector()
    assert any(det.update({"is/ess_frac": 0.05}).alarm for _ in range(3))


def test_staleness_halves_on_alarm_and_relaxes_one_version_at_a_time():
    cb, trainer, module, ws, opt, sched, logged = make_run(
        lag=8, cooldown=3, relax_after=4, actions=["staleness"]
    )
    bounds = []
    for t in range(8):  # far over the KL ceiling from the first step (ramp included)
        feed(
            cb,
            trainer,
            module,
            logged,
            {"train/kl_behavior": FAR_KL, "rollout/staleness_max": float(min(t, 8))},
        )
        bounds.append(ws.lag)
    assert bounds[0] == 4 and 2 in bounds and min(bounds) >= 1  # patience 1: step 0 already cuts 8 -> 4
    cut = ws.lag
    seen = [cut]
    for _ in range(200):
        if not cb.notches:
            break
        feed(cb, trainer, module, logged, {"train/kl_behavior": 1e-3, "rollout/staleness_max": float(ws.lag)})
        if ws.lag != seen[-1]:
            seen.append(ws.lag)
    low = seen.index(min(seen))  # (the smoothed KL takes a few steps to fall: one more cut)
    assert seen[low:] == list(range(min(seen), 9))  # +1 per relax_after quiet steps, back to 8
    assert not cb.notches


def test_a_cut_during_the_lag_ramp_relaxes_back_to_k_and_the_baseline_is_fitted_there():
    # K = 8; a KL spike in the first steps cuts the lag during the ramp; afterwards the KL is
    # healthy but grows with the lag (0.002 s^2: below its ceiling 0.2 at K). The baseline must
    # wait for the configured K, so relaxing back towards K does not read as drift.
    cb, trainer, module, ws, opt, sched, logged = make_run(
        lag=8,
        relax_after=10,
        cooldown=5,
        actions=["staleness"],
        detector=DriftDetector(signals=[RELATIVE_KL]),
    )
    rng = random.Random(0)
    s = 0
    for t in range(400):
        s = min(s + 1, ws.lag)  # the staleness the run sees ramps one version per step, up to the lag
        kl = (2.0 if t < 3 else 0.002 * s * s) * rng.uniform(0.9, 1.1)
        feed(cb, trainer, module, logged, {"train/kl_behavior": kl, "rollout/staleness_max": float(s)})
    assert cb.alarms > 0 and ws.lag == 8 and not cb.notches
    assert cb.detector.baseline  # fitted, and at K: the KL there is 0.002 * 64
    assert math.exp(cb.detector.baseline["train/kl_behavior"][0]) == pytest.approx(0.128, rel=0.15)


def test_a_signal_below_its_ceiling_does_not_block_relaxation():
    cb, trainer, module, ws, opt, sched, logged = make_run(lag=4, relax_after=5, actions=["lr"])
    for _ in range(20):
        feed(cb, trainer, module, logged, {"train/kl_behavior": FAR_KL, "rollout/staleness_max": 4.0})
    assert cb.lr_scale < 1
    for _ in range(300):  # healthy, with a steady clip fraction at 0.6 of its ceiling
        out = feed(
            cb,
            trainer,
            module,
            logged,
            {"train/kl_behavior": 1e-3, "train/clip_frac": 0.12, "rollout/staleness_max": 4.0},
        )
    assert out["drift/alarm"] == 0.0 and cb.lr_scale == pytest.approx(1.0) and not cb.notches


def test_notches_of_an_older_checkpoint_relax_in_one_step_as_they_did():
    cb, trainer, module, ws, opt, sched, logged = make_run(
        bound=1_000_000, relax_after=2, actions=["staleness", "lr"]
    )
    state = cb.state_dict()
    state.update(bound=2, notches=[["lr", 0.5], ["staleness", 1_000_000.0]], lr_scale=0.5)
    state.pop("ramp_done")
    cb2, trainer2, module2, ws2, opt2, sched2, logged2 = make_run(
        bound=1_000_000, relax_after=2, actions=["staleness", "lr"]
    )
    cb2.load_state_dict(state)
    cb2.on_fit_start(trainer2, module2)
    assert trainer2.datamodule.bound == 2
    for _ in range(40):
        feed(cb2, trainer2, module2, logged2, {"train/kl_behavior": 1e-4, "rollout/staleness_max": 1.0})
    assert trainer2.datamodule.bound == 1_000_000 and not cb2.notches
    assert cb2.lr_scale == pytest.approx(1.0)  # (the optimizer itself resumes at its saved lr)


def test_lr_floor_is_reached_from_a_partly_relaxed_scale():
    cb, trainer, module, ws, opt, sched, logged = make_run(actions=["lr"], min_lr_scale=0.125, relax_after=2)
    cb.lr_scale = 0.125 * 2**0.75  # left there by a partial relaxation
    cb.notches = [("lr", 0.125 * 2**0.75, 2**0.25)]
    for _ in range(12):
        feed(cb, trainer, module, logged, {"train/kl_behavior": FAR_KL, "rollout/staleness_max": 1.0})
    assert cb.lr_scale == pytest.approx(0.125)  # cut to the floor, not stuck above it


@pytest.mark.parametrize("ceiling", [0.0, -1.0])
def test_bad_ceiling_names_the_signal(ceiling):
    from modules.callbacks.drift_score import Signal

    with pytest.raises(ConfigError, match=r"signals\[x\]\.ceiling"):
        DriftDetector(signals=[Signal("x", ceiling=ceiling)])


def test_skip_counts_learning_steps_only():
    det = DriftDetector(signals=[Signal("train/clip_frac", 1, min_scale=0.02)], skip=3, warmup=3)
    for _ in range(5):
        det.update({"train/clip_frac": 0.01}, learn=False)  # a ramp: not counted
    assert det.learned == 0 and not det.history["train/clip_frac"]
    for _ in range(3):
        det.update({"train/clip_frac": 0.01})  # the skipped learning steps
    assert not det.history["train/clip_frac"]
    det.update({"train/clip_frac": 0.01})
    assert len(det.history["train/clip_frac"]) == 1


def test_an_lr_cut_is_undone_in_lr_relax_steps_geometric_steps():
    cb, trainer, module, ws, opt, sched, logged = make_run(
        lag=4, relax_after=3, actions=["lr"], lr_relax_steps=4
    )
    for _ in range(4):  # one alarm, one cut (cooldown 5)
        feed(cb, trainer, module, logged, {"train/kl_behavior": FAR_KL, "rollout/staleness_max": 4.0})
    assert cb.lr_scale == pytest.approx(0.5) and len(cb.notches) == 1
    scales = []  # (the smoothed KL takes a few steps to fall: it may cut once more first)
    for _ in range(100):
        feed(cb, trainer, module, logged, {"train/kl_behavior": 1e-3, "rollout/staleness_max": 4.0})
        if not scales or cb.lr_scale != scales[-1]:
            scales.append(cb.lr_scale)
        if not cb.notches:
            break
    low = scales.index(min(scales))
    ups = [b / a for a, b in zip(scales[low:], scales[low + 1 :])]
    cuts = round(math.log2(1 / min(scales)))
    assert ups == pytest.approx([2**0.25] * 4 * cuts) and cb.lr_scale == pytest.approx(1.0)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3)
    with pytest.raises(ConfigError, match="callbacks.drift.lr_relax_steps"):
        make_run(lr_relax_steps=0)


def alarm_then_quiet(cb, trainer, module, logged, alarm_steps: int, quiet_steps: int) -> list[float | None]:
    """Far over the KL ceiling for ``alarm_steps``, then healthy; the correction's limit per step."""
    limits = []
    for t in range(alarm_steps + quiet_steps):
        kl = FAR_KL if t < alarm_steps else 1e-3
        feed(cb, trainer, module, logged, {"train/kl_behavior": kl, "rollout/staleness_max": 4.0})
        limits.append(module.loss_fn.correction.limit)
    return limits


def test_truncate_caps_an_uncapped_correction_halves_to_one_and_relaxes_last():
    cb, trainer, module, ws, opt, sched, logged = make_run(
        lag=4, cooldown=2, relax_after=3, lr_relax_steps=1, actions=["staleness", "lr", "truncate"]
    )
    corr = module.loss_fn.correction
    limits = alarm_then_quiet(cb, trainer, module, logged, alarm_steps=12, quiet_steps=0)
    assert 2.0 in limits and limits[-1] == 1.0  # token IS: capped at 2, then halved, floor 1
    kinds = [n[0] for n in cb.notches]
    assert kinds[:2] == ["truncate", "truncate"] and "truncate" not in kinds[2:]  # relaxed last
    assert logged[-1]["controller/weight_limit"] == 1.0
    # the capped weights are what the loss now uses
    log_w = torch.tensor([[math.log(5.0), 0.0, math.log(0.5)]])
    w, _ = corr(log_w, torch.ones_like(log_w))
    assert w.tolist() == [[1.0, 1.0, 0.5]]
    order = []
    while cb.notches and len(order) < 100:
        kind = cb.notches[-1][0]
        before = len(cb.notches)
        alarm_then_quiet(cb, trainer, module, logged, alarm_steps=0, quiet_steps=1)
        if len(cb.notches) < before:
            order.append(kind)
    assert order[-2:] == ["truncate", "truncate"] and set(order[:-2]) == {"staleness", "lr"}
    assert corr.limit is None and ws.lag == 4 and cb.lr_scale == pytest.approx(1.0)
    assert logged[-1]["controller/weight_limit"] == math.inf


def test_truncate_halves_an_existing_cap_and_leaves_bypass_alone():
    tis = PolicyLoss(correction=TruncatedTokenIS(cap=2.0), anchor="decoupled")
    cb, trainer, module, *_, logged = make_run(loss=tis, cooldown=1, actions=["truncate"])
    assert alarm_then_quiet(cb, trainer, module, logged, alarm_steps=6, quiet_steps=0)[-1] == 1.0
    assert len(cb.notches) == 1  # 2 -> 1, then nothing below the floor
    for loss in (PolicyLoss(correction=NoCorrection(), anchor="decoupled"), PolicyLoss()):
        cb, trainer, module, *_, logged = make_run(loss=loss, cooldown=1, actions=["truncate"])
        alarm_then_quiet(cb, trainer, module, logged, alarm_steps=6, quiet_steps=0)
        assert not cb.notches and module.loss_fn.correction.limit is None


def test_resume_reapplies_the_weight_cap():
    cb, trainer, module, *_, logged = make_run(cooldown=1, actions=["truncate"])
    alarm_then_quiet(cb, trainer, module, logged, alarm_steps=4, quiet_steps=0)
    state = cb.state_dict()
    cb2, trainer2, module2, *_ = make_run(cooldown=1, actions=["truncate"])
    cb2.load_state_dict(state)
    cb2.on_fit_start(trainer2, module2)
    assert module2.loss_fn.correction.limit == module.loss_fn.correction.limit == 1.0


@pytest.mark.parametrize(
    "correction, first_cap",
    [(VTrace(), None), (M2PO(), None), (MaskedIS(upper=2.0), 1.0), (VTrace(rho_bar=1.0, c_bar=2.0), 2.0)],
)
def test_truncate_starts_from_the_bound_the_correction_already_has(correction, first_cap):
    loss = PolicyLoss(correction=correction, anchor="decoupled")
    cb, trainer, module, *_, logged = make_run(loss=loss, cooldown=1, actions=["truncate"])
    limits = alarm_then_quiet(cb, trainer, module, logged, alarm_steps=3, quiet_steps=0)
    first = next((x for x in limits if x is not None), None)
    assert first == first_cap  # weights already <= 1 (vtrace 1/1, m2po): no action, no notch
    assert (first_cap is None) == (not cb.notches) == ("controller/weight_limit" not in logged[-1])


def test_a_resume_without_truncate_or_without_a_correction_drops_the_cap():
    cb, trainer, module, *_, logged = make_run(cooldown=1, actions=["truncate", "lr"])
    alarm_then_quiet(cb, trainer, module, logged, alarm_steps=4, quiet_steps=0)
    state = cb.state_dict()
    assert any(n[0] == "truncate" for n in state["notches"])
    for actions, loss in ((["lr"], None), (["truncate", "lr"], PolicyLoss())):
        cb2, trainer2, module2, *_, logged2 = make_run(loss=loss, cooldown=1, actions=actions, relax_after=1)
        cb2.load_state_dict(state)
        cb2.on_fit_start(trainer2, module2)
        assert cb2.limit is None and not any(n[0] == "truncate" for n in cb2.notches)
        alarm_then_quiet(cb2, trainer2, module2, logged2, alarm_steps=0, quiet_steps=40)  # relaxes
        assert module2.loss_fn.correction.limit is None and not cb2.notches
