"""A user's Lightning script on our strategy: `python lightning_fit.py OUT STRATEGY DEVICES`.

Run as it is (Lightning's own launcher starts the other processes), under `dataparallel
launch` or torchrun (the processes are made outside: Lightning's cluster environment reads
them). Writes OUT/final.ckpt (weights_only) and, on rank 0, OUT/result.json (the world as
the strategy saw it, the first and last loss)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch.nn import functional as F

from dataparallel.lightning import DataParallelStrategy
from dataparallel.models import GPT, GPTConfig

VOCAB, T = 64, 8


class LitGPT(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT(GPTConfig(vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=32, block_size=T))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.model(x).reshape(-1, VOCAB), y.reshape(-1))
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main(out: Path, strategy: str, devices: int) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (64, T + 1), generator=g)
    data = torch.utils.data.TensorDataset(x[:, :-1], x[:, 1:])
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    module = LitGPT()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=DataParallelStrategy(strategy),
        max_epochs=2,
        gradient_clip_val=1.0,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader)
    trainer.save_checkpoint(out / "final.ckpt", weights_only=True)
    if trainer.is_global_zero:
        world = {"world_size": trainer.world_size, "ranks": trainer.strategy.world_size}
        losses = {"first": module.losses[0], "last": module.losses[-1]}
        (out / "result.json").write_text(json.dumps({**world, **losses}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
