"""The one measured part of ``lab.scaling``: the shm weight-sync path's cost on this machine
(safetensors write to /dev/shm + read + copy into the model's tensors, no engine), fitted to
fixed + bytes / bandwidth.

Imported by ``lab.scaling`` (run that: ``python -m lab.scaling``; ``--no-measure`` skips this).
"""

from __future__ import annotations

import statistics
import tempfile
import time


def measure_shm(sizes_mib=(32, 128, 256), tensor_kib=(256, 8192), repeats=3) -> dict:
    """Time the shm weight-sync path without an engine: the sender's safetensors write to
    /dev/shm (``SharedMemoryWeightTransfer.send``) + the receiver's read (``load_file``, as
    ``asyncrl_load_weights``) + the copy into the model's own tensors, for bf16 state dicts of
    ``sizes_mib`` in tensors of ``tensor_kib``; fastest of ``repeats`` (a shared machine).
    Fits seconds = fixed + bytes / bandwidth (least squares), and with a per-tensor term."""
    import numpy as np
    import torch
    from safetensors.torch import load_file, save_file

    from modules.engine.shm_transfer import scratch_dir

    points = []
    for total in sizes_mib:
        for tk in tensor_kib:
            n = max(1, total * 1024 // tk)
            numel = tk * 1024 // 2
            src = {f"layers.{i}.weight": torch.randn(numel, dtype=torch.bfloat16) for i in range(n)}
            dst = {k: torch.empty_like(v) for k, v in src.items()}
            nbytes = n * numel * 2
            times = []
            for _ in range(repeats):
                with tempfile.NamedTemporaryFile(suffix=".safetensors", dir=scratch_dir(nbytes)) as f:
                    t0 = time.perf_counter()
                    save_file(src, f.name)
                    state = load_file(f.name)
                    for k, v in state.items():
                        dst[k].copy_(v)
                    times.append(time.perf_counter() - t0)
                del state
            points.append(
                {"bytes": nbytes, "tensors": n, "seconds": min(times), "median_s": statistics.median(times)}
            )
            del src, dst
    y = np.array([p["seconds"] for p in points])

    def fit(cols: list[str]) -> tuple[np.ndarray, float]:
        x = np.array([[1.0, *(p[c] for c in cols)] for p in points])
        coef, *_ = np.linalg.lstsq(x, y, rcond=None)
        ss = float(((y - y.mean()) ** 2).sum())
        return coef, 1 - float(((y - x @ coef) ** 2).sum()) / ss if ss else 1.0

    (fixed, per_byte), r2 = fit(["bytes"])
    (fixed3, per_byte3, per_tensor), r2_3 = fit(["bytes", "tensors"])
    return {
        "points": points,
        "fixed_s": float(fixed),
        "bandwidth_bytes_per_s": float(1 / per_byte) if per_byte > 0 else float("inf"),
        "r2": r2,
        "with_tensors": {
            "fixed_s": float(fixed3),
            "bandwidth_bytes_per_s": float(1 / per_byte3) if per_byte3 > 0 else float("inf"),
            "per_tensor_s": float(per_tensor),
            "r2": r2_3,
        },
        "scratch": scratch_dir(1) or tempfile.gettempdir(),
    }
