"""``lab.scaling``'s report: the weight-sync cost table per model and replica count, and the
three-panel plot (measured shm sync, push vs broadcast, the simulator's samples/s).

Imported by ``lab.scaling`` (run that: ``python -m lab.scaling --plot PATH``), which draws its
result dict with ``plot``.
"""

from __future__ import annotations

from pathlib import Path

from lab.scaling_costs import GB, MODELS, Gpu, default_tp, sync_cost

# --- report --------------------------------------------------------------------------------


def sync_table(gpu: Gpu, replicas=(1, 2, 4, 8, 16, 32, 64), fixed_s: float = 0.5) -> list[dict]:
    rows = []
    for key, model in MODELS.items():
        tp = default_tp(model, gpu)
        for r in replicas:
            row = {"model": key, "bytes": model.weight_bytes(), "replicas": r, "tp": tp}
            for how in ("tree", "push"):
                for link in ("nvlink", "ib"):
                    row[f"{how}_{link}_s"] = sync_cost(model, r, tp, gpu, how, link, fixed_s)
            rows.append(row)
    return rows


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    ax = axes[0]
    shm = result.get("shm")
    if shm:
        xs = [p["bytes"] / 2**20 for p in shm["points"]]
        ax.scatter(xs, [p["seconds"] for p in shm["points"]], label="measured (fastest of 5)")
        top = max(xs)
        ax.plot(
            [0, top],
            [shm["fixed_s"], shm["fixed_s"] + top * 2**20 / shm["bandwidth_bytes_per_s"]],
            "k--",
            label=f"fit: {shm['fixed_s'] * 1e3:.0f} ms + bytes / {shm['bandwidth_bytes_per_s'] / GB:.2f} GB/s",
        )
        ax.legend(fontsize=8)
    ax.set(xlabel="state dict (MiB, bf16)", ylabel="s", title="shm weight sync on this CPU (measured)")
    ax = axes[1]
    for key, style in (("7b", "-"), ("70b", ":")):
        rows = [r for r in result["sync_model"] if r["model"] == key]
        rs = [r["replicas"] for r in rows]
        for col, label in (("push_ib_s", "push, IB"), ("tree_ib_s", "broadcast, IB")):
            ax.plot(rs, [r[col] for r in rows], style, marker="o", ms=3, label=f"{key} {label}")
        local = [r for r in rows if r["replicas"] * r["tp"] < result["gpu"]["gpus_per_node"]]
        if local:
            ax.plot(
                [r["replicas"] for r in local],
                [r["tree_nvlink_s"] for r in local],
                style,
                marker="o",
                ms=3,
                label=f"{key} broadcast, NVLink (one node)",
            )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="engine replicas R",
        ylabel="s per sync",
        title="weight sync: push vs broadcast (assumed links)",
    )
    ax.legend(fontsize=7)
    ax = axes[2]
    groups = [
        (sim, row["mode"]) for sim in result["simulated"] for row in sim["rows"] if row["sync"] == "tree"
    ]
    for j, how in enumerate(("tree", "push")):
        for i, (sim, mode) in enumerate(groups):
            row = next((r for r in sim["rows"] if r["sync"] == how and r["mode"] == mode), None)
            if row is None:
                continue
            x = i + (j - 0.5) * 0.4
            ax.bar(
                x,
                row["samples_per_s"],
                width=0.4,
                color="C0" if how == "tree" else "C3",
                label=("broadcast sync" if how == "tree" else "per-replica push") if i == 0 else None,
            )
            ax.text(
                x, row["samples_per_s"], f"{row['staleness_mean']:.1f}", ha="center", va="bottom", fontsize=6
            )
    labels = [f"{sim['layout']['gpus']} GPUs\n{mode.replace('streaming ', 'str. ')}" for sim, mode in groups]
    ax.set_xticks(range(len(groups)), labels, fontsize=6)
    ax.set(ylabel="samples/s (predicted)", title=f"simulator, {result['sim_model']}; label: mean staleness")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
