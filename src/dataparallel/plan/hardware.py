"""Hardware profiles: what one rank computes per second and what its links move.

A profile is plain numbers, so the planner runs anywhere: the built-in ones (profiles.py)
state where each number comes from; `dataparallel plan --calibrate` measures this machine's
and writes one as JSON (calibrate.py). [Note: collective cost] in collectives.py says how the
link numbers become times.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from .errors import PlanError

KINDS = ("all_reduce", "reduce_scatter", "all_gather")


@dataclass(frozen=True, kw_only=True)
class Link:
    """One kind of connection, as the alpha-beta model sees it.

    bandwidth: bytes per second one rank moves through it, as the ring algorithm's bus
        bandwidth (NCCL-tests' "busbw"): what is achieved, not the nominal line rate. Inside a
        node this is per rank; between nodes it is per node (all of its NICs together).
    latency: seconds one message step costs regardless of its size (alpha).
    """

    bandwidth: float
    latency: float


@dataclass(frozen=True, kw_only=True)
class HardwareProfile:
    """One kind of machine and its network, per rank ([Note: collective cost]).

    name: what the profile describes.
    flops_per_s: sustained model FLOP/s of one rank in the profile's compute dtype (measured
        forward+backward FLOPs over time; the "model FLOPs utilisation" is already in it).
    compute_rates: measured FLOP/s per built-in model name, used instead of `flops_per_s` when
        that model is planned (small models reach a different rate than big ones).
    optimizer_params_per_s: parameters one rank's optimizer updates per second (Adam reads
        and writes ~28 bytes per parameter, so this is a memory-bandwidth number).
    memory_bytes: memory one rank may fill (GPU memory; on a CPU what the rank may take).
    ranks_per_node: ranks sharing one node (and its intra-node links).
    intra_node: a link between two ranks of one node, per collective kind (all_reduce,
        reduce_scatter, all_gather; gloo's differ, NCCL's are alike).
    inter_node: the link between nodes, bandwidth per node.
    overlap: fraction of a collective that can hide behind computation that runs at the same
        time (1: a separate engine does it, as NCCL on GPUs; 0: it takes the same cores, as
        gloo on a CPU whose every core computes).
    backend: "gloo" or "nccl": on gloo our sharded collectives are pairwise and hold receive
        buffers (docs/zero.md), which count in memory.
    sources: where each number comes from (measured, a datasheet, a published benchmark).
    """

    name: str
    flops_per_s: float
    optimizer_params_per_s: float
    memory_bytes: float
    ranks_per_node: int
    intra_node: dict[str, Link]
    inter_node: Link
    overlap: float
    backend: str = "nccl"
    compute_rates: dict[str, float] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)

    def rate_for(self, model_name: str | None) -> float:
        return self.compute_rates.get(model_name or "", self.flops_per_s)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)


POSITIVE = ("flops_per_s", "optimizer_params_per_s", "memory_bytes", "ranks_per_node")


def _positive(where: str, value, fix: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise PlanError(where, f"must be a positive number, got {value!r}", fix)
    if not math.isfinite(value):
        raise PlanError(where, f"must be finite, got {value!r}", fix)
    return value


def _link(where: str, raw, fix: str) -> Link:
    if not isinstance(raw, dict):
        raise PlanError(where, f"must be an object with bandwidth and latency, got {raw!r}", fix)
    for name in ("bandwidth", "latency"):
        if name not in raw:
            raise PlanError(f"{where}.{name}", "is missing", fix)
    return Link(
        bandwidth=_positive(f"{where}.bandwidth", raw["bandwidth"], fix),
        latency=_positive(f"{where}.latency", raw["latency"], fix),
    )


def profile_from_dict(raw: dict, origin: str = "profile") -> HardwareProfile:
    """A checked profile from its JSON form; a missing or non-positive field is one PlanError
    naming it."""
    fix = f"give it in {origin} (see docs/plan.md, hardware profiles)"
    known = {f.name for f in fields(HardwareProfile)}
    for name in known - {"compute_rates", "sources", "backend"}:
        if name not in raw:
            raise PlanError(f"hardware.{name}", "is missing", fix)
    unknown = set(raw) - known
    if unknown:
        raise PlanError(f"hardware.{sorted(unknown)[0]}", "is not a profile field", fix)
    for name in POSITIVE:
        _positive(f"hardware.{name}", raw[name], fix)
    overlap = raw["overlap"]
    if isinstance(overlap, bool) or not isinstance(overlap, (int, float)) or not 0 <= overlap <= 1:
        raise PlanError("hardware.overlap", f"must be in [0, 1], got {overlap!r}", fix)
    if raw.get("backend", "nccl") not in ("gloo", "nccl"):
        raise PlanError("hardware.backend", f"must be gloo or nccl, got {raw['backend']!r}", fix)
    intra = raw["intra_node"]
    if not isinstance(intra, dict):
        raise PlanError("hardware.intra_node", "must map collective kinds to links", fix)
    for kind in KINDS:
        if kind not in intra:
            raise PlanError(f"hardware.intra_node.{kind}", "is missing", fix)
    rates = raw.get("compute_rates", {})
    for name, rate in rates.items():
        _positive(f"hardware.compute_rates.{name}", rate, fix)
    return HardwareProfile(
        name=str(raw["name"]),
        flops_per_s=float(raw["flops_per_s"]),
        optimizer_params_per_s=float(raw["optimizer_params_per_s"]),
        memory_bytes=float(raw["memory_bytes"]),
        ranks_per_node=int(raw["ranks_per_node"]),
        intra_node={k: _link(f"hardware.intra_node.{k}", intra[k], fix) for k in KINDS},
        inter_node=_link("hardware.inter_node", raw["inter_node"], fix),
        overlap=float(overlap),
        backend=raw.get("backend", "nccl"),
        compute_rates={k: float(v) for k, v in rates.items()},
        sources=dict(raw.get("sources", {})),
    )


def load_profile(path: str | Path) -> HardwareProfile:
    """A profile from a JSON file (as `plan --calibrate` writes them)."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise PlanError(
            "--hardware", f"{path} does not exist", "give a built-in profile name or a JSON file"
        ) from None
    except json.JSONDecodeError as error:
        raise PlanError("--hardware", f"{path} is not JSON ({error.msg})", "fix the file") from None
    if not isinstance(raw, dict):
        raise PlanError("--hardware", f"{path} holds no JSON object", "give a profile file")
    return profile_from_dict(raw, origin=str(path))
