"""Whole-parameter ownership: the layout of optimizers whose update is not elementwise.

[Note: optimizer layout] What the user's optimizer is built on under ZeRO-1/2/3 depends on one
question about its class: is its update of an element a function of that element's gradient
and state alone (and of per-parameter scalars such as Adam's `step`)?
- Yes (`ELEMENTWISE`, or a class the user declares with `dp.build_optimizer(...,
  elementwise=True)`): today's flat shards, unchanged. The optimizer steps 1-D pieces of the
  flat buffers ([Note: flat shard] in flat_shard.py): zero-copy bucket views, one
  reduce-scatter per bucket, shards balanced to the element; that is exactly the one-process
  update of those elements.
- No, or unknown (Adafactor's factored moments, Muon's orthogonalisation, a LAMB/LARS trust
  ratio, Shampoo, a user's class): whole parameters. Each trainable parameter of such a group
  has one owner in the shard group (`assign_owners`: largest first onto the least-loaded rank,
  the same on every rank), which holds a whole master of it (in the dtype the flat shard
  steps in: fp32 under mixed precision) and its optimizer state; the user's class is built on
  the owners' whole tensors, unmodified. The reduction is today's (the parameter still lies in
  its bucket); at the end of each synchronised round the ranks holding pieces of the reduced
  gradient send them to the owner (`Owners.collect_grads`, point-to-point messages, which gloo
  has: it has no reduce-scatter), and after `step()` the owner sends the updated pieces back
  (`Owners.send_values`) into the holders' flat shards, from where ZeRO-1/2's all-gather
  spreads them as today and ZeRO-3 keeps them in its shards. On a 2-D mesh ownership is within
  the shard group: every replica computes the same update. DDP is unchanged: every rank steps
  whole parameters. Either way an elementwise class steps each run of contiguous pieces (or
  DDP's laid parameters) as one tensor ([Note: flat step] in flat_step.py).
Only the parameters of non-elementwise groups are owned, so ZeRO-3's memory for elementwise
groups scales as before; an owner's share of an owned group is whole matrices, so its memory
can exceed the average by up to the largest matrix (docs/optimizers.md).

Why not FSDP2's per-parameter dim-0 chunks inside the buckets (which would also give rows to
owners, DTensor gradients and rectangular checkpoint pieces): every bucket would need a copy in
before its reduce-scatter and a copy out after its all-gather, and every part that reads a
bucket (reducer, keepers, flat shards, ZeRO-3's units, clipping, the geometry) would be
rewritten, for every optimizer, to serve the ones that need whole parameters. Rectangular
checkpoint pieces come instead from splitting a run at row boundaries at save time, and
`.grad` reads on `model.parameters()` under ZeRO get a one-line error.

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

# torch.optim classes whose update is elementwise given per-parameter scalars: exact on flat
# shards (docs/zero.md's table checks each against the plain optimizer).
ELEMENTWISE = frozenset(
    {
        torch.optim.SGD,
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.Adagrad,
        torch.optim.RMSprop,
        torch.optim.Adamax,
        torch.optim.NAdam,
        torch.optim.RAdam,
        torch.optim.ASGD,
        torch.optim.Rprop,
        torch.optim.Adadelta,
    }
)
# torch.optim classes known to look at a whole parameter: `elementwise=True` is refused.
WHOLE = {
    torch.optim.Adafactor: "factors each matrix's second moment into rows and columns",
    torch.optim.Muon: "orthogonalises whole matrices",
}


def whole_parameters(optimizer_cls: type, elementwise: bool | None) -> bool:
    """Whether `optimizer_cls` gets whole-parameter ownership ([Note: optimizer layout]).

    elementwise: the user's declaration; None: known torch classes by their kind, any other
        class whole (the exact layout).
    """
    if elementwise is not None and not isinstance(elementwise, bool):
        raise TypeError(f"build_optimizer: elementwise={elementwise!r} must be True, False or None")
    why = next((w for cls, w in WHOLE.items() if issubclass(optimizer_cls, cls)), None)
    if elementwise and why is not None:
        raise ValueError(
            f"build_optimizer: {optimizer_cls.__name__} {why}; it is not elementwise, drop "
            "elementwise=True (it gets whole parameters, exactly)"
        )
    if elementwise is None:
        return optimizer_cls not in ELEMENTWISE
    return not elementwise


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

    def __init__(self, entries: list[tuple[nn.Parameter, FlatShard, int]], comm: Comm):
        self.comm = comm
        owners = assign_owners([p.numel() for p, _, _ in entries], comm.world_size)
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
    groups: list[list[nn.Parameter]], shards: list[tuple[FlatShard, list]], comm: Comm, who: str
) -> tuple[Owners, list[list[nn.Parameter]]]:
    """Ownership of the trainable parameters of `groups` (per param group, in the user's
    order), laid out by `shards` ((FlatShard, its parameters) pairs), over the shard group
    `comm`; returns the `Owners` and, per group, the masters this rank owns (what the user's
    optimizer is built on)."""
    where = {id(p): (shard, i) for shard, params in shards for i, p in enumerate(params)}
    check_not_tensor_parallel(groups, who)
    entries = [(p, *where[id(p)]) for group in groups for p in group]
    owners = Owners(entries, comm)
    masters = owners.masters()
    chosen = [[masters[id(p)] for p in g if masters[id(p)] is not None] for g in groups]
    return owners, chosen
