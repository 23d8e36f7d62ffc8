"""Which modules become ZeRO-3 units, and which unit owns each parameter (no process group).

A unit is a module whose parameters are gathered together before its forward and freed after
it. The model itself is always the root unit: it owns every parameter that no wrapped module
owns (for our GPT: the embeddings, the final norm and the tied head).

[Note: tied parameters] A parameter reached from two units (GPT's head shares the token
embedding's weight) must be gathered whenever either of them runs. It is owned by the two
units' nearest common ancestor unit, whose gathered lifetime encloses both: an ancestor's
forward runs around its descendants' forwards, and its backward is gathered from its output's
gradient until its own post-backward, after theirs. The root, gathered for the whole step, is
the ancestor of last resort, so a shared parameter is never refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from .parts.footprint import ParamShapes

Wrap = Callable[[nn.Module], bool] | tuple[type, ...] | None


@dataclass(frozen=True)
class UnitPlan:
    """One unit of the plan.

    name: the module's qualified name in the model ("" for the root, "blocks.0", ...).
    module: the module whose forward gathers and frees the unit.
    params: the parameters this unit owns, in registration order.
    parent: index of the nearest enclosing unit in the plan (None for the root).
    """

    name: str
    module: nn.Module
    params: tuple[nn.Parameter, ...]
    parent: int | None


def select_units(model: nn.Module, wrap: Wrap) -> list[nn.Module]:
    """The modules `wrap` selects (root excluded), in `model.modules()` order.

    None selects every child of an nn.ModuleList: for our GPT, each transformer `Block`.
    """
    if wrap is None:
        lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
        chosen = {id(c) for lst in lists for c in lst.children()}
        selected = [m for m in model.modules() if id(m) in chosen]
    elif isinstance(wrap, tuple):
        selected = [m for m in model.modules() if m is not model and isinstance(m, wrap)]
    else:
        selected = [m for m in model.modules() if m is not model and wrap(m)]
    for module in selected:
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            raise ValueError(
                f"ZeRO3: wrap selected a {type(module).__name__}, which has no forward to gather "
                "around; select the modules inside it instead"
            )
    return selected


def plan_units(model: nn.Module, wrap: Wrap) -> list[UnitPlan]:
    """Units of `model` (the root first, then in module order) and the parameters each owns.

    Units that end up owning no parameter are left out (the root always stays).
    """
    selected = {id(m) for m in select_units(model, wrap)}
    names: list[str] = [""]
    modules: list[nn.Module] = [model]
    parents: list[int | None] = [None]
    unit_of: dict[int, int] = {id(model): 0}
    reached: dict[int, list[int]] = {}  # id(param) -> units it is used from
    params: dict[int, nn.Parameter] = {}

    def walk(module: nn.Module, prefix: str, unit: int) -> None:
        for p in module._parameters.values():
            if p is not None:
                params.setdefault(id(p), p)
                reached.setdefault(id(p), []).append(unit)
        for child_name, child in module._modules.items():
            if child is None:
                continue
            path = f"{prefix}{child_name}"
            if id(child) not in selected:
                walk(child, path + ".", unit)
                continue
            if id(child) in unit_of:
                if parents[unit_of[id(child)]] != unit:
                    raise ValueError(
                        f"ZeRO3: module '{path}' is a unit reached from two different units; "
                        "wrap a module that encloses both places instead"
                    )
                continue
            unit_of[id(child)] = len(modules)
            names.append(path)
            modules.append(child)
            parents.append(unit)
            walk(child, path + ".", unit_of[id(child)])

    walk(model, "", 0)
    owned: list[list[nn.Parameter]] = [[] for _ in modules]
    for key, units in reached.items():
        owned[common_ancestor(units, parents)].append(params[key])
    keep = [i for i in range(len(modules)) if i == 0 or owned[i]]
    new_index = {old: new for new, old in enumerate(keep)}

    def kept_parent(i: int) -> int | None:
        parent = parents[i]
        while parent is not None and parent not in new_index:
            parent = parents[parent]
        return None if parent is None else new_index[parent]

    plans = [UnitPlan(names[i], modules[i], tuple(owned[i]), kept_parent(i)) for i in keep]
    return split_frozen(plans)


def split_frozen(plans: list[UnitPlan]) -> list[UnitPlan]:
    """[Note: frozen parameters] A unit (other than the root) whose parameters are partly
    frozen becomes two units of the same module: the frozen parameters, then the trainable
    ones. Each is gathered and freed with the module as before, but only the trainable one has
    a gradient bucket, a reduction and a gradient shard, so frozen weights (a LoRA base) cost no
    gradient memory or traffic. The root stays whole (the schedule treats unit 0 as the root)."""
    out: list[UnitPlan] = []
    index: dict[int, int] = {}
    for i, plan in enumerate(plans):
        frozen = tuple(p for p in plan.params if not p.requires_grad)
        trainable = tuple(p for p in plan.params if p.requires_grad)
        parent = None if plan.parent is None else index[plan.parent]
        if i > 0 and frozen and trainable:
            out.append(UnitPlan(f"{plan.name}[frozen]", plan.module, frozen, parent))
            plan = UnitPlan(plan.name, plan.module, trainable, parent)
        else:
            plan = UnitPlan(plan.name, plan.module, plan.params, parent)
        index[i] = len(out)
        out.append(plan)
    return out


def common_ancestor(units: list[int], parents: list[int | None]) -> int:
    """The deepest unit that is `units[k]` or encloses it, for every k ([Note: tied parameters])."""

    def chain(unit: int) -> list[int]:
        path = [unit]
        while parents[path[-1]] is not None:
            path.append(parents[path[-1]])
        return path

    common = chain(units[0])
    for unit in units[1:]:
        ancestors = set(chain(unit))
        common = [u for u in common if u in ancestors]
    return common[0]


def param_shapes(model: nn.Module, wrap: Wrap = None) -> ParamShapes:
    """What a footprint needs of `model` ([Note: footprint] in parts/footprint.py): its
    trainable parameters' numels, and ZeRO-3's units as `plan_units` makes them for `wrap`."""
    units = tuple(
        tuple(p.numel() for p in unit.params if p.requires_grad) for unit in plan_units(model, wrap)
    )
    numels = tuple(p.numel() for p in model.parameters() if p.requires_grad)
    return ParamShapes(numels, units)
