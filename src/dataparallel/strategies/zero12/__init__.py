"""ZeRO-1 and ZeRO-2: optimizer state (and, for ZeRO-2, gradients) sharded, one flat bucket at a
time.

policy.py   `ZeRO1(...)`, `ZeRO2(...)`: what the policies take, check and build
strategy.py `ZeROStrategy`: buckets, one flat shard per bucket, and the policy's keeper
            (parts/keepers.py: what a stage keeps of its reduced buckets; the reducer calls it)
step.py     the flat parameter buffers, and the optimizer step over this rank's shards of them

The contract is strategy.py's module docstring; docs/zero.md has it in full.
"""

from .policy import ZeRO1, ZeRO2
from .strategy import ZeROStrategy

__all__ = ["ZeRO1", "ZeRO2", "ZeROStrategy"]
