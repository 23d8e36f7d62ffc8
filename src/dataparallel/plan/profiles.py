"""Built-in hardware profiles, each number with its source.

`cpu-2core` was measured on the machine this project is developed on by `dataparallel plan
--calibrate` (benchmarks/plan_validate.py refreshes it, docs/plan.md shows the run). The GPU
ones are from vendor datasheets and published measurements quoted from memory (no lookup was
possible when they were written): each source says so, and docs/plan.md lists them.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import PlanError
from .hardware import HardwareProfile, Link, load_profile, profile_from_dict

HERE = Path(__file__).parent

# H100 SXM: dense BF16 989 TFLOP/s (NVIDIA H100 datasheet); we assume 40% of it is reached
# as model FLOPs (MFU), the middle of what Megatron-LM and torchtitan report for bf16
# transformer training (38-55%).
H100_FLOPS = 0.40 * 989e12
# Adam touches ~30 bytes per parameter (fp32 master, m, v read and written, the gradient read,
# the bf16 parameter written); HBM3 3.35 TB/s (datasheet) at ~70% achieved.
H100_OPTIMIZER = 0.7 * 3.35e12 / 30
NVLINK = Link(bandwidth=360e9, latency=1e-5)


def _gpu_profile(
    name: str,
    inter: Link,
    inter_source: str,
    memory: float = 80e9,
    memory_source: str = "H100 SXM 80 GB HBM3 (datasheet)",
) -> HardwareProfile:
    return HardwareProfile(
        name=name,
        flops_per_s=H100_FLOPS,
        optimizer_params_per_s=H100_OPTIMIZER,
        memory_bytes=memory,
        ranks_per_node=8,
        intra_node={k: NVLINK for k in ("all_reduce", "reduce_scatter", "all_gather")},
        inter_node=inter,
        overlap=0.9,
        backend="nccl",
        sources={
            "flops_per_s": "40% MFU (assumed) of H100 SXM dense BF16 989 TFLOP/s (datasheet; "
            "from memory)",
            "optimizer_params_per_s": "HBM3 3.35 TB/s (datasheet) x 0.7, ~30 B per parameter "
            "for Adam with fp32 masters",
            "memory_bytes": memory_source,
            "intra_node": "NVLink 4: 900 GB/s bidirectional per GPU (450 GB/s each way); "
            "NCCL ring bus bandwidth ~360 GB/s on 8 GPUs (nccl-tests figures, from memory); "
            "10 us latency",
            "inter_node": inter_source,
            "overlap": "NCCL runs on its own CUDA stream; 0.9 allows for the SMs it takes "
            "(assumed)",
        },
    )


BUILTIN = {
    "h100-node": _gpu_profile(
        "8x H100 SXM per node, NVLink 4 inside, 8x 400 Gbit/s InfiniBand NDR per node",
        Link(bandwidth=8 * 45e9, latency=2e-5),
        "8 ConnectX-7 NICs x 400 Gbit/s (50 GB/s) per node, ~45 GB/s achieved each "
        "(nccl-tests on NDR, from memory); 20 us latency",
    ),
    # One H200 alone (issue 40's 8B on one GPU): the H100's compute (989 TFLOP/s dense BF16,
    # torchtitan's `get_peak_flops` gives both the same) with 141 GB of HBM3e; its faster
    # memory (4.8 TB/s) is left out of the optimizer's rate, as the H100's is kept.
    "h200": _gpu_profile(
        "one H200 SXM (141 GB), no peers",
        Link(bandwidth=8 * 45e9, latency=2e-5),
        "as h100-node (a world of one sends nothing)",
        memory=141e9,
        memory_source="H200 SXM 141 GB HBM3e (datasheet, from memory); the device tool reports "
        "about 139 GiB (149 GB) usable",
    ),
    "ethernet-100g": _gpu_profile(
        "8x H100 per node, NVLink inside, one 100 Gbit/s Ethernet NIC per node",
        Link(bandwidth=10e9, latency=5e-5),
        "one 100 Gbit/s NIC (12.5 GB/s) per node, ~80% achieved over TCP/RoCE (assumed); "
        "50 us latency",
    ),
    "ethernet-10g": _gpu_profile(
        "8x H100 per node, NVLink inside, one 10 Gbit/s Ethernet NIC per node",
        Link(bandwidth=1e9, latency=1e-4),
        "one 10 Gbit/s NIC (1.25 GB/s) per node, ~80% achieved over TCP (assumed); 100 us latency",
    ),
}


def builtin_names() -> list[str]:
    return sorted([*BUILTIN, *(p.stem for p in HERE.glob("*.json"))])


def get_profile(spec) -> HardwareProfile:
    """A profile: a HardwareProfile, a dict, a built-in name, or a JSON file's path."""
    if isinstance(spec, HardwareProfile):
        return spec
    if isinstance(spec, dict):
        return profile_from_dict(spec)
    if spec in BUILTIN:
        return BUILTIN[spec]
    if (HERE / f"{spec}.json").is_file():
        return profile_from_dict(json.loads((HERE / f"{spec}.json").read_text()), f"{spec}.json")
    if str(spec).endswith(".json") or Path(str(spec)).exists():
        return load_profile(spec)
    raise PlanError(
        "--hardware",
        f"unknown profile {spec!r}",
        f"choose one of {', '.join(builtin_names())} or give a JSON file",
    )
