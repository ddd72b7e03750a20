"""What a rollout engine is, as the rest of the project sees it: data types and a protocol.

Two engines implement ``Engine``: ``VLLMEngine`` (``modules/engine/vllm.py``, the real one)
and ``SimEngine`` (``modules/engine/sim.py``, a virtual clock for the pipeline simulator and
the rollout-semantics tests). Rollout controllers and the datamodule only use the methods
below, so they never ask which engine they drive.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from modules.config.errors import check

if TYPE_CHECKING:  # this package stays importable without torch (the reaper imports it)
    import torch

    from modules.engine.placement import CorePinning

INFLIGHT_MODES = ("keep", "abort", "wait")


class EngineError(RuntimeError):
    """The rollout engine failed; the message names the cause."""


@dataclass
class Completion:
    """One finished (or aborted) response as the engine produced it."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # behaviour logprob of each sampled token (processed distribution)
    finish_reason: str | None  # "stop", "length" or "abort"
    start_time: float
    end_time: float
    # (version, start, end) spans over token indexes: which policy produced which tokens.
    version_spans: list[tuple[int, int, int]] = field(default_factory=list)
    # With ``prompt_logprobs=True``: one float per prompt token (None for the first).
    prompt_logprobs: list[float | None] | None = None
    # A multi-turn episode (``data/envs/episodes.py``): 1 for the model's tokens, 0 for the
    # environment's observations; the episode's reward; each turn's record; and its state, so
    # an episode aborted at a weight sync resumes where it was.
    loss_mask: list[int] | None = None
    reward: float | None = None
    turns: list[dict[str, Any]] | None = None
    episode: Any = None

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


@dataclass
class SamplingConfig:
    """What the engine samples with; recorded on every experience."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 256
    ignore_eos: bool = False  # generate exactly max_tokens (benchmarks, tests)
    # tokens that end a request besides EOS, kept in its output (a multi-turn episode ends
    # the model's turn with one: a tool call's closing token; ``data/envs``)
    stop_token_ids: tuple[int, ...] = ()
    # strings that end a request (checked on the detokenized text), kept in its output: a stop
    # of several tokens (SmolLM2's "</tool_call>" is five); the sampled ids are kept as sampled
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check(
            "rollout.sampling.temperature",
            self.temperature,
            self.temperature >= 0,
            "a float >= 0 (0 = greedy)",
        )
        check("rollout.sampling.top_p", self.top_p, 0 < self.top_p <= 1, "a float in (0, 1]")
        check("rollout.sampling.top_k", self.top_k, self.top_k == -1 or self.top_k >= 1, "-1 or >= 1")
        check("rollout.sampling.max_tokens", self.max_tokens, self.max_tokens >= 1, "an int >= 1")

    def as_dict(self) -> dict[str, Any]:
        out = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_tokens": self.max_tokens,
            "ignore_eos": self.ignore_eos,
        }
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.stop:
            out["stop"] = list(self.stop)
        return out


class Engine(Protocol):
    """The rollout engine interface the controllers, the datamodule and the callbacks use."""

    version: int  # label of the weights it serves (policy version)
    model_path: str  # what it serves (the trainer loads the same tokenizer)
    pinning: CorePinning  # keeps a trainer process off the engine's cores (a no-op on GPUs)
    concurrency: int | None  # requests it runs at once (vLLM max_num_seqs); None: unbounded

    def start(self) -> Engine: ...

    def shutdown(self) -> None: ...

    def check_health(self) -> None:
        """Raise ``EngineError`` if the engine is dead."""

    def submit(
        self,
        prompt_ids: list[int],
        sampling: SamplingConfig,
        seed: int | None = None,
        request_id: str | None = None,
        prompt_logprobs: bool = False,
    ) -> cf.Future:
        """Start one request; the future resolves to a ``Completion``."""

    def on_done(self, fut: cf.Future, fn: Callable[[cf.Future], None]) -> None:
        """Call ``fn(fut)`` once ``fut`` is done, in completion order, never on the thread
        that drives generation (a slow callback, e.g. a reward, must not stall the engine)."""

    def wait_any(self, pending: set[cf.Future]) -> set[cf.Future]:
        """Block until at least one of ``pending`` is done; raise ``EngineError`` if the
        engine dies or stalls meanwhile."""

    def wait_on(self, cv: threading.Condition) -> None:
        """Called with ``cv`` held by a consumer waiting for completion callbacks: let time
        pass (release ``cv`` while waiting) and raise ``EngineError`` if the engine died."""

    def update_weights(
        self, named_tensors: dict[str, torch.Tensor], version: int, inflight: str = "keep"
    ) -> float:
        """Load new weights labelled ``version``; ``inflight`` in ``INFLIGHT_MODES``. Seconds."""

    def score(self, sequence: list[int]) -> list[float]:
        """Logprob (temperature 1) of each token of ``sequence`` after the first."""

    def stats(self) -> dict[str, float]:
        """Engine-side metrics (``perf/engine_idle_frac``, ``perf/tokens_per_s``) since start."""

    def clock(self) -> float:
        """Seconds on the engine's clock (monotonic; the simulator's virtual time), for rates
        and latencies measured against it."""


class WeightTransfer(Protocol):
    """How weights reach the engine: ``shm_transfer`` (any device) or ``nccl_transfer`` (GPUs).

    ``run(coro, timeout)`` runs a coroutine on the engine's event loop and returns its result,
    raising ``EngineError`` if the engine dies meanwhile.
    """

    def engine_args(self) -> dict[str, Any]:
        """Extra ``AsyncEngineArgs`` the transfer needs on the engine side."""

    def send(self, named_tensors: dict[str, torch.Tensor], llm: Any, run: Any) -> None:
        """Load ``named_tensors`` into the engine's model (generation is paused)."""

    def close(self) -> None: ...


def as_version(v: object) -> int:
    """A vLLM weight-version label as our policy version."""
    try:
        return int(v)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return 0  # vLLM labels the initial weights "default": that is our version 0


def sampling_fits_engine(cfg: Any) -> None:
    """Cross-field rule: a response of ``rollout.sampling.max_tokens`` (and an evaluation one of
    ``data.eval_max_tokens``) leaves room for the prompt within ``engine.max_model_len``."""
    mml = cfg.engine.max_model_len
    max_tokens = cfg.rollout.sampling.max_tokens
    check(
        "rollout.sampling.max_tokens",
        max_tokens,
        isinstance(max_tokens, int) and max_tokens + 16 <= mml,
        f"an int that leaves room for the prompt within engine.max_model_len={mml}",
    )
    eval_tokens = cfg.data.get("eval_max_tokens")
    if eval_tokens is not None:
        check(
            "data.eval_max_tokens",
            eval_tokens,
            1 <= eval_tokens and eval_tokens + 16 <= mml,
            f"null or an int >= 1 that leaves room for the prompt within engine.max_model_len={mml}",
        )
