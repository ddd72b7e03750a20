"""The generation half of ``tools.bound``: the recipe's engine alone generating its prompts at the
recipe's concurrency ((a): samples/s, the weight-sync time and the experiences), and the same
generation in a background thread while training runs ((c), ``--shared``).

Imported by ``tools.bound`` (run that: ``python -m tools.bound [overrides]``) and
``tools.bound_training``; what is measured is in ``tools.bound``'s docstring.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from typing import Any

from omegaconf import DictConfig


def concurrency_groups(rollout: Any, engine_concurrency: int | None = None) -> int | str:
    """Groups the recipe keeps generating at once: sync ``prompts_per_step``; partial
    ceil(alpha x P) (``auto``: P + the engine's concurrency in groups, capped, see
    ``PartialRollout.groups_per_iteration``); streaming ``max_inflight`` (``auto``: min(the
    engine's concurrency in groups, P s (K + 1))). The string "auto" where no engine is known."""
    from data.rollout.partial import PartialRollout
    from data.rollout.sizing import Sizing
    from data.rollout.streaming import StreamingRollout

    if not isinstance(rollout, StreamingRollout):
        return rollout.prompts_per_step
    if isinstance(rollout, PartialRollout):
        if rollout.over_provision == "auto" and engine_concurrency is None:
            return "auto"
        return rollout.groups_per_iteration(engine_concurrency)
    if rollout.max_inflight == "auto" and engine_concurrency is None:
        return "auto"
    return Sizing.of(rollout, engine_concurrency).inflight


def _rollout_parts(cfg: DictConfig) -> tuple[Any, Any, Any, Any, Any]:
    """The recipe's task, rollout controller (its request / reward / advantage helpers only),
    engine (not started), tokenizer and prompt stream, as training builds them."""
    from hydra.utils import instantiate
    from transformers import AutoTokenizer

    from data.rollout.prompts import PromptStream

    task = instantiate(cfg.task)
    controller = instantiate(cfg.rollout)
    controller.configure_rewards(cfg.data.reward_errors, cfg.data.reward_timeout_s)  # as training
    engine = instantiate(cfg.engine)
    tokenizer = AutoTokenizer.from_pretrained(engine.model_path)
    prompts = PromptStream(list(task.build("train", cfg.data.train_size)), seed=cfg.seed)
    return task, controller, engine, tokenizer, prompts


def rollout_context(cfg: DictConfig, engine: Any, task: Any, tokenizer: Any, prompts: Any) -> Any:
    """The controller's context as training binds it: the recipe's advantage and prompt format
    (the chat template for a chat model), the run's seed."""
    from hydra.utils import instantiate

    from data.rollout.controller import RolloutContext

    return RolloutContext(
        engine,
        task,
        tokenizer,
        prompts,
        instantiate(cfg.algo.advantage),
        seed=cfg.seed,
        prompt_format=instantiate(cfg.data.prompt_format),
    )


class BackgroundGeneration:
    """(c): the engine generating the recipe's prompts at the recipe's concurrency, topped up as
    each group completes, in a thread of this process, until the context exits."""

    def __init__(self, cfg: DictConfig) -> None:
        self.cfg = cfg
        self.done_times: list[float] = []
        self._stop = threading.Event()
        self._error: BaseException | None = None

    def __enter__(self) -> BackgroundGeneration:
        task, self.controller, self.engine, tokenizer, self.prompts = _rollout_parts(self.cfg)
        self.engine.start()
        try:
            self.controller.bind(rollout_context(self.cfg, self.engine, task, tokenizer, self.prompts))
            self.max_groups = concurrency_groups(self.controller, self.engine.concurrency)
            self._thread = threading.Thread(target=self._run, name="bound-generation", daemon=True)
            self._thread.start()
        except BaseException:
            self.controller.close()
            self.engine.shutdown()
            raise
        return self

    def _run(self) -> None:
        inflight: dict[Any, Any] = {}
        open_groups: dict[int, int] = {}
        try:
            while not self._stop.is_set():
                while len(open_groups) < self.max_groups:
                    started = self.controller.submit_group(self.prompts.next())
                    open_groups[next(iter(started.values())).group_id] = 0
                    inflight.update(started)
                for fut in self.engine.wait_any(set(inflight)):
                    p = inflight.pop(fut)
                    self.controller.to_experience(fut.result(), p)  # rewards scored as in training
                    self.done_times.append(time.perf_counter())
                    open_groups[p.group_id] += 1
                    if open_groups[p.group_id] == self.controller.group_size:
                        del open_groups[p.group_id]
        except BaseException as e:  # re-raised by __exit__
            self._error = e

    def samples_per_s(self, t0: float, t1: float) -> float:
        return sum(t0 < t <= t1 for t in self.done_times) / (t1 - t0)

    def __exit__(self, exc_type: object, *exc: object) -> None:
        # Requests still generating are not waited for: shutting the engine down ends them, and
        # the thread's wait returns within one completion or the engine's health poll.
        self._stop.set()
        self._thread.join(timeout=60)
        self.controller.close()
        self.engine.shutdown()
        if self._error is not None and exc_type is None:  # never mask the training's own error
            raise self._error


# ---------------------------------------------------------------------------- (a) generation
def measure_generation(cfg: DictConfig, warmup: int, samples: int, sync_trials: int = 3) -> dict[str, Any]:
    """Steady-state samples/s of the engine alone; returns the figures and the experiences."""

    from modules.policy.hf_policy import load_policy, named_weights

    task, controller, engine, tokenizer, prompts = _rollout_parts(cfg)
    max_groups = concurrency_groups(controller, engine.concurrency)
    g = controller.group_size
    engine.start()
    try:
        affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        controller.bind(rollout_context(cfg, engine, task, tokenizer, prompts))
        inflight: dict[Any, Any] = {}
        open_groups: dict[int, list] = {}
        groups: list[list] = []
        done_times: list[float] = []
        done_tokens: list[int] = []
        total = warmup + samples

        def top_up() -> None:
            while len(open_groups) < max_groups and len(done_times) < total:
                started = controller.submit_group(prompts.next())
                open_groups[next(iter(started.values())).group_id] = []
                inflight.update(started)

        top_up()
        while inflight:
            done = engine.wait_any(set(inflight))
            for fut in done:
                p = inflight.pop(fut)
                exp = controller.to_experience(fut.result(), p)
                done_times.append(time.perf_counter())
                done_tokens.append(len(exp.response_ids))
                group = open_groups[p.group_id]
                group.append(exp)
                if len(group) == g:
                    groups.append(controller.finish_group(open_groups.pop(p.group_id)))
            top_up()  # stops issuing once `total` responses are in; the rest drain untimed
        # Timed window: from the warmup-th completed response to the last one counted.
        t0, t1 = done_times[warmup - 1], done_times[total - 1]
        n = samples
        window_tokens = done_tokens[warmup:total]
        policy, _ = load_policy(engine.model_path)
        weights = named_weights(policy)
        sync_s = [engine.update_weights(weights, engine.version) for _ in range(sync_trials)]
    finally:
        controller.close()  # reward workers, if any
        engine.shutdown()
    groups.sort(key=lambda grp: grp[0].group_id)  # issue order: no completion-time bias
    return {
        "figures": {
            "concurrency_groups": max_groups,
            "concurrency_requests": max_groups * g,
            "engine_max_num_seqs": engine.max_num_seqs,
            "warmup_samples": warmup,
            "samples": n,
            "seconds": t1 - t0,
            "samples_per_s": n / (t1 - t0),
            "tokens_per_s": sum(window_tokens) / (t1 - t0),
            "response_len_mean": statistics.fmean(window_tokens),
            "trainer_affinity_during_generation": affinity,
        },
        "weight_sync_s": statistics.median(sync_s) if sync_s else None,
        "groups": groups,
    }
