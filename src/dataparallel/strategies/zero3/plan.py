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

[Note: grouped units] A unit may be several consecutive modules: siblings in one nn.ModuleList
that `wrap` selected, merged in order (`group_consecutive`) until the unit owns at least
`min_unit_params` parameters (ZeRO3's field). One unit costs its collectives and hooks whatever
its size (about 0.65 ms a unit per step on gpt-deep-narrow's 50k-parameter blocks, BENCHMARKS.md),
so small blocks gain from sharing them, at the cost of a larger gathered unit (about the
threshold). The unit is gathered before its first module's forward, freed after its last
module's forward, gathered again before its last module's backward and reduced after its first
module's backward, as FSDP2's `fully_shard([m1, m2])`; every module of it must run once, in
order, in each forward of the unit (group.py: one error otherwise). Ownership is decided
on the grouped units, so a parameter tied between two modules of one unit stays in it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from ...torch_internals import registered_children
from ..parts.footprint import ParamShapes
from ..parts.precision import is_norm

Wrap = Callable[[nn.Module], bool] | tuple[type, ...] | None

# ZeRO3's `min_unit_params` by default, and what the planner assumes ([Note: grouped units])
MIN_UNIT_PARAMS = 400_000


@dataclass(frozen=True)
class UnitPlan:
    """One unit of the plan.

    name: the module's qualified name in the model ("" for the root, "blocks.0", ...; a
        grouped unit "blocks.0-3").
    modules: the modules whose forwards gather and free the unit: one, or consecutive siblings
        ([Note: grouped units]).
    params: the parameters this unit owns, in registration order.
    parent: index of the nearest enclosing unit in the plan (None for the root).
    member_names: each module's qualified name.
    """

    name: str
    modules: tuple[nn.Module, ...]
    params: tuple[nn.Parameter, ...]
    parent: int | None
    member_names: tuple[str, ...] = ()

    @property
    def module(self) -> nn.Module:
        """The first module (the only one unless grouped)."""
        return self.modules[0]


def with_norms(model: nn.Module, wrap: Wrap) -> Callable[[nn.Module], bool]:
    """`wrap`'s units plus every normalisation layer: under a low param_dtype the norms are
    units of their own, held in fp32 ([Note: mixed precision] in parts/precision.py)."""
    chosen = {id(m) for m in select_units(model, wrap)}
    chosen |= {id(m) for m in model.modules() if m is not model and is_norm(m)}
    return lambda m: id(m) in chosen


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


def plan_units(model: nn.Module, wrap: Wrap, min_unit_params: int = 0) -> list[UnitPlan]:
    """Units of `model` (the root first, then in module order) and the parameters each owns;
    siblings grouped up to `min_unit_params` parameters ([Note: grouped units]).

    Units that end up owning no parameter are left out (the root always stays).
    """
    selected = select_units(model, wrap)
    groups: dict[int, tuple[str, tuple[nn.Module, ...], tuple[str, ...]]] = {}
    if min_unit_params > 0:
        sizes: dict[int, int] = {}
        for plan in _plan(model, selected, {}):
            sizes[id(plan.module)] = sizes.get(id(plan.module), 0) + _numel(plan.params)
        for group in sibling_groups(model, selected, sizes, min_unit_params):
            for _, module in group:
                groups[id(module)] = group_entry(group)
    return split_frozen(_plan(model, selected, groups))


def _numel(params) -> int:
    return sum(p.numel() for p in params)


def sibling_groups(
    model: nn.Module, selected: list[nn.Module], sizes: dict[int, int], min_unit_params: int
) -> list[list[tuple[str, nn.Module]]]:
    """The groups of more than one module: runs of consecutive selected children of each
    nn.ModuleList, merged by `group_consecutive` on the parameters each owns (`sizes`)."""
    chosen = {id(m) for m in selected}
    out = []
    for prefix, holder in model.named_modules():
        if not isinstance(holder, nn.ModuleList):
            continue
        run: list[tuple[str, nn.Module]] = []
        for child_name, child in [*registered_children(holder), ("", None)]:
            if child is not None and id(child) in chosen:
                run.append((f"{prefix}.{child_name}" if prefix else child_name, child))
                continue
            counts = [sizes.get(id(m), 0) for _, m in run]
            out += [[run[i] for i in r] for r in group_consecutive(counts, min_unit_params)]
            run = []
    return [group for group in out if len(group) > 1]


def group_consecutive(sizes: list[int], min_params: int) -> list[range]:
    """[Note: grouped units] Consecutive units of `sizes` parameters merged, in order, until a
    group holds at least `min_params`; a unit of `min_params` or more stays alone, and 0 leaves
    every unit alone. Returns the groups as ranges of positions."""
    groups, start, total = [], 0, 0
    for i, size in enumerate(sizes):
        if i > start and (total >= min_params or size >= min_params):
            groups.append(range(start, i))
            start, total = i, 0
        total += size
    if sizes:
        groups.append(range(start, len(sizes)))
    return groups


def group_entry(group: list[tuple[str, nn.Module]]) -> tuple:
    """(the unit's name, its modules, their names): "blocks.0-3" for blocks.0 ... blocks.3."""
    names = tuple(name for name, _ in group)
    return f"{names[0]}-{names[-1].rsplit('.', 1)[-1]}", tuple(m for _, m in group), names


def _plan(model: nn.Module, selected: list[nn.Module], groups: dict[int, tuple]) -> list[UnitPlan]:
    """`plan_units` before the frozen split, `groups` mapping a module to its group's entry."""
    chosen = {id(m) for m in selected}
    plans: list[tuple[str, tuple[nn.Module, ...], tuple[str, ...]]] = [("", (model,), ("",))]
    parents: list[int | None] = [None]
    unit_of: dict[int, int] = {}  # id(first module of the unit) -> unit
    walked: dict[int, int] = {id(model): 0}  # id(module) -> unit it was walked into
    reached: dict[int, list[int]] = {}  # id(param) -> units it is used from
    params: dict[int, nn.Parameter] = {}

    def walk(module: nn.Module, prefix: str, unit: int) -> None:
        for _, p in module.named_parameters(recurse=False, remove_duplicate=False):
            params.setdefault(id(p), p)
            reached.setdefault(id(p), []).append(unit)
        for child_name, child in registered_children(module):
            if child is None:
                continue
            path = f"{prefix}{child_name}"
            if id(child) not in chosen:
                walk(child, path + ".", unit)
                continue
            if id(child) in walked:
                if parents[walked[id(child)]] != unit:
                    raise ValueError(
                        f"ZeRO3: module '{path}' is a unit reached from two different units; "
                        "wrap a module that encloses both places instead"
                    )
                continue
            entry = groups.get(id(child), (path, (child,), (path,)))
            key = id(entry[1][0])
            if key not in unit_of:
                unit_of[key] = len(plans)
                plans.append(entry)
                parents.append(unit)
            walked[id(child)] = unit_of[key]
            walk(child, path + ".", unit_of[key])

    walk(model, "", 0)
    owned: list[list[nn.Parameter]] = [[] for _ in plans]
    for key, units in reached.items():
        owned[common_ancestor(units, parents)].append(params[key])
    keep = [i for i in range(len(plans)) if i == 0 or owned[i]]
    new_index = {old: new for new, old in enumerate(keep)}

    def kept_parent(i: int) -> int | None:
        parent = parents[i]
        while parent is not None and parent not in new_index:
            parent = parents[parent]
        return None if parent is None else new_index[parent]

    return [
        UnitPlan(plans[i][0], plans[i][1], tuple(owned[i]), kept_parent(i), plans[i][2])
        for i in keep
    ]


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
            names = plan.member_names
            out.append(UnitPlan(f"{plan.name}[frozen]", plan.modules, frozen, parent, names))
            plan = UnitPlan(plan.name, plan.modules, trainable, parent, names)
        else:
            plan = UnitPlan(plan.name, plan.modules, plan.params, parent, plan.member_names)
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


def param_shapes(
    model: nn.Module, wrap: Wrap = None, min_unit_params: int = MIN_UNIT_PARAMS
) -> ParamShapes:
    """What a footprint needs of `model` ([Note: footprint] in parts/footprint.py): its
    trainable parameters' numels, and ZeRO-3's units as `plan_units` makes them for `wrap` and
    `min_unit_params` (by default ZeRO3's)."""
    plans = plan_units(model, wrap, min_unit_params)
    units = tuple(tuple(p.numel() for p in unit.params if p.requires_grad) for unit in plans)
    numels = tuple(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = tuple(sum(p.numel() for p in u.params if not p.requires_grad) for u in plans)
    return ParamShapes(numels, units, frozen if any(frozen) else ())
