"""TRL's GRPOTrainer on the project's task, matched to ``recipe=sync_grpo``: the peer benchmark.

    make trl-venv                                                     # once: TRL in .venv-trl
    .venv-trl/bin/python -m tools.trl_peer --run-dir outputs/bench/trl/seed0 --seed 0
    python -m tools.heldout_curve outputs/bench/trl/seed0        # held-out reward curve
    python -m lab.modes --recipes trl sync_grpo async_grpo --reference trl   # all of it
    .venv-trl/bin/python -m tools.trl_peer --run-dir outputs/bench/trl_agent/seed0 -- \
        recipe=agent_calculator rollout=sync "~rollout.max_staleness" algo/correction=none \
        algo.loss.anchor=bypass                               # multi-turn: tools/trl_episodes.py

Runs in TRL's own venv (``make trl-venv``: the project's torch / transformers / vLLM plus TRL),
never in the project's. The settings come from the project's own composed config
(``recipe=sync_grpo``, or the ``recipe=`` given after ``--``, + ``seed`` + the other overrides
after ``--``), mapped field by field:

    model.path (the warm start or an imported model, float32, dropout off) -> model, disable_dropout=True
    prompts: the task's train split in the order of the project's PromptStream(seed), P per rollout
          batch, rendered by model.prompt_format: plain text as TRL's text prompt, ChatTemplate as
          TRL's conversational prompt (system + user turn), the ids checked equal to the project's;
          with an env, TRL gets the text and the rollout renders it (tools/trl_episodes.py)
    rollout.group_size G, P x G completions per rollout batch -> num_generations, generation batch
    algo.minibatches M, algo.micro_batch_size m -> per_device_train_batch_size=m (a divisor of
          P*G/M), gradient_accumulation_steps=P*G/(M m), steps_per_generation=P*G/m (``batch_shape``)
    rollout.sampling (temperature, top_p, top_k, max_tokens) -> the same generation settings
    the task's reward (``task.reward(row, text)``) + rollout.overlong (DAPO's soft punishment on the
          response's token count, the project's Overlong; filter -> mask_truncated_completions)
                                                       -> the one reward function
    env (multi-turn episodes: ``env=calculator``)      -> rollout_func + env_mask (tools/trl_episodes.py),
                                                          the episode's reward as the reward
    algo: group advantages scaled by std, PPO clip eps, token-mean loss, 1 epoch
                                                       -> scale_rewards="group", epsilon,
                                                          loss_type="dapo", num_iterations=1
    algo.loss.anchor decoupled | bypass, algo/correction tis | none: TRL samples with the model it
          trains (no separate engine), so the behaviour policy is the trainer's own: its ratio's
          denominator is the policy of the rollout batch as the trainer computes it (the
          decoupled anchor; the same as bypass with no sampler mismatch), and a correction of the
          sampler's mismatch has nothing to correct (TRL applies none)
    algo.loss.kl_coef (k3 to module.ref_model_path = the warm start, in the loss)
                                                       -> beta, use_bias_correction_kl=True:
          TRL's per-token beta * k3 * ratio has value k3 and gradient -log(rho) grad log pi, the
          project's k3 term's gradient; both are token means, so they match term for term
    module.optimizer (AdamW lr, betas, weight decay), constant lr, trainer.gradient_clip_val
    trainer.precision 32-true | bf16-mixed             -> bf16=False | True (autocast on the CPU)
    module.gradient_checkpointing (default false)      -> gradient_checkpointing (TRL's default: true)
    trainer.max_steps (optimizer steps)                -> max_steps

Differences that remain: TRL generates with plain ``transformers`` ``generate`` in the training
process (both cores, ``--threads``), where the project uses its vLLM engine on its own core;
TRL's group std is the sample std (the project's: population std); TRL's sampling seeds
differ from the engine's. With M > 1 minibatches TRL's "dapo" loss divides each slice's token
sum by the rollout batch's tokens / M, not by the slice's own count (the project's token mean
per minibatch): the same in expectation, a different scale per step before gradient clipping.
TRL's ``mask_truncated_completions`` counts a response as truncated when it does not end in
EOS; the project also when it fills max_tokens exactly. Settings TRL cannot mirror (other
corrections, several epochs, a KL other than k3 to the starting model, dynamic sampling) are
refused with the field named.

Writes a run directory that ``tools.heldout_curve`` and ``lab.modes`` read like a
``train.py`` run: ``.hydra/overrides.yaml`` (the project overrides the settings came from, so
evaluation uses the same held-out prompts and engine), ``metrics.csv`` (per step:
``perf/wall_s`` = seconds since training began with snapshot saving excluded,
``perf/samples_total``, ``perf/samples_per_s``, ``train/reward_mean``,
``train/response_len_mean``), snapshots ``checkpoints/step=N.ckpt`` every ``--save-every``
steps and ``hf_model/`` at the end.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import yaml

MATCHED = {  # project fields TRL can mirror only at these values
    "algo.epochs": (1,),
    "algo.loss.anchor": ("bypass", "decoupled"),  # the same when the sampler is the trained model
    "algo.loss.aggregation": ("token_mean",),
    "algo.kl_reward.coef": (0.0,),
    "algo.advantage.scale_by_std": (True,),
    "data.sync_every": (1,),
    "trainer.precision": ("32-true", "32", "bf16-mixed"),
    "rollout.group_filter": (None,),  # DAPO's dynamic sampling: not mirrored
}
CORRECTIONS = ("modules.algo.corrections.NoCorrection", "modules.algo.corrections.TruncatedTokenIS")


def batch_shape(cfg: Any) -> tuple[int, int, int]:
    """``(per_device_train_batch_size, gradient_accumulation_steps, steps_per_generation)`` for
    ``algo.minibatches`` optimizer steps per rollout batch in slices of ``algo.micro_batch_size``:
    TRL's "dapo" normaliser (the generation batch's tokens x accumulation / steps per generation)
    is then the rollout batch's tokens / M for every slice, with or without accumulation."""
    minibatch = int(cfg.rollout.prompts_per_step) * int(cfg.rollout.group_size) // int(cfg.algo.minibatches)
    cap = minibatch if cfg.algo.micro_batch_size is None else min(int(cfg.algo.micro_batch_size), minibatch)
    micro = max(d for d in range(1, cap + 1) if minibatch % d == 0)
    accumulation = minibatch // micro
    return micro, accumulation, int(cfg.algo.minibatches) * accumulation


