"""Whole-parameter ownership: the layout of optimizers whose update is not elementwise.

[Note: whole parameters] An optimizer whose update reads more than one element at a time
("parameter", "group" or "all" in [Note: optimizer layout], optimizer_layout.py) is built on
whole tensors: each trainable parameter of its groups has one owner in the shard group, which
holds a whole master of it (in the dtype the flat shard steps in: fp32 under mixed precision)
and its optimizer state; the user's class is built on the owners' whole tensors, unmodified.
Owners are chosen per bundle (`bundle_owners`): a parameter alone ("parameter"), a param group
("group"), or all of the class's groups ("all"), largest bundle first onto the least-loaded
rank, the same on every rank. The reduction is the flat shards' (the parameter still lies in
its bucket); at the end of each synchronised round the ranks holding pieces of the reduced
gradient send them to the owner (`Owners.collect_grads`, point-to-point messages, which gloo
has: it has no reduce-scatter), and after `step()` the owner sends the updated pieces back
(`Owners.send_values`) into the holders' flat shards, from where ZeRO-1/2's all-gather spreads
them and ZeRO-3 keeps them in its shards; for bundles of groups the owner's group dicts follow
(`share_groups`). On a 2-D mesh ownership is within the shard group: every replica
computes the same update. DDP is unchanged: every rank steps whole parameters.
Only the parameters of non-elementwise groups are owned, so ZeRO-3's memory for elementwise
groups scales as before; an owner's share of an owned group is whole matrices, so its memory
can exceed the average by up to the largest bundle (docs/optimizers.md).

Why not FSDP2's per-parameter dim-0 chunks inside the buckets (which would also give rows to
owners, DTensor gradients and rectangular checkpoint pieces): every bucket would need a copy in
before its reduce-scatter and a copy out after its all-gather, and every part that reads a
bucket (reducer, keepers, flat shards, ZeRO-3's units, clipping, the geometry) would be
rewritten, for every optimizer, to serve the ones that need whole parameters. Rectangular
checkpoint pieces come instead from splitting a run at row boundaries at save time.

What the rest of the house sees ([Note: geometry] in geometry.py): an owned parameter is held
whole by its owner (offset 0, the whole master as value and optimizer key) and by no other
rank, so the state dicts, checkpoints and memory reports need nothing new. The owner's master
gets its `.grad` at the end of each synchronised round, before any `unscale_` or clip: a loss
scaler's found-inf agreement ([Note: found inf] in round.py) poisons the pieces before they
move, so every owner sees the non-finite gradient; `dp.clip_grad_norm_` counts the owners'
gradients once over the shard group. Accumulation: each round's reduced pieces are added to
the master's `.grad` (set when it is None), and the pieces' own `.grad` are cleared, so
`optimizer.zero_grad()` on the masters is the only reset.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch
from torch import nn

from ...comm import Comm
from .flat_shard import FlatShard
from .tensor_parallel import spread_of


def assign_owners(sizes: list[int], ranks: int) -> list[int]:
    """Per parameter of `sizes` elements, its owner among `ranks`: largest first, each onto
    the least-loaded rank (the lowest such rank on ties), equal sizes in the given order, so
    every rank computes the same assignment. Ranks may own nothing (fewer parameters)."""
    if ranks < 1:
        raise ValueError(f"assign_owners: ranks={ranks} must be >= 1")
    owners = [0] * len(sizes)
    # (load, rank) of the ranks given a parameter so far, least first; the ranks from `fresh`
    # up hold nothing yet: the least-loaded rank is the heap's top or `fresh` (load 0), so
    # the work is O(P log P) for P parameters whatever the number of ranks.
    used: list[tuple[int, int]] = []
    fresh = 0
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        if fresh < ranks and (not used or (0, fresh) < used[0]):
            load, rank = 0, fresh
            fresh += 1
        else:
            load, rank = heapq.heappop(used)
        owners[i] = rank
        heapq.heappush(used, (load + sizes[i], rank))
    return owners


def bundle_owners(sizes: list[int], bundles: list, ranks: int) -> list[int]:
    """Per parameter, its owner, the parameters of one bundle together ([Note: whole
    parameters]): `bundles` names each parameter's bundle (None: a bundle of its own); the
    bundles are placed as `assign_owners` places parameters, by their total size, in the order
    of their first parameter."""
    slot: dict = {}
    totals: list[int] = []
    where = []
    for i, (size, bundle) in enumerate(zip(sizes, bundles, strict=True)):
        key = ("alone", i) if bundle is None else ("bundle", bundle)
        if key not in slot:
            slot[key] = len(totals)
            totals.append(0)
        totals[slot[key]] += size
        where.append(slot[key])
    owners = assign_owners(totals, ranks)
    return [owners[k] for k in where]


@dataclass(eq=False)  # keyed by identity
class Owned:
    """One owned parameter.

    param: the model's parameter.
    owner: the rank of the shard group that holds its whole master.
    shard: the flat shard (ZeRO-1/2 bucket, ZeRO-3 unit) whose buffer lays it out.
    position: its index in that shard's layout.
    master: the whole master (an nn.Parameter shaped like `param`) on the owner, else None.
    """

    param: nn.Parameter
    owner: int
    shard: FlatShard
    position: int
    master: nn.Parameter | None = None

    def runs(self, rank: int) -> tuple[int, int, int]:
        """(start, stop) of its piece in `rank`'s shard, and where that starts in the param."""
        return self.shard.layout.local_slice(self.position, rank)

    def holders(self) -> range:
        """The ranks of the shard group that hold a piece of it."""
        return self.shard.layout.holders(self.position)


