"""Trainer-level run of ``PolicyGradientModule`` on 2 CPU ranks without the vLLM engine (tests/integration/test_sharding.py).

    python -m tests.sharding_run OUT --strategy fsdp --model DIR [--steps 4] [--resume CKPT]

The same synthetic rollout batches every time (8 samples, 2 minibatches; rank r trains half r),
with ``Recompute`` flags on rank 0's half only, so rank 0 runs pi_old passes that rank 1 does not:
under FSDP that is the data-dependent forward that would hang without ``modules/policy/sharding.py``.
A fake datamodule stands in for the engine: ``sync_weights`` keeps what rank 0 pushed (written to
``OUT/pushed.v<version>.pt``) and ``engine_logprobs`` scores with a plain, unsharded HF model
loaded from it, so ``WeightSync``'s verify compares the sharded trainer with the pushed weights.
Written to OUT: ``losses.json`` (rank 0: the rank-reduced train/loss and the verify diff per
step), ``numel.rank<r>.json`` (elements this rank holds), ``last.ckpt``, ``hf/`` (SaveHFModel).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

import lightning as L
import torch

from data.rollout.batches import minibatches
from data.rollout.experience import Experience

WORLD = 2


def rollout(k: int, n: int = 8) -> list[Experience]:
    """Rollout batch ``k``: 4 groups x 2 samples of random token sequences of unequal lengths."""
    g = random.Random(k)
    exps = []
    for i in range(n):
        response = [g.randrange(3, 40) for _ in range(g.randrange(2, 12))]
        exps.append(
            Experience(
                prompt_id=k * n + i,
                group_id=k * n // 2 + i // 2,
                sample_index=i % 2,
                prompt_ids=[g.randrange(3, 40) for _ in range(g.randrange(2, 6))],
                response_ids=response,
                behavior_logprobs=[-g.uniform(1.0, 4.0) for _ in response],
                reward=float(g.random() < 0.5),
                policy_version=k,
                sampling={},
                gen_start=0.0,
                gen_end=1.0,
                truncated=False,
                advantage=g.uniform(-1.0, 1.0),
                recompute=i < n // 2 and i % 2 == 1,  # rank 0's half only
            )
        )
    return exps


def same(item: Any) -> Any:
    return item


class FakeEngineData(L.LightningDataModule):
    """Rollout batches from ``rollout`` and an engine that is a plain HF model of the pushed weights."""

    def __init__(self, model_dir: str, out: Path, batches: int) -> None:
        super().__init__()
        self.model_dir, self.out, self.batches = model_dir, out, batches
        self.pushed: dict[str, torch.Tensor] = {}

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        rank = self.trainer.global_rank
        out = []
        for k in range(self.batches):
            exps = rollout(k)
            half = len(exps) // WORLD
            shard = exps[rank * half : (rank + 1) * half]
            out.append(minibatches(shard, 2, 1, random.Random(k), 0, {}, True, WORLD))
        return torch.utils.data.DataLoader(out, batch_size=None, collate_fn=same)

    def set_trainer_version(self, version: int) -> None:
        self.version = version

    def sync_weights(self, weights: dict[str, torch.Tensor], version: int) -> float:
        self.pushed = {k: v.detach().cpu().clone() for k, v in weights.items()}
        torch.save(self.pushed, self.out / f"pushed.v{version}.pt")
        return 0.0

    def engine_logprobs(self, seq: list[int]) -> list[float]:
        from transformers import AutoModelForCausalLM

        from modules.policy.hf_policy import token_logprobs

        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).eval()
        missing, unexpected = model.load_state_dict(self.pushed, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        ids = torch.tensor([seq])
        with torch.no_grad():
            lp, _ = token_logprobs(model, ids, torch.ones_like(ids), 1.0)
        return lp[0].tolist()


class Record(L.Callback):
    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: object) -> None:
        m = trainer.callback_metrics
        self.rows.append(
            {
                "step": trainer.global_step,
                "loss": float(m["train/loss"]),
                "version": pl_module.policy_version,
                "verify_diff": pl_module.last_weight_sync_diff,
            }
        )


def held(pl_module: Any, trainer: L.Trainer) -> dict[str, int]:
    """Elements of parameters, gradients and optimizer state this rank holds."""
    from modules.policy.sharding import local_numel

    params = list(pl_module.policy.parameters())
    state = [t for s in trainer.optimizers[0].state.values() for t in s.values() if t.dim() > 0]
    return {
        "params_local": local_numel(params),
        "params_total": sum(p.numel() for p in params),
        "optim_local": local_numel(state),
        "optim_total": sum(t.numel() for t in state),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--strategy", choices=["fsdp", "ddp"], required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--resume", default=None)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    L.seed_everything(0)
    from functools import partial

    from modules.algo.losses import PolicyLoss
    from modules.callbacks.checkpointing import SaveHFModel
    from modules.callbacks.weight_sync import WeightSync
    from modules.policy.policy_gradient import PolicyGradientModule
    from modules.policy.sharding import FSDP2Strategy

    module = PolicyGradientModule(args.model, PolicyLoss(), optimizer=partial(torch.optim.AdamW, lr=1e-2))
    passes = []  # pi_old passes this rank ran (Recompute rows: rank 0 only)
    old_logprobs = module.old_logprobs
    module.old_logprobs = lambda batch: passes.append(1) or old_logprobs(batch)
    record = Record()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=FSDP2Strategy() if args.strategy == "fsdp" else "ddp",
        max_steps=args.steps,
        gradient_clip_val=1.0,
        callbacks=[WeightSync(verify=True), SaveHFModel(str(out / "hf")), record],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        use_distributed_sampler=False,
        default_root_dir=str(out),
    )
    data = FakeEngineData(args.model, out, batches=args.steps)
    trainer.fit(module, datamodule=data, ckpt_path=args.resume)
    trainer.save_checkpoint(out / "last.ckpt")  # every rank: a collective under FSDP
    info = {**held(module, trainer), "old_passes": len(passes)}
    (out / f"numel.rank{trainer.global_rank}.json").write_text(json.dumps(info))
    if trainer.global_rank == 0:
        (out / "losses.json").write_text(json.dumps(record.rows))


if __name__ == "__main__":
    main()
