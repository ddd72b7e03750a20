"""Peak resident memory of a training run, the trainer and the engine apart: runs the command,
samples its process tree every ``--every`` seconds, prints one JSON line.

    python -m tools.peak_memory -- .venv/bin/python train.py recipe=smollm2_grpo trainer.max_steps=4

``trainer_peak_mb``: the peak RSS of the command's own process (train.py: the LightningModule,
the optimizer, the data path); ``engine_peak_mb``: the peak of the summed RSS of every other
descendant (vLLM's engine core and its worker; reward workers if any), shared pages counted in
each. Sampling misses peaks shorter than the period; the exact high-water mark of the largest
single process of the tree (``ru_maxrss`` of the reaped descendants: the trainer, unless an
engine process was larger) is reported beside it as ``largest_process_maxrss_mb``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import psutil


def sample(root: psutil.Process) -> tuple[float, float]:
    """(RSS of ``root``, summed RSS of its descendants), MiB; 0 for processes gone meanwhile."""
    try:
        own = root.memory_info().rss
        children = root.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0.0, 0.0
    rest = 0
    for child in children:
        try:
            rest += child.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return own / 2**20, rest / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every", type=float, default=1.0, help="seconds between samples")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    t0 = time.time()
    proc = subprocess.Popen(command)
    root = psutil.Process(proc.pid)
    trainer = engine = 0.0
    while proc.poll() is None:
        own, rest = sample(root)
        trainer, engine = max(trainer, own), max(engine, rest)
        time.sleep(args.every)
    import resource

    maxrss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(
        json.dumps(
            {
                "command": " ".join(command),
                "returncode": proc.returncode,
                "wall_s": round(time.time() - t0, 1),
                "trainer_peak_mb": round(trainer),
                "engine_peak_mb": round(engine),
                "largest_process_maxrss_mb": round(maxrss),
            }
        )
    )
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
