"""dataparallel: a readable data-parallel training engine for PyTorch.

import dataparallel as dp
world = dp.init()                                   # torchrun's env, or a world of one
model = dp.parallelize(model, strategy="ddp")       # or dp.DDP(bucket_mb=25)
optimizer = dp.build_optimizer(model, torch.optim.AdamW, lr=3e-4)
with dp.no_sync(model):                             # accumulate without communication
    ...
dp.plan("llama-8b", ranks=64, precision="bf16-params")   # memory and step time, before launch
"""

from . import comm, compression
from .activation_checkpointing import checkpoint_activations
from .api import (
    build_optimizer,
    bytes_sent,
    clip_grad_norm_,
    clip_grad_value_,
    finish_param_gather,
    full_state_dict,
    geometry,
    grad_norms,
    handle_of,
    join,
    load_full_state_dict,
    load_local_optimizer_state_dict,
    load_optimizer_state_dict,
    local_optimizer_state_dict,
    memory_report,
    no_sync,
    optimizer_state_dict,
    parallelize,
    rebind,
    refresh_params,
    wire_bytes,
)
from .averaging import DiLoCo, LocalSGD
from .averaging.streaming import OUTER_COMPRESS
from .comm import Tracer
from .compose import Composed, compose
from .data import DistributedSampler
from .ema import EMA
from .plan import plan
from .recipe import PRECISIONS, STRATEGIES, Recipe, RecipeError, check_recipe
from .runtime import World, destroy, free_port, init, init_fake, regroup
from .strategies import (
    DDP,
    Handle,
    Layout,
    LayoutError,
    Mesh,
    MixedPrecision,
    ZeRO1,
    ZeRO2,
    ZeRO3,
    init_mesh,
)
from .sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm

__all__ = [
    "Composed",
    "OUTER_COMPRESS",
    "PRECISIONS",
    "Recipe",
    "RecipeError",
    "STRATEGIES",
    "DDP",
    "Handle",
    "Layout",
    "LayoutError",
    "DiLoCo",
    "EMA",
    "LocalSGD",
    "DistributedSampler",
    "Mesh",
    "MixedPrecision",
    "SyncBatchNorm",
    "Tracer",
    "World",
    "ZeRO1",
    "ZeRO2",
    "ZeRO3",
    "build_optimizer",
    "bytes_sent",
    "check_recipe",
    "checkpoint_activations",
    "wire_bytes",
    "clip_grad_norm_",
    "clip_grad_value_",
    "comm",
    "compose",
    "compression",
    "convert_sync_batchnorm",
    "destroy",
    "finish_param_gather",
    "free_port",
    "full_state_dict",
    "geometry",
    "grad_norms",
    "handle_of",
    "init",
    "init_fake",
    "init_mesh",
    "join",
    "regroup",
    "load_full_state_dict",
    "load_local_optimizer_state_dict",
    "load_optimizer_state_dict",
    "local_optimizer_state_dict",
    "memory_report",
    "no_sync",
    "optimizer_state_dict",
    "parallelize",
    "plan",
    "rebind",
    "refresh_params",
]
