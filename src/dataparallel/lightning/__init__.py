"""The engine under PyTorch Lightning: a `Strategy` for `lightning.pytorch.Trainer`.

    import dataparallel.lightning                       # registers "dataparallel_zero3", ...
    trainer = L.Trainer(strategy=DataParallelStrategy("zero3", precision="bf16-params"))
    trainer = L.Trainer(strategy="dataparallel_zero3")  # the same, by name

A front end beside the job (`dataparallel train`): it uses the public API only (`dp.compose`,
`dp.build_optimizer`, `dp.no_sync`, `dp.clip_grad_norm_`, the state dicts and the sharded
checkpoints). docs/lightning.md maps each Lightning call to what runs.
"""

try:
    import lightning.pytorch  # noqa: F401
except ImportError:  # one line naming the extra, not Lightning's missing module
    raise ImportError(
        'dataparallel.lightning needs Lightning: pip install "dataparallel[lightning]"'
    ) from None

from lightning.pytorch.strategies import StrategyRegistry

from .strategy import DataParallelStrategy

DataParallelStrategy.register_strategies(StrategyRegistry)

__all__ = ["DataParallelStrategy"]
