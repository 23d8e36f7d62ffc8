"""Several optimizer classes over one model's param groups, as one `torch.optim.Optimizer`.

[Note: grouped optimizer] The usual Muon recipe steps the hidden matrices with Muon and
everything else with AdamW. The strategies, the composition, rewinds and checkpoints assume one
optimizer per model, and an LR scheduler drives one optimizer, so `dp.build_optimizer` takes
both in one call: a param group may name its own class under the key "optimizer" (its
hyper-parameters in the group; the call's keyword arguments go to the main class):

    opt = dp.build_optimizer(model, torch.optim.Muon, params=[
        {"params": hidden_matrices},
        {"params": the_rest, "optimizer": torch.optim.AdamW, "lr": 3e-4},
    ], lr=0.02, adjust_lr_fn="match_rms_adamw")

What comes back is a `GroupedOptimizer`: one inner optimizer per class, built by the class
itself on its groups (unmodified), and an outer optimizer whose `param_groups` are the very same
dicts in the user's order, so an LR scheduler, `zero_grad`, a loss scaler's `unscale_` and the
strategies' step hooks see every group, and a scheduler's change of a group's `lr` is the inner
optimizer's. `step()` steps each inner optimizer; `state` reads through to theirs; the state
dict is the plain one of a single optimizer over all the groups (per-parameter state by index,
in the user's order). Each group gets its class's layout ([Note: optimizer layout] in
owners.py): Muon's whole matrices, AdamW's flat shards.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

GROUP_CLASS_KEY = "optimizer"


class GroupedOptimizer(torch.optim.Optimizer):
    """Inner optimizers, one per class, over the groups as one optimizer ([Note: grouped
    optimizer]).

    groups: the param group dicts, in the user's order (without the "optimizer" key).
    classes: per group, its optimizer class.
    kwargs: per class, the keyword arguments it is built with.
    """

    def __init__(self, groups: list[dict], classes: list[type], kwargs: dict[type, dict]):
        self.inner: list[torch.optim.Optimizer] = []
        self.members: list[list[int]] = []  # per inner optimizer, its groups' positions
        for cls in dict.fromkeys(classes):
            positions = [i for i, c in enumerate(classes) if c is cls]
            self.inner.append(cls([groups[i] for i in positions], **kwargs.get(cls, {})))
            self.members.append(positions)
        super().__init__(self._shared_groups(), {})
        self._link()
        self._built = True

    def _shared_groups(self) -> list[dict]:
        """The inner optimizers' own group dicts, in the user's order."""
        out: list = [None] * sum(len(m) for m in self.members)
        for inner, positions in zip(self.inner, self.members, strict=True):
            for group, position in zip(inner.param_groups, positions, strict=True):
                out[position] = group
        return out

    def _link(self) -> None:
        self.param_groups = self._shared_groups()
        self.state = States([inner.state for inner in self.inner])

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_built", False):  # no inner optimizer would step a later group
            raise ValueError(
                "GroupedOptimizer.add_param_group: a group added after build_optimizer would "
                "be stepped by no inner optimizer; pass every group to dp.build_optimizer"
            )
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError(
                "GroupedOptimizer.step: a closure would run forward and backward once per "
                "class; run them yourself, then call step()"
            )
        for inner in self.inner:
            inner.step()

    def load_state_dict(self, state_dict: dict) -> None:
        """A plain state dict over all the groups: each inner optimizer loads its part."""
        groups, state = state_dict["param_groups"], state_dict["state"]
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"GroupedOptimizer.load_state_dict: {len(groups)} param groups in the state, "
                f"{len(self.param_groups)} here; build it with the same groups"
            )
        for inner, positions in zip(self.inner, self.members, strict=True):
            part: dict = {"state": {}, "param_groups": []}
            index = 0
            for position in positions:
                indices = []
                for saved in groups[position]["params"]:
                    entry = state.get(saved, state.get(str(saved)))
                    if entry is not None:
                        part["state"][index] = entry
                    indices.append(index)
                    index += 1
                part["param_groups"].append({**groups[position], "params": indices})
            inner.load_state_dict(part)
        self._link()  # torch's load gives each inner optimizer new group dicts


class States(Mapping):
    """The inner optimizers' `state` as one read-only mapping (theirs are defaultdicts: a
    ChainMap's lookup would create an empty entry in the first and stop there)."""

    def __init__(self, maps: list):
        self.maps = maps

    def __getitem__(self, key):
        for states in self.maps:
            if key in states:
                return states[key]
        raise KeyError(key)

    def __iter__(self):
        return (key for states in self.maps for key in states)

    def __len__(self) -> int:
        return sum(len(states) for states in self.maps)


def split_classes(groups: list[dict], main: type) -> tuple[list[dict], list[type]]:
    """The groups without their "optimizer" key, and per group its class (`main` where none);
    one error naming the group when the key is not an optimizer class."""
    out, classes = [], []
    for i, group in enumerate(groups):
        cls = group.get(GROUP_CLASS_KEY, main)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise TypeError(
                f"build_optimizer: param group {i} has optimizer={cls!r}; name a "
                "torch.optim.Optimizer class there"
            )
        out.append({k: v for k, v in group.items() if k != GROUP_CLASS_KEY})
        classes.append(cls)
    return out, classes


class Grouped:
    """What the strategies build in place of one optimizer class: called with the groups
    (their "params" now the tensors the strategy steps) and the main class's keyword
    arguments, it builds a `GroupedOptimizer`."""

    def __init__(self, classes: list[type], main: type):
        self.classes, self.main = classes, main
        self.__name__ = "+".join(dict.fromkeys(c.__name__ for c in classes))

    def __call__(self, groups: list[dict], **kwargs) -> GroupedOptimizer:
        if kwargs and self.main not in self.classes:  # they would go to no optimizer
            raise ValueError(
                f"build_optimizer: every param group names its own optimizer, so the call's "
                f"{self.main.__name__} and its keyword arguments ({', '.join(sorted(kwargs))}) "
                "reach none; put them in the groups, or leave one group to the call's class"
            )
        return GroupedOptimizer(groups, self.classes, {self.main: kwargs})