class Owners:
    """The owned parameters of one model and the messages that move them ([Note: optimizer
    layout]).

    entries: (parameter, its flat shard, its position there) for each owned parameter, in one
        order on every rank.
    comm: the shard group.
    """

    def __init__(
        self,
        entries: list[tuple[nn.Parameter, FlatShard, int]],
        comm: Comm,
        bundles: list | None = None,
    ):
        self.comm = comm
        sizes = [p.numel() for p, _, _ in entries]
        owners = bundle_owners(sizes, bundles or [None] * len(entries), comm.world_size)
        self.group_owners: dict[int, int] = {}  # param group -> its owner ("group", "all")
        self.owned = [
            Owned(p, owner, shard, position)
            for (p, shard, position), owner in zip(entries, owners, strict=True)
        ]
        for o in self.owned:
            if o.owner == comm.rank:
                data = o.shard.data
                whole = torch.zeros(o.param.shape, dtype=data.dtype, device=data.device)
                o.master = nn.Parameter(whole, requires_grad=o.param.requires_grad)
        self.collect_values()

    def master_of(self, param: nn.Parameter) -> nn.Parameter | None:
        return next((o.master for o in self.owned if o.param is param), None)

    def masters(self) -> dict[int, nn.Parameter | None]:
        """id(parameter) -> its master on this rank (None where another rank owns it)."""
        return {id(o.param): o.master for o in self.owned}

    def grads(self) -> list[torch.Tensor]:
        """The gradients of the masters this rank owns (for the global-norm clip)."""
        return [grad for _, grad in self.runs()]

    def runs(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(model parameter, its whole reduced gradient) for the masters this rank owns: the
        runs of [Note: sharded gradients] for owned parameters (no other rank holds a piece)."""
        return [
            (o.param, o.master.grad)
            for o in self.owned
            if o.master is not None and o.master.grad is not None
        ]

    # -- the messages -----------------------------------------------------------------------
    @torch.no_grad()
    def collect_values(self) -> None:
        """Every holder's piece of each owned parameter's value into the owner's master."""
        pieces = self._to_owners([o for o in self.owned], lambda o, s, e: o.shard.data[s:e])
        for o, whole in pieces.items():
            o.master.copy_(whole.view_as(o.master))

    @torch.no_grad()
    def collect_grads(self, used: set[int]) -> None:
        """The end of a synchronised round: the reduced pieces of each used owned parameter
        (`used`: ids of the parameters some rank used) are added into the owner's master
        `.grad`, and the pieces' `.grad` cleared."""
        chosen = [o for o in self.owned if id(o.param) in used]
        store = lambda o, s, e: o.shard.store[s:e]  # noqa: E731
        for o, whole in self._to_owners(chosen, store).items():
            if o.master.grad is None:
                o.master.grad = whole.view_as(o.master)
            else:
                o.master.grad.add_(whole.view_as(o.master))
        for o in self.owned:
            piece = o.shard.pieces[o.position]
            if piece is not None:
                piece.grad = None

    @torch.no_grad()
    def send_values(self) -> None:
        """After the owners stepped (or loaded): each holder's piece of every owned parameter
        from the owner's master into its flat shard."""
        rank, sends, recvs, slots = self.comm.rank, {}, {}, []
        for o in self.owned:
            for holder in o.holders():
                start, stop, inner = o.runs(holder)
                if stop == start or (holder != rank and o.owner != rank):
                    continue
                if holder == rank and o.owner == rank:
                    o.shard.data[start:stop].copy_(o.master.view(-1)[inner : inner + stop - start])
                elif o.owner == rank:
                    part = o.master.view(-1)[inner : inner + stop - start]
                    sends.setdefault((holder, part.dtype), []).append(part)
                else:
                    slots.append((o, start, stop))
                    recvs.setdefault((o.owner, o.shard.data.dtype), []).append(stop - start)
        arrived = self._exchange(sends, recvs)
        offsets: dict = {}
        for o, start, stop in slots:
            key = (o.owner, o.shard.data.dtype)
            at = offsets.get(key, 0)
            o.shard.data[start:stop].copy_(arrived[key][at : at + stop - start])
            offsets[key] = at + stop - start

    def _to_owners(self, chosen: list[Owned], part_of) -> dict[Owned, torch.Tensor]:
        """Per owned parameter of `chosen` this rank owns, its whole flat tensor assembled
        from every holder's `part_of(owned, start, stop)`."""
        rank, sends, recvs, slots = self.comm.rank, {}, {}, []
        wholes: dict[Owned, torch.Tensor] = {}
        for o in chosen:
            dtype = o.shard.data.dtype
            if o.owner == rank:
                wholes[o] = torch.empty(o.param.numel(), dtype=dtype, device=o.shard.data.device)
            for holder in o.holders():
                start, stop, inner = o.runs(holder)
                if stop == start:
                    continue
                if holder == rank and o.owner == rank:
                    wholes[o][inner : inner + stop - start].copy_(part_of(o, start, stop))
                elif holder == rank:
                    sends.setdefault((o.owner, dtype), []).append(part_of(o, start, stop))
                elif o.owner == rank:
                    slots.append((o, holder, inner, stop - start))
                    recvs.setdefault((holder, dtype), []).append(stop - start)
        arrived = self._exchange(sends, recvs)
        offsets: dict = {}
        for o, holder, inner, n in slots:
            key = (holder, o.shard.data.dtype)
            at = offsets.get(key, 0)
            wholes[o][inner : inner + n].copy_(arrived[key][at : at + n])
            offsets[key] = at + n
        return wholes

    def _exchange(self, sends: dict, recvs: dict) -> dict:
        """One message per (peer, dtype) each way: `sends` lists the tensors for a peer,
        `recvs` the sizes expected from one; returns the received flat tensors. Every rank
        of the shard group calls it, in one order ([Note: pairwise collectives])."""
        device = next((o.shard.data.device for o in self.owned), torch.device("cpu"))
        outgoing = {key: torch.cat([t.reshape(-1) for t in parts]) for key, parts in sends.items()}
        incoming = {
            key: torch.empty(sum(sizes), dtype=key[1], device=device)
            for key, sizes in recvs.items()
        }
        self.comm.send_recv(outgoing, incoming)
        return incoming


def share_groups(optimizer: torch.optim.Optimizer, owners: dict[int, int], comm: Comm) -> None:
    """After a step: each param group of a "group" or "all" bundle takes its owner's values
    (all but its params: a step size such a class estimates, its counters), so every rank
    reads the one-process values and saves them in checkpoints ([Note: optimizer layout]).
    `owners`: param group index -> its owner in the shard group. Collective (one object
    all-gather over the shard group)."""
    if comm.world_size == 1 or not owners:
        return
    groups = optimizer.param_groups
    mine = {g: _portable(groups[g]) for g, owner in owners.items() if owner == comm.rank}
    for theirs in comm.all_gather_object(mine):
        for g, values in theirs.items():
            if owners[g] != comm.rank:
                _take(groups[g], values)


def _portable(group: dict) -> dict:
    """A group's values to send (tensors on the CPU)."""
    return {
        k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in group.items() if k != "params"
    }


def _take(group: dict, values: dict) -> None:
    """`values` into `group`, a tensor of the same shape in place (its device kept)."""
    for key, value in values.items():
        mine = group.get(key)
        if torch.is_tensor(value) and torch.is_tensor(mine) and mine.shape == value.shape:
            mine.copy_(value)
        elif torch.is_tensor(value) and torch.is_tensor(mine):
            group[key] = value.to(mine.device)
        else:
            group[key] = value


def check_not_tensor_parallel(groups: list[list[nn.Parameter]], who: str) -> None:
    """Whole parameters are whole tensors: a tensor-parallel parameter's local tensor is a
    slice of one, so an optimizer that reads a parameter's shape or norm would step the slice
    as if it were the tensor. Refused in one line (DDP and ZeRO alike)."""
    for group in groups:
        for p in group:
            if spread_of(p):
                raise ValueError(
                    f"build_optimizer: {who} needs whole parameters, and a parameter of local "
                    f"shape {list(p.shape)} is tensor-parallel (its whole tensor spans the tp "
                    "ranks); use an elementwise optimizer or tensor parallelism without it"
                )


def own_groups(
    groups: list[list[nn.Parameter]],
    shards: list[tuple[FlatShard, list]],
    comm: Comm,
    who: str,
    reads: list[str] | None = None,
) -> tuple[Owners, list[list[nn.Parameter]]]:
    """Ownership of the trainable parameters of `groups` (per param group, in the user's
    order), laid out by `shards` ((FlatShard, its parameters) pairs), over the shard group
    `comm`; `reads`: per group, what its update reads ("parameter", "group" or "all"; default
    "parameter"). Returns the `Owners` and, per group, the masters this rank owns (what the
    user's optimizer is built on)."""
    where = {id(p): (shard, i) for shard, params in shards for i, p in enumerate(params)}
    check_not_tensor_parallel(groups, who)
    reads = reads or ["parameter"] * len(groups)
    bundle_of = {"parameter": lambda g: None, "group": lambda g: ("group", g)}
    bundle_of["all"] = lambda g: ("all",)
    entries, bundles = [], []
    for g, (group, read) in enumerate(zip(groups, reads, strict=True)):
        for p in group:
            entries.append((p, *where[id(p)]))
            bundles.append(bundle_of[read](g))
    owners = Owners(entries, comm, bundles)
    position = 0
    for g, (group, read) in enumerate(zip(groups, reads, strict=True)):
        if group and read in ("group", "all"):
            owners.group_owners[g] = owners.owned[position].owner
        position += len(group)
    masters = owners.masters()
    chosen = [[masters[id(p)] for p in g if masters[id(p)] is not None] for g in groups]
    return owners, chosen
