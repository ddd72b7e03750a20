"""A simulated, virtual-clock engine (the ``Engine`` protocol): for the pipeline simulator
(``tools/pipeline.py``), the overhead benchmark and the rollout-semantics tests. Never
the training path.

By default each request generates one token per time unit however many run (a GPU-like engine).
``step_cost=(a, b)`` makes one decoding iteration over n running requests take ``a + b * n``
units (every running request gains one token per iteration: a batched decoder whose iteration
slows with the batch, as vLLM-CPU's does), and ``prefill_iterations`` delays each request's
first token by that many iterations (prefill, scheduling); ``tools/workload.py`` fits all
three to a finished run. The clock is
kept as a token clock (iterations since start): every running request advances at the same rate,
so completion order is fixed at submission and the wall time follows from the iteration cost.

A request's length is read from the prompt, ``"<length>|"`` in the fake tokenizer's encoding
(or ``"<l0>,<l1>,...|"``: sample i of a group, from its request id ``g<gid>-s<i>``, takes
``l_i``), minus any partial response already appended (a continuation). ``advance()`` jumps the
clock to the next completion and resolves its future, which fires the rollout controller's
callbacks synchronously. Weight updates with
``inflight=keep`` split version spans at the update time; ``abort`` ends running requests
with their partial tokens; ``wait`` finishes them first.
"""

from __future__ import annotations

import concurrent.futures as cf
import heapq
import itertools
import threading
from dataclasses import dataclass, field

from modules.engine.placement import CorePinning
from modules.engine.types import Completion, EngineError, SamplingConfig


class SimTask:
    """Rows carry a generation length; the prompt ``"<length>|"`` tells SimEngine how long the
    response is. ``level`` is the index of the length class (difficulty) for bias metrics."""

    def __init__(self, lengths: list[int], levels: list[int] | None = None, fail: bool = False) -> None:
        levels = levels if levels is not None else [int(n >= 50) for n in lengths]
        self.rows = [{"id": i, "length": n, "level": lv} for i, (n, lv) in enumerate(zip(lengths, levels))]
        self.fail = fail

    @classmethod
    def mixture(cls, latencies: list[tuple[float, float]], n: int, seed: int = 0) -> SimTask:
        """n prompts whose lengths follow [(length, probability), ...]; level = class index."""
        import random

        rng = random.Random(seed)
        classes = rng.choices(range(len(latencies)), weights=[p for _, p in latencies], k=n)
        return cls([int(latencies[c][0]) for c in classes], classes)

    @classmethod
    def from_groups(cls, groups: list[tuple[int, list[int]]]) -> SimTask:
        """One prompt per recorded group: (level, its G response lengths); sample i of a
        resubmitted group takes the i-th length again (a run's own workload, replayed)."""
        task = cls([], [])
        task.rows = [{"id": i, "length": list(ls), "level": lv} for i, (lv, ls) in enumerate(groups)]
        return task

    def prompt_text(self, row: dict) -> str:
        n = row["length"]
        return (",".join(str(x) for x in n) if isinstance(n, list) else str(n)) + "|"

    def reward(self, row: dict, text: str) -> float:
        if self.fail:
            raise ValueError("verifier crashed")
        return float(row["id"] % 3 == 0)


class CharTokenizer:
    """ord/chr tokenizer matching the interface the controllers use."""

    pad_token_id = 0
    eos_token_id = 1

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i > 1)


SEP = ord("|")


@dataclass
class _Req:
    fut: cf.Future
    rid: str
    prompt: list[int]
    length: int  # tokens this request will produce if not interrupted
    start: float
    switches: list[tuple[float, int]] = field(default_factory=list)  # (token clock, new version)
    start_version: int = 0
    tick0: float = 0.0  # the token clock when its first token started (after the prefill)
    cut: bool = False  # stopped by max_tokens before its natural end ("length", else "stop")


