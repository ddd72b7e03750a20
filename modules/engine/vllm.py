"""The rollout engine: vLLM's AsyncLLM driven by a background thread with its own event loop.

The trainer thread never touches asyncio. It calls plain methods (``submit`` returns a
``concurrent.futures.Future``; ``update_weights`` blocks) and this class forwards them to the
engine thread with ``asyncio.run_coroutine_threadsafe``. vLLM's engine core itself runs in a
child process, on its own cores or GPUs (``modules/engine/placement.py``).

Failure contract: if the engine dies or its loop raises, every pending future fails, and
``check_health`` raises ``EngineError`` naming the cause; callers that wait use
``wait_result`` / ``wait_any`` / ``wait_on``, which poll health, so nothing hangs. At a clean
``shutdown`` the requests still in flight are cancelled and unwind (their futures resolve as
cancelled; ``modules/engine/loop_thread.py``).

Smoke-test an engine on a model directory: ``python -m modules.engine artifacts/tiny-qwen-sft``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import itertools
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modules.config.errors import check, check_choice
from modules.engine import reaper
from modules.engine.busy import BusyClock
from modules.engine.gpus import engine_devices, engine_visible_devices
from modules.engine.loop_thread import CallbackThread, LoopThread
from modules.engine.placement import (
    CorePinning,
    check_executor,
    configure_engine_env,
    executor_args,
    uni_process_pinning,
)
from modules.engine.shm_transfer import make_transfer
from modules.engine.stop import stop_llm
from modules.engine.types import (
    INFLIGHT_MODES,
    Completion,
    EngineError,
    SamplingConfig,
    WeightTransfer,
    as_version,
)
from modules.engine.waits import HealthCheckedWaits

if TYPE_CHECKING:
    import torch

    from modules.engine.shm_transfer import PreparedWeights

# How long the engine core may take to exit after SIGTERM before vLLM force-kills it (vLLM's
# own default, 5 s, is about what a loaded 2-core machine needs: measured 4.6 s idle).


class VLLMEngine(HealthCheckedWaits):
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
        cpu_cores: str | int | None = "1",
        cpu_kvcache_gb: int = 1,
        gpu_ids: list[int] | str | None = None,
        num_gpus: int = 1,
        visible_devices: str | None = None,
        gpu_memory_utilization: float = 0.5,
        enforce_eager: bool = True,
        startup_timeout_s: float = 300.0,
        stall_timeout_s: float = 600.0,
        health_poll_s: float = 0.5,
        pin_trainer: bool = True,
        weight_transfer: str = "shm",
        nccl_host: str = "127.0.0.1",
        chunked_prefill: bool | None = None,
        executor: str | None = None,
    ) -> None:
        check("engine.max_model_len", max_model_len, max_model_len >= 16, "an int >= 16")
        check("engine.max_num_seqs", max_num_seqs, max_num_seqs >= 1, "an int >= 1")
        check(
            "engine.dtype",
            dtype,
            dtype in ("float32", "bfloat16", "float16", "auto"),
            "one of float32, bfloat16, float16, auto",
        )
        for name, value in (("stall_timeout_s", stall_timeout_s), ("startup_timeout_s", startup_timeout_s)):
            check(f"engine.{name}", value, value > 0, "a float > 0 (seconds)")
        ok = gpu_ids in (None, "auto") or (not isinstance(gpu_ids, str) and len(gpu_ids) >= 1)
        check("engine.gpu_ids", gpu_ids, ok, "null, auto or a non-empty list")
        # shm: safetensors files in /dev/shm (any device); nccl: GPU-to-GPU (docs/gpu.md).
        check_choice("engine.weight_transfer", weight_transfer, ("shm", "nccl"))
        check(
            "engine.weight_transfer",
            weight_transfer,
            weight_transfer != "nccl" or gpu_ids is not None,
            "shm when engine.gpu_ids is null (nccl needs the engine on dedicated GPUs)",
        )
        check_executor(executor, gpu_ids)  # null, uni or mp (conf/engine/vllm_cpu.yaml)
        self.executor = executor
        self.model_path = str(model_path)
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.max_num_seqs = self.concurrency = max_num_seqs  # concurrency: the Engine protocol's name
        self.seed, self.cpu_cores, self.cpu_kvcache_gb = seed, cpu_cores, cpu_kvcache_gb
        self.gpu_ids = gpu_ids if gpu_ids in (None, "auto") else [int(i) for i in gpu_ids]
        self.num_gpus = num_gpus  # read by the placement (modules/engine/gpus.py), not here
        self.visible_devices = visible_devices  # the placement's CUDA_VISIBLE_DEVICES for it
        check(
            "engine.gpu_memory_utilization",
            gpu_memory_utilization,
            0 < gpu_memory_utilization <= 1,
            "a float in (0, 1]",
        )
        self.gpu_memory_utilization = gpu_memory_utilization
        self.enforce_eager = enforce_eager
        self.chunked_prefill = chunked_prefill  # None: vLLM's default (see conf/engine/vllm_cpu.yaml)
        self.startup_timeout_s, self.stall_timeout_s = startup_timeout_s, stall_timeout_s
        self.health_poll_s = health_poll_s
        self.pin_trainer = pin_trainer
        self.weight_transfer = weight_transfer
        self.nccl_host = nccl_host  # the NCCL rendezvous: the engine lives in this process's node
        self._transfer: WeightTransfer | None = None  # built in start()
        self.pinning = CorePinning(cpu_cores if pin_trainer and gpu_ids is None else None)  # CPU only
        self._reaper: Any = None
        self._thread: LoopThread | None = None  # runs AsyncLLM's event loop, from start()
        self._callbacks: CallbackThread | None = None  # completion callbacks, off the loop
        self._llm: Any = None
        self._ids = itertools.count()
        self.version = 0
        self._busy = BusyClock()
        self._tokens_lock = threading.Lock()
        self.tokens_generated = 0
        self.started_at: float | None = None

    # ------------------------------------------------------------------ lifecycle
    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> VLLMEngine:
        if self._thread is not None:
            return self
        from modules.config.resources import build_command, is_hub_id

        if not is_hub_id(self.model_path) and not Path(self.model_path, "config.json").exists():
            raise EngineError(
                f"engine.model_path={self.model_path!r} holds no model (no config.json); "
                f"the RL recipes start from a supervised warm start: build this one with {build_command(self.model_path)}"
            )
        if self.gpu_ids == "auto":
            raise EngineError(
                "engine.gpu_ids=auto was not placed: train.py resolves it (modules/engine/gpus.py)"
            )
        configure_engine_env(self.cpu_cores, self.cpu_kvcache_gb, self.gpu_ids)
        if self._transfer is None:
            self._transfer = make_transfer(
                self.weight_transfer, len(self.gpu_ids or ()), self.dtype, self.nccl_host
            )
        children_before = reaper.child_pids()
        # Watching before the build: a trainer killed while the engine starts leaves nothing.
        self._reaper = reaper.launch(children_before)
        self._thread = LoopThread("asyncrl-engine")
        try:
            with engine_visible_devices(engine_devices(self.gpu_ids, self.visible_devices)):
                self._thread.start(self._build, self.startup_timeout_s)
        except BaseException as e:  # failure, timeout, Ctrl-C or SIGTERM during start-up: leave nothing
            self.shutdown(build_wait_s=None if isinstance(e, Exception) else 5.0)
            raise
        self._callbacks = CallbackThread("asyncrl-completions")
        self.started_at = time.time()
        reaper.freeze(self._reaper, reaper.engine_pids(children_before, {self._reaper.pid}))
        self.pinning.apply()
        return self

    async def _build(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        assert self._transfer is not None
        args = AsyncEngineArgs(
            model=self.model_path,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            seed=self.seed,
            enforce_eager=self.enforce_eager,
            # Logprobs of the distribution actually sampled (after temperature / top-p).
            logprobs_mode="processed_logprobs",
            worker_extension_cls="modules.engine.worker_extension.WeightSyncExtension",
            gpu_memory_utilization=self.gpu_memory_utilization,
            tensor_parallel_size=len(self.gpu_ids) if self.gpu_ids else 1,
            disable_log_stats=True,
            **({} if self.chunked_prefill is None else {"enable_chunked_prefill": self.chunked_prefill}),
            **self._transfer.engine_args(),
            **executor_args(self.executor),
        )
        with uni_process_pinning(self.executor, self.cpu_cores if self.gpu_ids is None else None):
            self._llm = AsyncLLM.from_engine_args(args)

    def shutdown(self, build_wait_s: float | None = None) -> None:
        """Stop the engine and its child processes. Safe to call twice. An interrupted start-up
        is given ``build_wait_s`` (default: the start-up timeout) to finish; the reaper kills
        whatever it started after that."""
        thread = self._thread
        if thread is not None:
            thread.wait_built(self.startup_timeout_s if build_wait_s is None else build_wait_s)
        llm, self._llm = self._llm, None
        if llm is not None:
            stop_llm(llm, thread if thread is not None and thread.alive else None, self.executor == "uni")
        if self._transfer is not None:
            self._transfer.close()
            self._transfer = None
        watcher, self._reaper = self._reaper, None
        if watcher is not None:
            watcher.stdin.close()  # the watcher sees EOF; the engine is already down
            watcher.wait(timeout=30)
        if thread is not None:
            thread.stop()
        self._thread = None
        if self._callbacks is not None:
            self._callbacks.stop()
            self._callbacks = None
        self.pinning.release()  # the next engine in this process (a multirun job) starts clean

    # ------------------------------------------------------------------ health
    def check_health(self) -> None:
        """Raise ``EngineError`` if the engine thread or engine core is dead."""
        thread = self._thread
        if thread is not None and thread.error is not None:
            raise EngineError(f"engine thread failed: {thread.error!r}") from thread.error
        if self._callbacks is not None:
            self._callbacks.raise_if_failed()
        if thread is None or not thread.alive:
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

    def on_done(self, fut: cf.Future, fn: Any) -> None:
        assert self._callbacks is not None, "engine not started"
        self._callbacks.on_done(fut, fn)

    def _call(self, coro: Any) -> cf.Future:
        self.check_health()
        assert self._thread is not None
        return self._thread.run(coro)

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
        self, prompt_ids: list[int], sampling: SamplingConfig, seed: int | None, rid: str, logprobs_in: bool
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
            stop_token_ids=list(sampling.stop_token_ids) or None,
            # stop strings are matched on detokenized text (vLLM's output processor); the token
            # that completes one is kept, also when it runs past the string: token in, token out
            stop=list(sampling.stop) or None,
            include_stop_str_in_output=True,
            seed=seed,
            logprobs=0,  # logprob of the sampled token only
            prompt_logprobs=0 if logprobs_in else None,
            output_kind=RequestOutputKind.FINAL_ONLY,
            detokenize=bool(sampling.stop),
        )
        self._busy.enter()
        start = time.time()
        final = None
        try:
            # Rendered as vLLM 0.32 wants (a raw prompt to generate() is deprecated): the same
            # renderer call its deprecated path made, so the same token ids reach the engine.
            prompt = TokensPrompt(prompt_token_ids=prompt_ids)
            (engine_input,) = await self._llm.renderer.render_cmpl_async([prompt])
            async for out in self._llm.generate(engine_input, params, request_id=rid):
                final = out
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if getattr(self._llm, "errored", False) or type(e).__name__ == "EngineDeadError":
                raise EngineError(f"vLLM engine core died while serving {rid} ({self._death_cause()})") from e
            raise
        finally:
            self._busy.exit()
        end = time.time()
        if final is None:
            raise EngineError(f"request {rid} returned no output")
        c = final.outputs[0]
        token_ids = list(c.token_ids)
        logprobs = [float(lp[t].logprob) for lp, t in zip(c.logprobs or [], token_ids)]
        spans = [(as_version(s.version), s.start, s.end) for s in (c.weight_versions or [])]
        comp = Completion(rid, prompt_ids, token_ids, logprobs, c.finish_reason, start, end, spans)
        if logprobs_in:
            # Entry 0 is None (the first token has no context); keep one float per prompt token.
            comp.prompt_logprobs = [
                None if d is None else float(d[t].logprob) for d, t in zip(final.prompt_logprobs, prompt_ids)
            ]
        with self._tokens_lock:
            self.tokens_generated += len(token_ids)
        return comp

    def score(self, sequence: list[int]) -> list[float]:
        """Engine logprob (T = 1, prompt logprobs) of each token of ``sequence`` after the first, to
        verify a weight sync; at most ``max_model_len - 1`` tokens (vLLM generates one)."""
        sequence = list(sequence)[: self.max_model_len - 1]
        sampling = SamplingConfig(temperature=1.0, max_tokens=1)
        comp = self.wait_result(self.submit(sequence, sampling, seed=None, prompt_logprobs=True), 120)
        assert comp.prompt_logprobs is not None
        return [float(x) for x in comp.prompt_logprobs[1:]]

    # ------------------------------------------------------------------ weights
    def update_weights(
        self, named_tensors: dict[str, torch.Tensor], version: int, inflight: str = "keep"
    ) -> float:
        """Load new policy weights (HF names) and label them ``version``. Returns seconds.

        Requests still generating (``inflight``): ``keep``: continued with the new weights (the
        KV cache is cleared; spans record which tokens each version made); ``abort``: finished
        now with their partial tokens (the controller resubmits them); ``wait``: the update
        waits for them. The tensors travel by the engine's ``WeightTransfer`` (shm or NCCL).
        """
        check_choice("rollout.inflight", inflight, INFLIGHT_MODES)
        t0 = time.perf_counter()
        self.pause(inflight)
        self.load(named_tensors, version)
        self.resume()
        return time.perf_counter() - t0

    # The three phases of ``update_weights``, separate so that several replicas can all pause,
    # then all load, then all resume: no replica serves the new version before every one has it.
    def pause(self, inflight: str = "keep") -> None:
        # clear_cache=True always: stale KV would make later tokens match neither policy.
        self.wait_result(self._call(self._llm.pause_generation(mode=inflight, clear_cache=True)))

    def load(self, named_tensors: dict[str, torch.Tensor] | PreparedWeights, version: int) -> None:
        assert self._transfer is not None, "engine not started"
        self._transfer.send(named_tensors, self._llm, lambda coro, t: self.wait_result(self._call(coro), t))
        # Cached prompt KV was computed by the old weights: never reuse it for the new policy.
        self.wait_result(self._call(self._llm.reset_prefix_cache()), timeout=60)
        self.wait_result(self._call(self._llm.update_weight_version(str(version))), timeout=60)
        self.version = version

    def resume(self) -> None:
        self.wait_result(self._call(self._llm.resume_generation()), timeout=60)

    # ------------------------------------------------------------------ accounting
    def stats(self) -> dict[str, float]:
        if self.started_at is None:
            return {}
        wall = max(time.time() - self.started_at, 1e-9)
        return {
            "perf/engine_idle_frac": 1.0 - self._busy.seconds() / wall,
            "perf/tokens_per_s": self.tokens_generated / wall,
        }
