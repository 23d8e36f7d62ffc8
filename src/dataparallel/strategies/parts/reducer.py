"""The gradient reducer: launches each bucket's reduction the moment autograd fills it.

[Note: overlap] A hook on every parameter counts it ready; when a bucket is full (and every bucket before it has launched, see [Note: bucket order] in buckets.py) its
hook starts an asynchronous collective, which runs on the backend's thread while autograd goes
on computing earlier layers. The first hook of a backward queues a callback that autograd runs
when the whole backward is done: it launches what is left, waits for everything in flight, and
only then does `loss.backward()` return, so `.grad` is always the reduced gradient afterwards.

[Note: unused parameters] Detection is automatic, no flag. A parameter that gets no gradient
in a step (a branch not taken, a frozen path) never fires its hook, so its bucket cannot fill
during backward; the end-of-backward callback launches such buckets, in order, with zeros for
the missing gradients, which is exactly that rank's contribution. The round's agreement ([Note:
backward round] in round.py) tells every rank which parameters no rank used; those get
`.grad = None` back if they had none when the round began, so optimizers skip them just as they
would in single-process training.

[Note: attached views] Where a bucket holds its parameters' dtype (every DDP and ZeRO-1/2
bucket unless `reduce_dtype` is wider), the work per gradient is autograd's, in C++: before the
backward (`prepare`, at the forward) every `.grad` is made its view of the bucket, zeroed where
it was None, and autograd's AccumulateGrad adds each gradient into it in place. The only Python
per gradient is the counting hook, a pre-hook of the parameter's AccumulateGrad node that
autograd calls just before it runs, after the parameter's tensor hooks (so a user's hook that
changes the gradient is seen); it marks the parameter used and counts its bucket down, no tensor
operation. What runs per
bucket: the last gradient's hook only notes the bucket due, and the next hook (or the end of
the backward) launches it, once autograd has added that gradient in place: one division of the
whole buffer for the mean, and the hook ([Note: launched at the next hook]). Per step: the
zeroing, one memset per bucket after the usual `zero_grad()`. This replaced
a post-accumulate-grad hook per parameter that copied autograd's fresh gradient into its view
(divided on the way) from Python: on gpt-deep-narrow (292 tensors) that was a kernel launched
from Python and the bookkeeping around it per gradient. Buckets of a wider dtype keep that copy
(the widening) and that hook. ZeRO-2's lazy buckets allocate and attach at their first
gradient ([Note: lazy buckets] in buckets.py).

[Note: launched at the next hook] The counting hook runs before autograd adds the gradient,
so the bucket its count completes cannot be reduced yet: adding into a buffer already being
reduced would race with the collective. It was launched at once, with the last gradient added
into its view by the hook and the view taken off `.grad` for that once; autograd then stored
its gradient as `.grad`, beside the bucket, until the round's end: every bucket's last gradient
held twice at the end of the backward, the peak. A parameter larger than a bucket is alone in
its own, so its whole gradient was: on llama-8b in bf16 under DDP and ZeRO-1, 15.5 GB (the
dry run, docs/plan.md; tests/dist/test_held_once.py measures it on CPU). Now the bucket is
launched at the next hook, which autograd runs only after the one before has accumulated (one
engine thread per device, in order; on a GPU the collective is ordered after the add by the
stream), or at the backward's end for the last one: its reduction starts one node later.
The hook's work per gradient is unchanged.

[Note: arrival order] Buckets are first planned in reverse registration order ([Note: bucket
order] in buckets.py), a guess at the order backward produces gradients. With
`record_arrival`, the counting hooks note the order the gradients really arrive in until the
first synchronised round ends (then `arrival_order` holds it, the never-seen ones last), and
DDP re-lays its buckets in rank 0's order at the next forward, once, as PyTorch's DDP rebuilds
its buckets after the first iteration: a bucket then fills without waiting for a gradient that
comes late. Sharded strategies keep the planned order: their buckets are the optimizer's shards,
built before the first step.

[Note: cleared after the forward] The views are attached at the forward, but a user may clear
the gradients between the forward and the backward: `optimizer.zero_grad()` right before
`loss.backward()`, and Lightning's automatic optimization always does (its closure runs the
step, then zero_grad, then backward). Autograd would then store a fresh `.grad` beside the
view, and the bucket would reduce the view's zeros: DDP 0.08 off one process after 4 steps of
gpt-like training, ZeRO-1/2 likewise. So the hook, before autograd accumulates, puts a
parameter's view back as its `.grad` when it is no longer (zeroed when the grad was cleared,
the user's tensor copied in when one was set), as the forward's attach would have. A parameter
this rank did not use gets no hook: a bucket launched late zeroes such a cleared view first
(else the cleared gradient went into the reduction), and after the round a parameter another
rank used gets its view back as `.grad` (else this rank's optimizer skipped it and the replicas
parted: tests/dist/test_clear_after_forward.py's branchy model, 7e-4 off).

Sharded strategies extend the reducer without branching it: they give it their stage's
`keeper` (parts/keepers.py) and each bucket its `FlatShard`; the reducer calls
`keeper.reduced(bucket)` on the training thread for each bucket once its reduction has arrived,
in launch order (during backward for those already done, the rest at the end), and
`keeper.after_round(bucket)` for each at the round's end; then `on_round_end(used)`, with, per
parameter, whether any rank used it. With
`max_in_flight=k`, launching a bucket first collects (waiting if need be) the oldest ones until
at most k are uncollected, also for the buckets launched late at the end of backward: it
bounds the reductions in flight, and the memory they hold (ZeRO-2's full-size buckets, a
pairwise reduce-scatter's receive buffer), even when the backend reports completion only when
waited for ([Note: pairwise collectives] in comm/pairwise.py). Buckets still filling are not
counted: a parameter one rank never uses keeps its bucket and all later ones filling to the end.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from ...comm import Comm, HookState
from .buckets import EMPTY, Bucket, BucketSpec
from .round import BackwardRound


def grad_accumulator(param: torch.Tensor):
    """The autograd node that accumulates `param`'s gradient (AccumulateGrad). Its pre-hooks
    run after every tensor hook of the parameter, so they see the gradient as the user's own
    hooks left it. Autograd keeps only a weak reference to it: whoever hooks it must hold it."""
    with torch.enable_grad():
        return param.view_as(param).grad_fn.next_functions[0][0]


class GradientReducer:
    """Bucketed, overlapped reduction of the gradients of `params` (given in planned order).

    world: every rank that contributes gradients (used flags are agreed over it).
    divisor: the ranks the mean divides by (1 for a sum).
    shards: per bucket, this rank's [start, stop) when it keeps only that slice (sharded
        strategies), or None for the whole bucket.
    flat_shards: per bucket, a sharded strategy's FlatShard the bucket is reduced into (its
        `flat_shard`); the round's agreement checks their gradients for inf/NaN once every
        bucket is collected ([Note: found inf] in round.py); None: no shards, and the flags are
        agreed while the last buckets are still being reduced.
    keeper: what the stage keeps of a reduced bucket (parts/keepers.py); its `lazy` buckets
        hold no buffer between rounds ([Note: lazy buckets] in buckets.py). None: the buckets
        stay, reduced in place (DDP).
    on_round_end: called with, per parameter, whether any rank used it, after each
        synchronised round.
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        specs: list[BucketSpec],
        world: Comm,
        hook,
        hook_state: HookState,
        *,
        divisor: int = 1,
        shards: list[tuple[int, int] | None] | None = None,
        keeper=None,
        on_round_end: Callable[[list[bool]], None] | None = None,
        max_in_flight: int | None = None,
        flat_shards: list | None = None,
        record_arrival: bool = False,
    ):
        self.params = params
        self.flat_shards = flat_shards  # checked for inf/NaN at the round's end (round.py)
        self.comm = world
        self.hook = hook
        self.hook_state = hook_state
        self.keeper = keeper
        self.on_round_end = on_round_end
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError(f"GradientReducer: max_in_flight={max_in_flight} must be >= 1 or None")
        self.max_in_flight = max_in_flight
        shards = shards or [None] * len(specs)
        lazy = keeper is not None and keeper.lazy
        self.buckets = [
            Bucket(s, [params[i] for i in s.param_indices], lazy, divisor, shard, flat)
            for s, shard, flat in zip(
                specs, shards, flat_shards or [None] * len(specs), strict=True
            )
        ]
        self.location: dict[int, tuple[Bucket, int]] = {}
        for bucket in self.buckets:
            for position, i in enumerate(bucket.spec.param_indices):
                self.location[i] = (bucket, position)
        self.sync_enabled = True
        self.arrival: list[int] | None = [] if record_arrival else None  # [Note: arrival order]
        self.arrival_order: list[int] | None = None  # set when the first synchronised round ends
        self.round = BackwardRound(len(params), world)
        self.was_none = [True] * len(params)
        self.round_open = False
        self.next_launch = 0
        self.next_collect = 0
        self.launch_due = False  # a bucket completed, launched at the next hook
        self.planned_order = [i for b in self.buckets for i in b.spec.param_indices]
        self.handles = []
        self.accumulators = []  # held, so that autograd keeps these nodes and their hooks
        for bucket in self.buckets:  # [Note: attached views]
            for position, i in enumerate(bucket.spec.param_indices):
                param = params[i]
                if bucket.grad_views:
                    accumulator = grad_accumulator(param)
                    self.accumulators.append(accumulator)
                    hook = partial(self._on_grad, bucket, position, i)
                    self.handles.append(accumulator.register_prehook(hook))
                else:
                    hook = partial(self._on_grad_ready, i)
                    self.handles.append(param.register_post_accumulate_grad_hook(hook))

    def prepare(self) -> None:
        """Before a forward: bring every .grad into its bucket; remember which had none."""
        if self.round.queued:
            # A synchronised backward raised (say, out of memory) and autograd dropped its
            # end-of-backward callback: wait out the collectives it launched (they write into the
            # buckets) and start the next round clean instead of half-way through this one.
            for bucket in self.buckets[: self.next_launch]:
                bucket.wait()
            self._reset()
        was_none = [
            flag
            for bucket in self.buckets
            for flag in (bucket.attach_views() if bucket.grad_views else bucket.attach_grads())
        ]
        if not self.round_open:
            for i, flag in zip(self.planned_order, was_none, strict=True):
                self.was_none[i] = flag
            self.round_open = True

    def _on_grad(self, bucket: Bucket, position: int, i: int, grads: tuple) -> None:
        """The view path's hook, before autograd adds the gradient into the view ([Note:
        attached views]): count it, and launch the bucket when it is the last one."""
        if not self.round_open:  # a backward with no forward through the root module
            self.prepare()
        if bucket.buffer is None:  # a lazy bucket's first gradient
            bucket.allocate_attached()
        else:  # [Note: cleared after the forward]
            bucket.keep_attached(position)
        self.round.used[i] = 1
        if self.arrival is not None:
            self.arrival.append(i)
        if not self.sync_enabled:
            return
        if not self.round.queued:
            self.round.open(self._finish)
        self._launch_due()  # the gradient before this one is in its bucket now
        if self.comm.tracer.enabled:
            self.comm.tracer.mark("grad_ready", param=i)
        bucket.pending -= 1
        # Launched once autograd has added this gradient ([Note: launched at the next hook]).
        self.launch_due = bucket.pending == 0

    def _on_grad_ready(self, i: int, param: torch.Tensor) -> None:
        bucket, position = self.location[i]
        bucket.adopt_grad(position, divide=self.sync_enabled)
        if not self.round_open:
            self.was_none[i] = False  # a backward with no forward through the root module
            self.round_open = True
        self.round.mark_used(i)
        if not self.sync_enabled:
            return
        self.round.open(self._finish)
        if self.comm.tracer.enabled:
            self.comm.tracer.mark("grad_ready", param=i)
        if bucket.mark_ready():
            self._launch_ready()

    def _launch_due(self) -> None:
        """Launch what a completed bucket made ready, once its last gradient is in it ([Note:
        launched at the next hook])."""
        if self.launch_due:
            self.launch_due = False
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self.next_launch < len(self.buckets):
            bucket = self.buckets[self.next_launch]
            if bucket.pending:
                break
            self._launch(bucket)
        if self.keeper is not None:
            self._collect_arrived()

    def _launch(self, bucket: Bucket, late: bool = False) -> None:
        """Start the bucket's reduction, first collecting the oldest while too many are out."""
        if self.max_in_flight is not None:
            while self.next_launch - self.next_collect >= self.max_in_flight:
                self._collect(self.buckets[self.next_collect])
        self.comm.tracer.mark("bucket_launch", bucket=bucket.index, late=late)
        with self.comm.tracer.labelled(bucket=bucket.index):
            bucket.launch(self.hook, self.hook_state)
        self.next_launch += 1

    def _collect_arrived(self) -> None:
        """Hand over, in order, the buckets whose reduction has already arrived."""
        while self.next_collect < self.next_launch:
            if not self.buckets[self.next_collect].future.done():
                return
            self._collect(self.buckets[self.next_collect])

    def _collect(self, bucket: Bucket) -> None:
        bucket.wait()
        self.comm.tracer.mark("bucket_reduced", bucket=bucket.index)
        self.next_collect += 1
        if self.keeper is not None:
            self.keeper.reduced(bucket)

    def _finish(self) -> None:
        self.comm.tracer.mark("backward_end")
        self._launch_due()  # the backward's last gradient may have completed its bucket
        for bucket in self.buckets[self.next_launch :]:  # some gradient never came
            if bucket.grad_views:
                self._zero_cleared(bucket)
            self._launch(bucket, late=True)
        agreement = None if self.flat_shards else self.round.start_agreement()
        for bucket in self.buckets[self.next_collect :]:
            self._collect(bucket)
        if agreement is None:
            agreement = self.round.start_agreement(self.flat_shards)
        used = self.round.finish_agreement(agreement)
        self.comm.tracer.mark("reduce_end")
        if self.round.used.count(1) != used.count(True):  # one another rank used, not this one
            self._give_back_views(used)
        for i, was_used in enumerate(used):
            if not was_used and self.was_none[i]:
                self.params[i].grad = None
        self._reset()
        if self.arrival is not None:  # the first synchronised round: its order is settled
            seen = set(self.arrival)
            missing = [i for i in range(len(self.params)) if i not in seen]
            self.arrival_order = list(dict.fromkeys(self.arrival)) + missing
            self.arrival = None
        if self.keeper is not None:
            for bucket in self.buckets:
                self.keeper.after_round(bucket)
        if self.on_round_end is not None:
            self.on_round_end(used)

    def _zero_cleared(self, bucket: Bucket) -> None:
        """[Note: cleared after the forward] A view no gradient reached this round whose `.grad`
        a clear after the forward took away still holds what the user cleared: zeros, as that
        rank's contribution, before it is reduced."""
        if bucket.buffer is None:
            return
        for position, i in enumerate(bucket.spec.param_indices):
            if not self.round.used[i] and bucket.params[position].grad is None:
                bucket.views[position].zero_()

    def _give_back_views(self, used: list[bool]) -> None:
        """[Note: cleared after the forward] A parameter another rank used and this one did
        not, whose view a clear after the forward took off `.grad`: no hook of this rank saw
        it, so its view (the reduced gradient) becomes its `.grad` here, as on the ranks that
        used it (else this rank's optimizer skipped it and the replicas parted)."""
        for bucket in self.buckets:
            if not bucket.grad_views or bucket.buffer is None:
                continue
            for position, i in enumerate(bucket.spec.param_indices):
                param = bucket.params[position]
                if used[i] and param.grad is None:
                    param.grad = bucket.views[position]

    def rebind(self, divisor: int) -> None:
        """After the Comm moved to another group: forget any round in flight on the old one
        (its collectives failed; nothing is waited for) and divide by the new size."""
        for bucket in self.buckets:
            bucket.divisor = divisor
            bucket.held = [EMPTY] * len(bucket.params)
        self._reset()

    def _reset(self) -> None:
        for bucket in self.buckets:
            bucket.reset()
        self.round.reset()
        self.next_launch = 0
        self.next_collect = 0
        self.launch_due = False
        self.round_open = False

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