class SimEngine:
    health_poll_s = 0.01
    stall_timeout_s = 1e9

    model_path = "sim"
    pinning = CorePinning(None)

    def __init__(
        self,
        max_concurrency: int | None = None,
        jitter: int = 0,
        step_cost: tuple[float, float] = (1.0, 0.0),
        prefill_iterations: float = 0.0,
    ) -> None:
        if step_cost[0] <= 0 or step_cost[1] < 0 or prefill_iterations < 0:
            raise ValueError(f"SimEngine: step_cost {step_cost} needs a > 0, b >= 0; prefill_iterations >= 0")
        self.jitter = jitter  # response length += hash(seed) % (jitter + 1): responses of a prompt differ
        self.step_cost = (float(step_cost[0]), float(step_cost[1]))
        self.prefill_iterations = float(prefill_iterations)
        self.slowdown = 1.0  # iteration cost multiplier (a trainer sharing the machine sets it)
        self.now = 0.0
        self.tick = 0.0  # token clock: decoding iterations so far
        self.version = 0
        self.max_concurrency = max_concurrency
        self.concurrency = max_concurrency  # the Engine protocol's name (None: unbounded)
        self._running: dict[str, _Req] = {}
        self._heap: list[tuple[float, int, str]] = []
        self._queue: list[_Req] = []
        self._seq = itertools.count()
        self.dead = False
        self.completed: list[tuple[float, str]] = []  # (time, request id)
        self.submitted = 0
        self.busy_time = 0.0  # time with >= 1 request running
        self.slot_time = 0.0  # integral of running requests over time
        self._last = 0.0

    # --- the Engine protocol
    def start(self) -> SimEngine:
        return self

    def shutdown(self) -> None:
        pass

    def check_health(self) -> None:
        if self.dead:
            raise EngineError("scripted engine killed")

    def on_done(self, fut: cf.Future, fn) -> None:
        fut.add_done_callback(fn)  # synchronous: the virtual clock stops while it runs

    def wait_any(self, pending: set[cf.Future]) -> set[cf.Future]:
        """Jump the clock to the next completion until one of ``pending`` is done."""
        while not any(f.done() for f in pending):
            self.advance()
        return {f for f in pending if f.done()}

    def clock(self) -> float:
        return self.now

    def wait_on(self, cv: threading.Condition) -> None:
        self.advance()  # completion callbacks run synchronously, under the caller's lock

    def score(self, sequence: list[int]) -> list[float]:
        return [-1.0] * (len(sequence) - 1)  # the logprob every simulated token carries

    def stats(self) -> dict[str, float]:
        return {"perf/engine_idle_frac": 1 - self.busy_time / self.now} if self.now else {}

    def submit(self, prompt_ids, sampling: SamplingConfig, seed=None, request_id=None, prompt_logprobs=False):
        self.check_health()
        fut: cf.Future = cf.Future()
        cut = prompt_ids.index(SEP)
        lengths = [int(x) for x in "".join(chr(c) for c in prompt_ids[:cut]).split(",")]
        total = lengths[_sample_index(request_id) % len(lengths)]
        done = len(prompt_ids) - cut - 1  # continuation: tokens already generated
        if self.jitter and seed is not None and done == 0:
            total += (seed * 2654435761) % (self.jitter + 1)  # scrambled: siblings differ
        length = max(0, min(total - done, sampling.max_tokens))
        req = _Req(
            fut,
            request_id or f"r{self.submitted}",
            list(prompt_ids),
            length,
            self.now,
            start_version=self.version,
            cut=total - done > sampling.max_tokens,
        )
        self.submitted += 1
        fut.add_done_callback(lambda f, rid=req.rid: self._cancelled(rid) if f.cancelled() else None)
        if self.max_concurrency is None or len(self._running) < self.max_concurrency:
            self._start(req)
        else:
            self._queue.append(req)
        return fut

    def _start(self, req: _Req) -> None:
        req.start = self.now
        req.start_version = self.version  # tokens are labelled by the weights that make them
        req.tick0 = self.tick + self.prefill_iterations
        self._running[req.rid] = req
        heapq.heappush(self._heap, (req.tick0 + req.length, next(self._seq), req.rid))

    def _iteration(self, extra: int = 0) -> float:
        """Time units one decoding iteration takes with the running requests (+ extra)."""
        a, b = self.step_cost
        return (a + b * (len(self._running) + extra)) * self.slowdown

    @property
    def busy(self) -> bool:
        """Some request is generating."""
        return bool(self._running)

    def _tokens(self, req: _Req) -> int:
        """Tokens a running request has produced by now."""
        return max(0, min(req.length, int(self.tick - req.tick0 + 1e-9)))

    def _time_to(self, tick: float) -> float:
        return max(0.0, tick - self.tick) * self._iteration()

    def _pass(self, t: float) -> None:
        """Move both clocks to time t (no completion in between)."""
        if t > self.now:
            self._account(t)
            self.tick += (t - self.now) / self._iteration()
            self.now = t

    def advance(self) -> None:
        """Move the clock to the next completion and resolve it (and any at the same time)."""
        self.check_health()
        self._drop_stale()
        if not self._heap:
            raise RuntimeError("advance() with nothing in flight: the controller would wait forever")
        tick = self._heap[0][0]
        t = self.now + self._time_to(tick)
        self._account(t)
        self.now, self.tick = t, max(self.tick, tick)
        while self._heap and self._heap[0][0] <= tick:
            _, _, rid = heapq.heappop(self._heap)
            req = self._running.pop(rid, None)
            if req is None:
                continue  # aborted earlier
            self._finish(req, req.length, "length" if req.cut else "stop")
        while self._queue and (self.max_concurrency is None or len(self._running) < self.max_concurrency):
            self._start(self._queue.pop(0))

    def _drop_stale(self) -> None:
        """Completions of requests that are gone (cancelled, aborted): nothing happens then."""
        while self._heap and self._heap[0][2] not in self._running:
            heapq.heappop(self._heap)

    def _finish(self, req: _Req, n: int, reason: str) -> None:
        spans, cursor, version = [], 0, req.start_version
        for tick, v in req.switches:
            k = min(n, max(0, int(tick - req.tick0 + 1e-9)))
            if k > cursor:
                spans.append((version, cursor, k))
            cursor, version = max(cursor, k), v
        if n > cursor:
            spans.append((version, cursor, n))
        comp = Completion(req.rid, req.prompt, [50] * n, [-1.0] * n, reason, req.start, self.now, spans)
        self.completed.append((self.now, req.rid))
        req.fut.set_result(comp)

    def update_weights(self, named_tensors, version: int, inflight: str = "keep") -> float:
        if inflight == "wait":
            while self._running:
                self.advance()
        elif inflight == "abort":
            self.version = version  # continuations resubmitted now run with the new weights
            for rid, req in list(self._running.items()):
                del self._running[rid]
                self._finish(req, self._tokens(req), "abort")
        else:
            for req in self._running.values():
                req.switches.append((self.tick, version))
        self.version = version
        return 0.0

    def _cancelled(self, rid: str) -> None:
        """A request's future was cancelled (the controller gave up on it): free its slot now."""
        self._account(self.now)
        if self._running.pop(rid, None) is None:
            self._queue = [r for r in self._queue if r.rid != rid]
        while self._queue and (self.max_concurrency is None or len(self._running) < self.max_concurrency):
            self._start(self._queue.pop(0))

    def advance_to(self, t: float) -> None:
        """Let virtual time pass (e.g. a training step), completing what finishes by ``t``."""
        self._drop_stale()
        while self._heap and self.now + self._time_to(self._heap[0][0]) <= t:
            self.advance()
            self._drop_stale()
        self._pass(t)

    def _account(self, t: float) -> None:
        """Engine utilisation bookkeeping up to time t (before completions at t are removed)."""
        dt = t - self._last
        if dt > 0:
            running = len(self._running)
            self.busy_time += dt if running else 0.0
            self.slot_time += dt * running
            self._last = t

    def kill(self) -> None:
        self.dead = True
        for req in list(self._running.values()):
            req.fut.set_exception(EngineError("scripted engine killed"))
        self._running.clear()


def _sample_index(request_id: str | None) -> int:
    """i from a rollout request id ``g<gid>-s<i>[-c<k>]`` (0 for any other id)."""
    for part in (request_id or "").split("-"):
        if part[:1] == "s" and part[1:].isdigit():
            return int(part[1:])
    return 0