def check_matchable(cfg: Any) -> None:
    from omegaconf import OmegaConf

    for field, allowed in MATCHED.items():
        value = OmegaConf.select(cfg, field)
        if value not in allowed:
            names = " or ".join(f"{field}={a!r}" for a in allowed)
            raise SystemExit(f"{field}={value!r}: the TRL peer mirrors only {names}")
    batch = int(cfg.rollout.prompts_per_step) * int(cfg.rollout.group_size)
    minibatches = int(cfg.algo.minibatches)
    if minibatches < 1 or batch % minibatches:
        raise SystemExit(
            f"algo.minibatches={minibatches}: the TRL peer needs a divisor of the rollout batch "
            f"({batch} samples: rollout.prompts_per_step x rollout.group_size)"
        )
    if float(cfg.algo.loss.kl_coef) > 0:  # TRL's beta: per-token k3 to the initial model, in the loss
        if cfg.algo.loss.kl_kind != "k3":
            raise SystemExit(f"algo.loss.kl_kind={cfg.algo.loss.kl_kind!r}: the TRL peer mirrors only k3")
        if str(cfg.module.ref_model_path) != str(cfg.module.model_path):
            raise SystemExit(
                f"module.ref_model_path={cfg.module.ref_model_path!r}: the TRL peer's reference is the "
                f"starting model, module.model_path={cfg.module.model_path!r}"
            )
    if cfg.algo.correction._target_ not in CORRECTIONS:  # tis: weight 1 when sampler == trained model
        raise SystemExit("algo/correction: the TRL peer mirrors only algo/correction=none or tis")
    if not str(cfg.algo.objective._target_).endswith("ppo_clip"):
        raise SystemExit("algo/objective: the TRL peer mirrors only algo/objective=ppo_clip")


def peer_recipe(overrides: list[str]) -> list[str]:
    """The project overrides the peer composes: ``recipe=sync_grpo`` unless one is named."""
    return overrides if any(o.startswith("recipe=") for o in overrides) else ["recipe=sync_grpo", *overrides]


def trl_prompt(prompt_format: Any, text: str) -> str | list[dict[str, str]]:
    """The prompt as TRL takes it: text, or (a chat template) the conversation it renders."""
    from modules.policy.prompt_format import ChatTemplate

    return prompt_format.messages(text) if isinstance(prompt_format, ChatTemplate) else text


