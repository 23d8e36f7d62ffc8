"""What a ZeRO stage keeps of its gradient buckets: ZeRO-1 keeps them, ZeRO-2 frees each once
its shard is kept ([Note: lazy buckets] in buckets.py). The stage's policy names one
(`ZeROPolicy.keeper`); the reducer calls its verbs on each bucket as the bucket's reduction
arrives and at the round's end, and the strategy at the first forward after a round. Each
bucket carries the flat shard it reduces into (`Bucket.flat_shard`)."""

from __future__ import annotations

from .buckets import Bucket


class KeepBuckets:
    """ZeRO-1: full-size gradient buckets stay allocated; the reduced slice of each becomes the
    shard's gradient in place (no copy) when the dtypes agree. The model's own `.grad` are not
    the buckets after a synchronised round, as under ZeRO-2: [Note: consumed sums]."""

    lazy = False

    def reduced(self, bucket: Bucket) -> None:
        bucket.flat_shard.take_reduced(bucket.reduced(), borrow=True)

    def after_round(self, bucket: Bucket) -> None:
        """[Note: consumed sums] What the buckets hold outside this rank's slice are its local
        sums, already reduced into other ranks' slices, and the slice itself is the shard's
        gradient. Left as the model's `.grad`, code that reads them would see neither the
        gradient nor its shard, and code that scales them would scale the shard: PyTorch's AMP
        recipe (`scaler.unscale_(opt)`, then `clip_grad_norm_(model.parameters(), ...)`)
        measured the still-scaled local sums and multiplied each rank's shard by its own
        factor, 6e-2 off one process where torch's DDP is 2.8e-4 (tests/dist/test_amp.py).
        So they go: the reduced gradient is the optimizer's (its pieces' `.grad`), and the
        strategy then gives the model's parameters `ShardedGrad`s that read it where it lives
        ([Note: sharded gradients] in sharded_grads.py): the same recipe now clips the
        unscaled reduced gradient by its global norm, as in one process."""
        for param in bucket.params:
            param.grad = None

    def before_round(self, bucket: Bucket) -> None:
        """First forward after a synchronised round: the next backward writes into the bucket,
        so the shard's gradient moves out of it if the pieces still hold it (accumulating
        across synchronised backwards)."""
        bucket.flat_shard.stop_borrowing()


class FreeBuckets:
    """ZeRO-2: a bucket lives only from its first gradient to its reduction; the shard keeps a
    copy of its slice ([Note: lazy buckets] in buckets.py)."""

    lazy = True

    def reduced(self, bucket: Bucket) -> None:
        bucket.flat_shard.take_reduced(bucket.reduced())
        bucket.release()

    def after_round(self, bucket: Bucket) -> None:
        pass

    def before_round(self, bucket: Bucket) -> None:
        pass
