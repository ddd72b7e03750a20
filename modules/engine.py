"""The rollout engine: vLLM's AsyncLLM driven by a background thread with its own event loop.

The trainer thread never touches asyncio. It calls plain methods (``submit`` returns a
``concurrent.futures.Future``; ``update_weights`` blocks) and this class forwards them to the
engine thread with ``asyncio.run_coroutine_threadsafe``. vLLM's engine core itself runs in a
child process; on a CPU its compute is pinned to ``cpu_cores`` (``VLLM_CPU_OMP_THREADS_BIND``)
so that the trainer keeps the other cores, the CPU analogue of dedicating GPUs to rollout.

Failure contract: if the engine dies or its loop raises, every pending future fails, and
``check_health`` raises ``EngineError`` naming the cause; callers that wait use
``wait_result`` which polls health, so nothing hangs.

Run this file to smoke-test an engine on a model directory:

    python -m modules.engine artifacts/tiny-qwen-sft
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import itertools
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from modules.config_errors import check, check_choice

PROJECT_ROOT = Path(__file__).resolve().parents[1]


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
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_tokens": self.max_tokens,
            "ignore_eos": self.ignore_eos,
        }


class VLLMEngine:
    """In-process handle on a vLLM AsyncLLM rollout engine.

    Construction only validates arguments; ``start()`` builds the engine (about 15-30 s).
    """

    def __init__(
        self,
        model_path: str,
        dtype: str = "float32",
        max_model_len: int = 512,
        max_num_seqs: int = 256,
        seed: int = 0,
        cpu_cores: str | None = "1",
        cpu_kvcache_gb: int = 1,
        gpu_ids: list[int] | None = None,
        gpu_memory_utilization: float = 0.5,
        enforce_eager: bool = True,
        startup_timeout_s: float = 300.0,
        stall_timeout_s: float = 600.0,
        health_poll_s: float = 0.5,
        pin_trainer: bool = True,
        weight_transfer: str = "shm",
    ) -> None:
        check("engine.max_model_len", max_model_len, max_model_len >= 16, "an int >= 16")
        check("engine.max_num_seqs", max_num_seqs, max_num_seqs >= 1, "an int >= 1")
        check(
            "engine.dtype",
            dtype,
            dtype in ("float32", "bfloat16", "float16", "auto"),
            "one of float32, bfloat16, float16, auto",
        )
        check("engine.stall_timeout_s", stall_timeout_s, stall_timeout_s > 0, "a float > 0")
        check("engine.gpu_ids", gpu_ids, gpu_ids is None or len(gpu_ids) >= 1, "null or a non-empty list")
        # shm: safetensors files in /dev/shm (any device); nccl: GPU-to-GPU (docs/gpu.md).
        check_choice("engine.weight_transfer", weight_transfer, ("shm", "nccl"))
        check(
            "engine.weight_transfer",
            weight_transfer,
            weight_transfer != "nccl" or gpu_ids is not None,
            "shm when engine.gpu_ids is null (nccl needs the engine on dedicated GPUs)",
        )
        self.model_path = str(model_path)
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.seed = seed
        self.cpu_cores = cpu_cores
        self.cpu_kvcache_gb = cpu_kvcache_gb
        self.gpu_ids = gpu_ids
        self.gpu_memory_utilization = gpu_memory_utilization
        self.enforce_eager = enforce_eager
        self.startup_timeout_s = startup_timeout_s
        self.stall_timeout_s = stall_timeout_s
        self.health_poll_s = health_poll_s
        self.pin_trainer = pin_trainer
        self.weight_transfer = weight_transfer
        self._transfer: Any = None  # NCCLWeightTransfer when weight_transfer == "nccl"

        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._llm: Any = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._ids = itertools.count()
        self.version = 0
        # Busy accounting for perf/engine_idle_frac: time with >= 1 request in flight.
        self._inflight = 0
        self._busy_since: float | None = None
        self._busy_total = 0.0
        self._lock = threading.Lock()
        self.tokens_generated = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> VLLMEngine:
        if self._thread is not None:
            return self
        from modules.policy import is_hub_id

        if not is_hub_id(self.model_path) and not Path(self.model_path, "config.json").exists():
            raise EngineError(
                f"engine.model_path={self.model_path!r} holds no model (no config.json); "
                "the RL recipes start from the SFT warm start: run `make sft` first"
            )
        self._configure_placement()
        if self.weight_transfer == "nccl" and self._transfer is None:
            from modules.gpu_weight_transfer import NCCLWeightTransfer  # GPU-only path: import late

            self._transfer = NCCLWeightTransfer(engine_ranks=len(self.gpu_ids or ()), dtype=self.dtype)
        import psutil

        children_before = {p.pid for p in psutil.Process().children(recursive=True)}
        self._thread = threading.Thread(target=self._thread_main, name="asyncrl-engine", daemon=True)
        self._thread.start()
        try:
            if not self._ready.wait(self.startup_timeout_s):
                raise EngineError(f"engine did not start within {self.startup_timeout_s:.0f} s")
        except BaseException:  # timeout or Ctrl-C during start-up: leave nothing behind
            self.shutdown()
            raise
        if self._error is not None:
            err = self._error
            self.shutdown()
            raise EngineError(f"engine failed to start: {err!r}") from err
        self.started_at = time.time()
        self._start_reaper(children_before)
        self._pin_trainer()
        return self

    def _start_reaper(self, before: set[int]) -> None:
        """Watch the processes this start created (engine core, workers): if the trainer dies
        without shutting them down, ``modules.reaper`` kills them."""
        import psutil

        from modules import reaper

        new = []
        for p in psutil.Process().children(recursive=True):
            try:
                # multiprocessing's resource tracker may start with the engine (vLLM spawns)
                # but serves this whole process: it must outlive the engine.
                if p.pid not in before and "resource_tracker" not in " ".join(p.cmdline()):
                    new.append(p.pid)
            except psutil.Error:
                continue
        self._reaper = reaper.launch(new) if new else None

    def _pin_trainer(self) -> None:
        """Keep the trainer process off the engine's cores (threads created later inherit)."""
        if not (self.pin_trainer and self.gpu_ids is None and self.cpu_cores):
            return
        if not hasattr(os, "sched_setaffinity"):
            return
        self._saved_affinity = os.sched_getaffinity(0)
        rest = self._saved_affinity - _parse_cores(str(self.cpu_cores))
        if rest:
            os.sched_setaffinity(0, rest)

    def _configure_placement(self) -> None:
        # The engine's worker processes inherit this environment.
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # one INFO line per sync otherwise
        if self.gpu_ids is None:
            if self.cpu_cores:
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(self.cpu_cores)
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(self.cpu_kvcache_gb)
        else:  # CUDA: dedicate these GPUs to rollout (untested here: no GPU in CI).
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.gpu_ids))
        # Workers are spawned: they must be able to import modules.weight_sync.
        paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if str(PROJECT_ROOT) not in paths:
            os.environ["PYTHONPATH"] = os.pathsep.join([str(PROJECT_ROOT), *filter(None, paths)])

    def _thread_main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._build())
        except BaseException as e:  # surfaced by start()
            self._error = e
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        except BaseException as e:
            self._error = e
        finally:
            loop.close()

    async def _build(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            model=self.model_path,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            seed=self.seed,
            enforce_eager=self.enforce_eager,
            # Logprobs of the distribution actually sampled (after temperature / top-p).
            logprobs_mode="processed_logprobs",
            worker_extension_cls="modules.weight_sync.WeightSyncExtension",
            gpu_memory_utilization=self.gpu_memory_utilization,
            tensor_parallel_size=len(self.gpu_ids) if self.gpu_ids else 1,
            disable_log_stats=True,
            **(self._transfer.engine_args() if self._transfer is not None else {}),
        )
        self._llm = AsyncLLM.from_engine_args(args)

    def shutdown(self) -> None:
        """Stop the engine and its child processes. Safe to call twice."""
        if self._thread is not None and self._thread.is_alive() and not self._ready.is_set():
            # Interrupted during start-up: let the build finish so its processes can be reaped.
            self._ready.wait(self.startup_timeout_s)
        llm, loop, thread = self._llm, self._loop, self._thread
        self._llm = None
        if llm is not None and loop is not None and thread is not None and thread.is_alive():
            # Cancel the output handler before the core goes away, inside the engine's loop,
            # so vLLM does not report the intended shutdown as an engine death.
            fut = asyncio.run_coroutine_threadsafe(_shutdown_llm(llm), loop)
            try:
                fut.result(timeout=60)
            except Exception:
                llm.shutdown()
        elif llm is not None:
            llm.shutdown()
        if self._transfer is not None:
            self._transfer.close()
            self._transfer = None
        reaper, self._reaper = getattr(self, "_reaper", None), None
        if reaper is not None:
            reaper.stdin.close()  # the watcher sees EOF; the engine is already down
            reaper.wait(timeout=30)
        if loop is not None and thread is not None and thread.is_alive():
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)
        self._thread = None
        saved = getattr(self, "_saved_affinity", None)
        if saved:  # the next engine in this process (e.g. a Hydra multirun job) starts clean
            os.sched_setaffinity(0, saved)
            self._saved_affinity = None

    def __enter__(self) -> VLLMEngine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ health
    def check_health(self) -> None:
        """Raise ``EngineError`` if the engine thread or engine core is dead."""
        if self._error is not None:
            raise EngineError(f"engine thread failed: {self._error!r}") from self._error
        if self._thread is None or not self._thread.is_alive():
            raise EngineError("engine is not running (never started, shut down, or its thread died)")
        llm = self._llm
        if llm is not None and getattr(llm, "errored", False):
            raise EngineError(f"vLLM engine core died ({self._death_cause()})")

    def _death_cause(self) -> str:
        """Exit codes of finished engine processes, if vLLM exposes them."""
        try:
            procs = self._llm.engine_core.resources.engine_manager.finished_procs()
        except Exception:
            procs = {}
        if not procs:
            return "cause unknown; see the engine log above"
        codes = ", ".join(f"{name} exit code {code}" for name, code in procs.items())
        return codes + (" (killed by a signal)" if any(c < 0 for c in procs.values()) else "")

    def wait_result(self, fut: cf.Future, timeout: float | None = None) -> Any:
        """``fut.result()`` that checks engine health while waiting."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return fut.result(timeout=self.health_poll_s)
            except cf.TimeoutError:
                self.check_health()
                if deadline is not None and time.monotonic() > deadline:
                    raise EngineError(f"engine call timed out after {timeout} s") from None

    def _call(self, coro: Any) -> cf.Future:
        self.check_health()
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    # ------------------------------------------------------------------ generation
    def submit(
        self,
        prompt_ids: list[int],
        sampling: SamplingConfig,
        seed: int | None = None,
        request_id: str | None = None,
        prompt_logprobs: bool = False,
    ) -> cf.Future:
        """Start one request; the future resolves to a ``Completion``."""
        rid = request_id or f"req-{next(self._ids)}"
        return self._call(self._generate(list(prompt_ids), sampling, seed, rid, prompt_logprobs))

    async def _generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingConfig,
        seed: int | None,
        rid: str,
        prompt_logprobs: bool,
    ) -> Completion:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            n=1,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_tokens=sampling.max_tokens,
            ignore_eos=sampling.ignore_eos,
            seed=seed,
            logprobs=0,  # logprob of the sampled token only
            prompt_logprobs=0 if prompt_logprobs else None,
            output_kind=RequestOutputKind.FINAL_ONLY,
            detokenize=False,
        )
        self._busy_enter()
        start = time.time()
        final = None
        try:
            async for out in self._llm.generate(
                TokensPrompt(prompt_token_ids=prompt_ids), params, request_id=rid
            ):
                final = out
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if getattr(self._llm, "errored", False) or type(e).__name__ == "EngineDeadError":
                raise EngineError(f"vLLM engine core died while serving {rid} ({self._death_cause()})") from e
            raise
        finally:
            self._busy_exit()
        end = time.time()
        if final is None:
            raise EngineError(f"request {rid} returned no output")
        c = final.outputs[0]
        token_ids = list(c.token_ids)
        logprobs = [float(lp[t].logprob) for lp, t in zip(c.logprobs or [], token_ids)]
        spans = [(_as_version(s.version), s.start, s.end) for s in (c.weight_versions or [])]
        comp = Completion(rid, prompt_ids, token_ids, logprobs, c.finish_reason, start, end, spans)
        if prompt_logprobs:
            # Entry 0 is None (the first token has no context); keep one float per prompt token.
            comp.prompt_logprobs = [  # type: ignore[attr-defined]
                None if d is None else float(d[t].logprob) for d, t in zip(final.prompt_logprobs, prompt_ids)
            ]
        with self._lock:
            self.tokens_generated += len(token_ids)
        return comp

    def score(self, sequence: list[int]) -> list[float]:
        """Engine logprob (temperature 1) of each token of ``sequence`` after the first.

        Uses vLLM prompt logprobs, which ignore sampling temperature. Used to verify a
        weight sync against the trainer's ``token_logprobs(..., temperature=1)``.
        """
        sampling = SamplingConfig(temperature=1.0, max_tokens=1)
        comp = self.wait_result(self.submit(sequence, sampling, seed=0, prompt_logprobs=True), 120)
        return [float(x) for x in comp.prompt_logprobs[1:]]  # type: ignore[attr-defined]

    def abort(self, request_id: str) -> None:
        self.wait_result(self._call(self._llm.abort(request_id)), timeout=30)

    # ------------------------------------------------------------------ weights
    def update_weights(
        self, named_tensors: dict[str, torch.Tensor], version: int, inflight: str = "keep"
    ) -> float:
        """Load new policy weights (HF names) and label them ``version``. Returns seconds.

        ``inflight`` says what happens to requests still generating:
        ``keep``: frozen, then continued with the new weights (tokens carry both versions;
        the KV cache is cleared, so later tokens are computed by the new policy alone);
        ``abort``: they finish now with ``finish_reason="abort"`` and their partial tokens
        (the rollout controller resubmits prompt + partial response);
        ``wait``: the update waits until they finish (a generation boundary).

        The tensors travel as a safetensors file in /dev/shm (``weight_transfer="shm"``) or by
        NCCL broadcast from the trainer's GPU (``"nccl"``, see modules/gpu_weight_transfer.py).
        """
        from safetensors.torch import save_file

        check("rollout.inflight", inflight, inflight in ("keep", "abort", "wait"), "one of keep, abort, wait")
        t0 = time.perf_counter()
        # clear_cache=True always: stale KV would make later tokens match neither policy.
        self.wait_result(self._call(self._llm.pause_generation(mode=inflight, clear_cache=True)))
        if self._transfer is not None:  # engine.weight_transfer=nccl: GPU to GPU, no files
            self._transfer.send(
                named_tensors, self._llm, lambda coro, t: self.wait_result(self._call(coro), t)
            )
        else:
            tensors = {k: v.detach().to("cpu").contiguous() for k, v in named_tensors.items()}
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
            with tempfile.NamedTemporaryFile(suffix=".safetensors", dir=_scratch_dir(nbytes)) as f:
                save_file(tensors, f.name)
                self.wait_result(
                    self._call(self._llm.collective_rpc("asyncrl_load_weights", args=(f.name,))), timeout=300
                )
        # Cached prompt KV was computed by the old weights: never reuse it for the new policy.
        self.wait_result(self._call(self._llm.reset_prefix_cache()), timeout=60)
        self.wait_result(self._call(self._llm.update_weight_version(str(version))), timeout=60)
        self.version = version
        self.wait_result(self._call(self._llm.resume_generation()), timeout=60)
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ accounting
    def _busy_enter(self) -> None:
        with self._lock:
            if self._inflight == 0:
                self._busy_since = time.monotonic()
            self._inflight += 1

    def _busy_exit(self) -> None:
        with self._lock:
            self._inflight -= 1
            if self._inflight == 0 and self._busy_since is not None:
                self._busy_total += time.monotonic() - self._busy_since
                self._busy_since = None

    def busy_seconds(self) -> float:
        """Seconds with at least one request in flight, since start."""
        with self._lock:
            extra = 0.0 if self._busy_since is None else time.monotonic() - self._busy_since
            return self._busy_total + extra

    @property
    def inflight(self) -> int:
        return self._inflight


def _scratch_dir(nbytes: int) -> str | None:
    """/dev/shm when it has room (a RAM-backed hand-off), else the default temp dir."""
    import shutil

    if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 2 * nbytes:
        return "/dev/shm"
    return None


def _parse_cores(spec: str) -> set[int]:
    """'1', '0-3', '0,2,4-5' -> set of core ids."""
    cores: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if "-" in part:
            lo, hi = part.split("-")
            cores.update(range(int(lo), int(hi) + 1))
        elif part:
            cores.add(int(part))
    return cores


async def _shutdown_llm(llm: Any) -> None:
    handler = getattr(llm, "output_handler", None)
    if handler is not None:
        handler.cancel()
    llm.shutdown()


def _as_version(v: Any) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0  # vLLM labels the initial weights "default": that is our version 0


def _main() -> None:
    import sys

    from transformers import AutoTokenizer

    path = sys.argv[1]
    tok = AutoTokenizer.from_pretrained(path)
    with VLLMEngine(path) as engine:
        t0 = time.time()
        futs = [
            engine.submit(tok("12%5=")["input_ids"], SamplingConfig(max_tokens=64), seed=i) for i in range(32)
        ]
        outs = [engine.wait_result(f) for f in futs]
        n = sum(len(o.token_ids) for o in outs)
        print(f"{n} tokens in {time.time() - t0:.2f} s; sample: {tok.decode(outs[0].token_ids)!r}")


if __name__ == "__main__":
    _main()
