"""Start-up checks of the prompts against the engine's context, before the engine starts
(``RolloutDataModule.preflight``): every prompt of a split is rendered as the engine will be
sent it (``model.prompt_format``) and the longest, plus the response budget, must fit
``engine.max_model_len``. Otherwise vLLM refuses the request, or cuts the response short at the
context's end, mid-run."""

from __future__ import annotations

from typing import Any

from data.envs.base import check_episodes_fit
from modules.config.errors import check


def check_prompts(dm: Any, max_model_len: int | None) -> None:
    """``RolloutDataModule.preflight`` once its tokenizer and train rows are loaded: the prompt
    format fits the tokenizer; a multi-turn environment's stops and episode budget
    (``check_episodes_fit``), or a one-turn task's training and evaluation budgets, fit."""
    dm.prompt_format.check(dm.tokenizer, dm.engine.model_path)
    longest = longest_prompt(dm.task, dm.prompt_format, dm.tokenizer, dm.train_rows)
    max_tokens = dm.rollout.sampling.max_tokens
    eval_rows = dm.task.build("eval", dm.eval_size) if dm.eval_size else []
    eval_longest = longest_prompt(dm.task, dm.prompt_format, dm.tokenizer, eval_rows)
    if dm.env is not None:
        dm.prompt_format.observation(dm.tokenizer, "")  # the template renders its tool turn
        check_episodes_fit(dm.env, dm.tokenizer, longest, max_tokens, max_model_len)
        if dm.env.max_total_tokens is None:  # else the episode's budget covers evaluation too
            check_prompts_fit({"data.eval_max_tokens": (dm.eval_max_tokens, eval_longest)}, max_model_len)
        else:
            check_episodes_fit(dm.env, dm.tokenizer, eval_longest, max_tokens, max_model_len)
        return
    budgets = {
        "rollout.sampling.max_tokens": (max_tokens, longest),
        "data.eval_max_tokens": (dm.eval_max_tokens, eval_longest),
    }
    check_prompts_fit(budgets, max_model_len)


def longest_prompt(task: Any, prompt_format: Any, tokenizer: Any, rows: Any) -> int:
    """Tokens of the longest prompt among ``rows``, as the engine is sent them."""
    texts = sorted({task.prompt_text(r) for r in rows})  # many tasks repeat prompts
    return max(map(len, prompt_format.many_ids(tokenizer, texts)), default=0)


def check_prompts_fit(budgets: dict[str, tuple[int, int]], max_model_len: int | None) -> None:
    """``budgets``: field -> (its response budget, the longest prompt it follows); each sum
    must be <= ``max_model_len`` (null: not known here, not checked)."""
    if max_model_len is None:
        return
    for field, (budget, longest) in budgets.items():
        allowed = f"an int <= engine.max_model_len={max_model_len} - {longest} (the task's longest prompt)"
        check(field, budget, longest + budget <= max_model_len, allowed)
