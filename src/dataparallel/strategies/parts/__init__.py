"""The parts every strategy is composed of, one concept per module (docs/core.md).

layout.py       ShardLayout: which shard owns which slice of a flat buffer (pure arithmetic)
flat_shard.py   FlatShard: this rank's shard of a flat buffer, its pieces and their gradients
buckets.py      the bucket plan and Bucket: flat gradients, divided for the mean, handed to hooks
reducer.py      GradientReducer: buckets launched as backward fills them, overlapped
round.py        BackwardRound: the end of a synchronised backward, used flags, found-inf
geometry.py     Geometry: what a rank holds; state dicts, plain optimizer state, checkpoints
clip.py         global-norm clipping over shards
param_gather.py ZeRO-1/2's parameter all-gather after the step, optionally overlapped
precision.py    MixedPrecision: the dtypes a strategy computes, reduces and returns in
mesh.py         2-D meshes: shard within groups, replicate across them; from a DeviceMesh too
tensor_parallel.py  DTensor parameters as local tensors; their whole forms, norms, checkpoint parts
"""
