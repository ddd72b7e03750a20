"""GPU smoke test: the first thing to run on a GPU node, and the report to send back.

    make install GPU=1 && make gpu-smoke          # python -m tools.gpu_smoke
    python -m tools.gpu_smoke --trainer-gpus 2 --engine-gpus 1 --steps 3

Nothing in this project has run on a GPU (CI has none). This script checks, in order, and
stops at the first failure with what went wrong:

1. the machine: CUDA visible to torch, the CUDA build of vLLM importable, enough GPUs for
   ``--trainer-gpus + --engine-gpus``;
2. the warm start (``artifacts/tiny-qwen-sft``; built with ``make sft`` when missing);
3. each mode (``sync_grpo``, ``partial_grpo``, ``async_grpo``) for ``--steps`` optimizer steps with
   ``trainer=gpu engine=vllm_gpu``, the NCCL weight transfer and the per-sync verify on:
   the run must exit 0, train every step, and after every sync the engine's logprobs of a
   trained sequence must match the trainer's within the verify tolerance
   (``perf/weight_sync_max_abs_diff``).

It writes ``outputs/gpu_smoke/report.txt`` (and ``report.json``): the versions, GPUs, each
run's outcome, sync times, verify gaps and samples/s, and on a failure the last lines of the
run's log. Send that file back. Exit code: 0 all passed, 1 a run failed, 2 the machine is not
a GPU node with the CUDA build of vLLM.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ("sync_grpo", "partial_grpo", "async_grpo")


def machine(out: Path) -> dict:
    """What the node has; raises SystemExit(2) naming what is missing (report in ``out``)."""
    import torch

    info: dict = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available()}
    if not torch.cuda.is_available():
        raise SystemExit(_fail(2, "no CUDA GPU visible to torch: run this on a GPU node", info, out))
    info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    try:
        import vllm

        info["vllm"] = vllm.__version__
    except Exception as e:  # noqa: BLE001 (any import failure is the answer)
        raise SystemExit(_fail(2, f"vLLM does not import ({e!r}): make install GPU=1", info, out)) from None
    return info


def command(recipe: str, steps: int, trainer_gpus: int, engine_gpus: int, run_dir: Path) -> list[str]:
    """One short GPU run of ``recipe`` with the sync verified."""
    return [
        sys.executable,
        "train.py",
        f"recipe={recipe}",
        "trainer=gpu",
        "engine=vllm_gpu",
        f"trainer.devices={trainer_gpus}",
        f"engine.num_gpus={engine_gpus}",
        f"trainer.max_steps={steps}",
        "callbacks.weight_sync.verify=true",
        "callbacks.eval.every_n_versions=0",
        f"hydra.run.dir={run_dir}",
    ]


def outcome(run_dir: Path, returncode: int, steps: int, log: str) -> dict:
    """A run's figures from its metrics.csv, and whether it passed."""
    rows = []
    path = run_dir / "metrics.csv"
    if path.exists():
        with open(path) as f:
            rows = [r for r in csv.DictReader(f) if r.get("train/loss")]

    def col(key: str) -> list[float]:
        return [float(r[key]) for r in rows if r.get(key)]

    diffs = col("perf/weight_sync_max_abs_diff")
    out = {
        "returncode": returncode,
        "steps_trained": len(rows),
        "weight_sync_s": col("perf/weight_sync_s"),
        "verify_max_abs_diff": max(diffs) if diffs else None,
        "samples_per_s": (col("perf/samples_per_s") or [None])[-1],
    }
    out["passed"] = returncode == 0 and len(rows) >= steps and bool(diffs)
    if not out["passed"]:
        out["log_tail"] = log[-6000:]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainer-gpus", type=int, default=1)
    parser.add_argument("--engine-gpus", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "gpu_smoke")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"machine": machine(args.out), "runs": {}}
    need = args.trainer_gpus + args.engine_gpus
    if len(report["machine"]["gpus"]) < need:
        raise SystemExit(
            _fail(2, f"{need} GPUs needed, {len(report['machine']['gpus'])} visible", report, args.out)
        )
    if not (ROOT / "artifacts" / "tiny-qwen-sft" / "config.json").exists():
        subprocess.run([sys.executable, "train.py", "recipe=sft_warmup"], cwd=ROOT, check=True)
    for recipe in RECIPES:
        run_dir = args.out / recipe
        cmd = command(recipe, args.steps, args.trainer_gpus, args.engine_gpus, run_dir)
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        report["runs"][recipe] = {
            "command": " ".join(cmd[1:]),
            **outcome(run_dir, proc.returncode, args.steps, proc.stdout + proc.stderr),
        }
        print(recipe, "passed" if report["runs"][recipe]["passed"] else "FAILED", flush=True)
    ok = all(r["passed"] for r in report["runs"].values())
    _write(report, args.out, "all passed" if ok else "a run failed")
    raise SystemExit(0 if ok else 1)


def _write(report: dict, out: Path, verdict: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    lines = [f"asyncrl GPU smoke: {verdict}", json.dumps(report["machine"])]
    for name, r in report.get("runs", {}).items():
        lines.append(
            f"{name}: {'passed' if r['passed'] else 'FAILED'} {json.dumps({k: v for k, v in r.items() if k != 'log_tail'})}"
        )
        if "log_tail" in r:
            lines += ["--- log tail ---", r["log_tail"], "---"]
    (out / "report.txt").write_text("\n".join(lines) + "\n")
    print(f"{verdict}; send back {out / 'report.txt'}")


def _fail(code: int, why: str, info: dict, out: Path) -> int:
    print(f"gpu smoke: {why}", file=sys.stderr)
    _write({"machine": info, "error": why}, out, f"stopped: {why}")
    return code


if __name__ == "__main__":
    main()