def check_prompt_ids(prompt_format: Any, tokenizer: Any, texts: list[str]) -> None:
    """TRL tokenises a text prompt with the tokenizer's defaults and a conversation with
    ``apply_chat_template``; refuse a prompt whose ids differ from the ones the project
    trains on (a BOS added twice, a system turn rendered differently)."""
    for text in texts:
        prompt = trl_prompt(prompt_format, text)
        if isinstance(prompt, str):
            ids = tokenizer(text=[prompt])["input_ids"][0]
        else:
            ids = tokenizer.apply_chat_template(
                conversation=[prompt], add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"][0]
        ours = prompt_format.ids(tokenizer, text)
        if list(ids) != list(ours):
            raise SystemExit(
                f"model.prompt_format: TRL would tokenise the prompt {text[:60]!r} to {len(ids)} ids, "
                f"the project to {len(ours)} ({list(ids)[:8]} vs {list(ours)[:8]} at the start)"
            )


def snapshot(model: torch.nn.Module, path: Path, step: int) -> None:
    """The weights as a Lightning-style checkpoint ``tools.heldout_curve`` can read."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {f"policy.{k}": v.detach().cpu().clone() for k, v in model.state_dict().items()}
    torch.save({"state_dict": state, "asyncrl": {"policy_version": step}}, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-every", type=int, default=5, help="steps between weight snapshots")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")
    parser.add_argument(
        "overrides", nargs="*", help="project overrides (after --), e.g. trainer.max_steps=30"
    )
    args = parser.parse_args()

    from datasets import Dataset
    from hydra.utils import instantiate
    from omegaconf import OmegaConf
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from data.rollout.prompts import PromptStream
    from modules.launch.compose import compose
    from modules.policy.hf_policy import disable_dropout, load_policy

    overrides = peer_recipe([f"seed={args.seed}", *args.overrides])
    run_dir = args.run_dir.resolve()
    cfg = compose(overrides, output_dir=str(run_dir))
    check_matchable(cfg)
    torch.set_num_threads(args.threads)
    task = instantiate(cfg.task)
    rollout = instantiate(cfg.rollout)
    p, g = int(rollout.prompts_per_step), int(rollout.group_size)
    steps, minibatches = int(cfg.trainer.max_steps), int(cfg.algo.minibatches)
    stream = PromptStream(list(task.build("train", cfg.data.train_size)), seed=cfg.seed)
    rows = [stream.next() for _ in range(p * -(-steps // minibatches))]  # the project's prompt order
    by_id = {int(r["id"]): r for r in rows}
    model, tokenizer = load_policy(cfg.model.path)
    prompt_format = instantiate(cfg.data.prompt_format)
    check_prompt_ids(prompt_format, tokenizer, [task.prompt_text(r) for r in rows[:8]])
    dataset = Dataset.from_list(
        [{"prompt": trl_prompt(prompt_format, task.prompt_text(r)), "row_id": int(r["id"])} for r in rows]
    )
    overlong = rollout.overlong  # DAPO's soft punishment on the response's token count, as ours
    budget = int(rollout.sampling.max_tokens)

    def reward(prompts: list, completions: list, row_id: list, completion_ids: list, **_: Any) -> list[float]:
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]  # conversational
        out = [float(task.reward(by_id[int(i)], text)) for i, text in zip(row_id, texts)]
        if overlong is not None:
            out = [r + overlong.length_penalty(len(ids), budget) for r, ids in zip(out, completion_ids)]
        return out

    reward.__name__ = "task_reward"
    rollout_func = None
    if cfg.get("env") is not None:  # multi-turn: the project's environment through TRL's rollout_func
        from tools.trl_episodes import EpisodeRollout

        if overlong is not None:
            raise SystemExit("rollout/overlong: the TRL peer's multi-turn path does not mirror it")

        env = instantiate(cfg.env)
        texts = {task.prompt_text(r): r for r in rows}
        rollout_func = EpisodeRollout(env, task, texts, tokenizer, rollout.sampling, prompt_format)
        # the rollout renders each prompt (its chat template included): TRL is given the text
        dataset = Dataset.from_list([{"prompt": task.prompt_text(r), "row_id": int(r["id"])} for r in rows])

        def reward(prompts: list, completions: list, episode_reward: list, **_: Any) -> list[float]:
            return [float(x) for x in episode_reward]

        reward.__name__ = "episode_reward"
    disable_dropout(model)
    micro, accumulation, per_generation = batch_shape(cfg)
    sampling = rollout.sampling
    opt = cfg.module.optimizer
    eps = cfg.algo.objective
    config = GRPOConfig(
        output_dir=str(run_dir / "trl"),
        max_steps=steps,
        per_device_train_batch_size=micro,
        num_generations=g,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=per_generation,  # one rollout batch of P x G, M optimizer steps on it
        num_iterations=1,
        max_completion_length=int(rollout_func.budget if rollout_func else sampling.max_tokens),
        temperature=float(sampling.temperature),
        top_p=float(sampling.top_p),
        top_k=int(sampling.top_k) if int(sampling.top_k) > 0 else 0,
        beta=float(cfg.algo.loss.kl_coef),
        use_bias_correction_kl=True,  # explicit: the gradient match above depends on it
        epsilon=float(eps.eps_low),
        epsilon_high=float(eps.eps_high),
        loss_type="dapo",  # token mean over the step's tokens = algo.loss.aggregation=token_mean
        scale_rewards="group",
        learning_rate=float(opt.lr),
        adam_beta1=float(opt.betas[0]),
        adam_beta2=float(opt.betas[1]),
        weight_decay=float(opt.weight_decay),
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=float(cfg.trainer.gradient_clip_val),
        optim="adamw_torch",
        shuffle_dataset=False,
        disable_dropout=True,
        # as the project's trainer (TRL defaults to True: one more forward per backward)
        gradient_checkpointing=bool(OmegaConf.select(cfg, "module.gradient_checkpointing", default=False)),
        use_vllm=False,
        use_cpu=True,
        bf16=str(cfg.trainer.precision) == "bf16-mixed",
        mask_truncated_completions=bool(overlong is not None and overlong.filter),
        fp16=False,
        seed=int(cfg.seed),
        data_seed=int(cfg.seed),
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        dataloader_num_workers=0,
        remove_unused_columns=False,
    )

    class Clock(TrainerCallback):
        """Per-step wall time since training began, snapshot saving excluded."""

        def __init__(self) -> None:
            self.t0 = 0.0
            self.excluded = 0.0
            self.rows: list[dict[str, float]] = []
            self.last_log: dict[str, float] = {}

        def on_train_begin(self, args_: Any, state: Any, control: Any, **kw: Any) -> None:
            self.t0 = time.perf_counter()
            self.excluded = time.perf_counter()
            snapshot(kw["model"], run_dir / "checkpoints" / "step=0.ckpt", 0)
            self.excluded = time.perf_counter() - self.excluded

        def on_log(self, args_: Any, state: Any, control: Any, logs: dict | None = None, **kw: Any) -> None:
            if not logs or "loss" not in logs:  # the end-of-training summary is not a step
                return
            if state.global_step and self.rows and self.rows[-1]["step"] == state.global_step - 1:
                row = self.rows[-1]
                row["train/reward_mean"] = logs.get("reward", row.get("train/reward_mean", float("nan")))
                # the project's: every episode token (TRL's mean_length counts env_mask = 1 only)
                row["train/response_len_mean"] = (
                    rollout_func.response_len_mean
                    if rollout_func is not None
                    else logs.get("completions/mean_length", float("nan"))
                )
                row["train/loss"] = logs.get("loss", float("nan"))

        def on_step_end(self, args_: Any, state: Any, control: Any, **kw: Any) -> None:
            wall = time.perf_counter() - self.t0 - self.excluded
            n = state.global_step
            self.rows.append(
                {
                    "step": n - 1,
                    "perf/wall_s": wall,
                    "perf/samples_total": n
                    * p
                    * g
                    // minibatches,  # samples trained: P x G / M per optimizer step
                    "perf/samples_per_s": n * p * g / minibatches / wall,
                }
            )
            if n % args.save_every == 0 or n == steps:
                t = time.perf_counter()
                snapshot(kw["model"], run_dir / "checkpoints" / f"step={n}.ckpt", n)
                self.excluded += time.perf_counter() - t

    clock = Clock()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock],
        rollout_func=rollout_func,
    )
    try:
        trainer.train()
    finally:
        if rollout_func is not None:  # the environment's tools (an HTTP server, workers) and loop
            rollout_func.close()
    model.save_pretrained(run_dir / "hf_model", safe_serialization=True)
    tokenizer.save_pretrained(run_dir / "hf_model")
    write_run(run_dir, overrides, clock.rows)
    last = clock.rows[-1]
    print(
        json.dumps(
            {
                "run_dir": str(run_dir),
                "steps": steps,
                "train_wall_s": last["perf/wall_s"],
                "samples_per_s": last["perf/samples_per_s"],
                "threads": args.threads,
            }
        )
    )


# Keys lab.modes reads from every run; TRL has no staleness, no weight sync, no engine.
CONSTANT_KEYS = {
    "rollout/staleness_mean": 0.0,
    "rollout/staleness_max": 0.0,
    "rollout/staleness_frac_0": 1.0,
    "rollout/staleness_frac_1": 0.0,
    "rollout/staleness_frac_2": 0.0,
    "rollout/staleness_frac_3plus": 0.0,
    "perf/weight_sync_s": 0.0,
    "perf/weight_sync_max_abs_diff": 0.0,
    "perf/trainer_idle_frac": float("nan"),
    "perf/engine_idle_frac": float("nan"),
    "perf/tokens_per_s": float("nan"),
    "bias/len_kl_trained_vs_issued": 0.0,
    "bias/level_kl_trained_vs_issued": 0.0,
}


def write_run(run_dir: Path, overrides: list[str], rows: list[dict[str, float]]) -> None:
    (run_dir / ".hydra").mkdir(parents=True, exist_ok=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    rows = [{**CONSTANT_KEYS, **r} for r in rows]
    keys = sorted({k for r in rows for k in r})
    with open(run_dir / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    main()
