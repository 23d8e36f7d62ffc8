"""int8, fp8 and int4 quantisation with per-block scales, reduced as a quantised reduce-scatter.

[Note: 4-bit values] int4 keeps integers in [-7, 7] (scale absmax / 7, rounded to nearest),
stored offset by 8 as nibbles, two entries to a byte (entry 2i in the low nibble, 2i + 1 in
the high one): about n x (1/2 + 4 / block) bytes, an eighth of fp32. Streaming DiLoCo sends
its outer gradients so (arXiv 2501.18512 uses 4-bit E3M0 floats; integers with a per-block
scale and error feedback are what the rest of this module does).

[Note: quantised reduction] The pattern of ZeRO++'s qgZ and torchft's quantised all-reduce:
1. each rank quantises its (corrected) buffer, split into W chunks, one per rank, with one fp32
   scale per block of `block` entries (int8: absmax / 127, rounded to nearest; fp8 e4m3:
   absmax / 448);
2. an all-to-all hands chunk j of every rank to rank j (a reduce-scatter of quantised chunks:
   integers with different scales cannot be summed on the wire), which dequantises and sums
   them in fp32;
3. a sharded strategy keeps that sum: it is its shard. For a whole bucket (DDP), rank j
   quantises its summed chunk again and an all-gather gives every rank every chunk, dequantised
   the same way everywhere, so replicas stay bit-identical.
Each quantisation has its own error feedback ([Note: error feedback]): the sender's, over the
whole buffer, for step 1; the chunk owner's, over its chunk, for step 3. Bytes per rank: about
n x (1 + 4 / block) in each step, against 4n for fp32 (a quarter).

[Note: quantised residuals after a regroup] Both residuals are laid out by the group: the
sender's as W rows (row j: chunk j), the chunk owner's as its own chunk, so they mean nothing
in a group of another size, or at another rank (a live run's regroup: train/live/recovery.py).
`layouts` keeps the (rank, size) each key's residuals were laid out for; a reduction in
another group first lays them out again, without losing any of them: the sender's residual is
flattened to the bucket's entries and laid out for the new size, and the owner's is added to
it at its chunk's entries. That is the same correction: the owner's residual is an error of
the summed chunk, and whatever a sender adds to its entries reaches that sum.
"""

from __future__ import annotations

import torch

from ..comm import Comm
from ..comm.hooks import Chain, Ready, Then, WorkFuture
from .feedback import ErrorFeedback

FORMATS = {  # name -> (storage dtype, largest magnitude it holds)
    "int8": (torch.int8, 127.0),
    "fp8": (torch.float8_e4m3fn, 448.0),
    "int4": (torch.int8, 7.0),  # [Note: 4-bit values]: two to a byte
}


class Quantize:
    """Blockwise int8, fp8 or int4 quantisation with error feedback.

    kind: "int8", "fp8" (torch.float8_e4m3fn) or "int4" ([Note: 4-bit values]).
    block: entries sharing one fp32 scale, a multiple of 4.
    """

    def __init__(self, kind: str = "int8", block: int = 1024):
        if kind not in FORMATS:
            raise ValueError(f"quantize: kind={kind!r} must be one of {', '.join(FORMATS)}")
        if block < 4 or block % 4:
            raise ValueError(f"quantize: block={block} must be a multiple of 4 (e.g. 1024)")
        self.name, self.kind, self.block = kind, kind, block
        self.dtype, self.limit = FORMATS[kind]
        self.feedback = ErrorFeedback()
        # key -> tensor([rank, size]) of the group its residuals are laid out for
        self.layouts: dict[object, torch.Tensor] = {}

    shared_stores = ()  # the residuals are each rank's own (compression/live.py)

    # -- pure verbs -------------------------------------------------------------------------
    def quantize(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows (R, c) of fp32, c a multiple of `block`, to packed bytes (R, 4c/block + c):
        each row's scales, then its quantised entries."""
        blocks = rows.reshape(rows.shape[0], -1, self.block)
        scales = blocks.abs().amax(dim=2, keepdim=True) / self.limit
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
        scaled = blocks / scales
        if self.dtype == torch.int8:
            quantised = scaled.round_().clamp_(-self.limit, self.limit).to(torch.int8)
        else:
            quantised = scaled.clamp_(-self.limit, self.limit).to(self.dtype)
        values = quantised.reshape(rows.shape[0], -1).view(torch.uint8)
        if self.kind == "int4":  # [Note: 4-bit values]
            values = ((values[:, 0::2] + 8) & 15) | (((values[:, 1::2] + 8) & 15) << 4)
        return torch.cat([scales.reshape(rows.shape[0], -1).view(torch.uint8), values], dim=1)

    def dequantize(self, packed: torch.Tensor) -> torch.Tensor:
        """Packed bytes (R, 4c/block + c, or + c/2 for int4) back to fp32 rows (R, c)."""
        per_entry = 0.5 if self.kind == "int4" else 1.0
        c = round(packed.shape[1] / (4 / self.block + per_entry))
        nblocks = c // self.block
        scales = packed[:, : 4 * nblocks].contiguous().view(torch.float32)
        raw = packed[:, 4 * nblocks :].contiguous()
        if self.kind == "int4":
            low, high = (raw & 15).to(torch.int8) - 8, (raw >> 4).to(torch.int8) - 8
            values = torch.stack([low, high], dim=2).reshape(raw.shape[0], -1).float()
        else:
            values = raw.view(self.dtype).float()
        return (values.view(-1, nblocks, self.block) * scales.unsqueeze(2)).view(-1, c)

    def round_trip(self, key, rows: torch.Tensor) -> torch.Tensor:
        """Quantise `rows` plus the residual under `key`, keep the new residual, and return
        the packed bytes (the one place error feedback meets quantisation)."""
        corrected = self.feedback.correct(key, rows)
        packed = self.quantize(corrected)
        self.feedback.remember(key, corrected, self.dequantize(packed).view_as(corrected))
        return packed

    # -- the reduction ----------------------------------------------------------------------
    def reduce(self, comm: Comm, key, tensor: torch.Tensor, keep, shapes=None, window=None):
        """Sum `tensor` (1-D) over `comm` ([Note: quantised reduction]); the future gives the
        whole sum, or the `keep` slice (then rank j's chunk)."""
        world, numel = comm.world_size, tensor.numel()
        chunk = -(-numel // world)
        if keep is not None and (keep[1] - keep[0] != chunk or keep[0] != comm.rank * chunk):
            raise ValueError(
                f"{self.name}: this rank keeps [{keep[0]}, {keep[1]}) of {numel} entries, not "
                f"its chunk of {chunk}; shard buckets evenly over the group it reduces in"
            )
        padded = self._padded(numel, world)
        self._follow_layout(key, comm.rank, world, numel)
        packed = self.round_trip((key, "send"), self._rows(tensor, world, padded))

        def summed(received: torch.Tensor) -> torch.Tensor:
            return self.dequantize(received.view(world, -1)).sum(dim=0)[:chunk]

        if world == 1:
            first = Then(Ready(packed), summed)
        else:
            received = torch.empty_like(packed)
            work = comm.all_to_all(received, packed, async_op=True)
            first = Then(WorkFuture(work, lambda: received), summed)
        if keep is not None:
            own = tensor[keep[0] : keep[1]]
            return Then(first, own.copy_)

        def gather(own_sum: torch.Tensor):
            row = torch.zeros(1, padded, dtype=torch.float32, device=tensor.device)
            row[0, :chunk] = own_sum
            mine = self.round_trip((key, "gather"), row)
            everyone = torch.empty(world * mine.numel(), dtype=torch.uint8, device=mine.device)

            def unpack(gathered: torch.Tensor) -> torch.Tensor:
                values = self.dequantize(gathered.view(world, -1))[:, :chunk].reshape(-1)
                return tensor.copy_(values[:numel])

            if world == 1:
                return Then(Ready(mine), unpack)
            work = comm.all_gather(everyone, mine, async_op=True)
            return Then(WorkFuture(work, lambda: everyone), unpack)

        return Chain(first, gather)

    def _padded(self, numel: int, world: int) -> int:
        """A row's entries: a chunk of `numel` over `world`, rounded up to whole blocks."""
        chunk = -(-numel // world)
        return -(-chunk // self.block) * self.block

    @staticmethod
    def _rows(flat: torch.Tensor, world: int, padded: int) -> torch.Tensor:
        """`flat` as `world` rows of `padded` entries, chunk j in row j, zero padded: one copy."""
        numel = flat.numel()
        chunk = -(-numel // world)
        rows = torch.zeros(world, padded, dtype=torch.float32, device=flat.device)
        full = numel // chunk
        rows[:full, :chunk] = flat[: full * chunk].view(full, chunk)
        if full < world:
            rows[full, : numel - full * chunk] = flat[full * chunk :]
        return rows

    def _follow_layout(self, key, rank: int, world: int, numel: int) -> None:
        """Lay `key`'s residuals out for this group if they were for another ([Note: quantised
        residuals after a regroup])."""
        was = self.layouts.get(key)
        self.layouts[key] = torch.tensor([rank, world])
        if was is None or was.tolist() == [rank, world]:
            return
        old_rank, old_world = was.tolist()
        send = self.feedback.residuals.pop((key, "send"), None)
        gather = self.feedback.residuals.pop((key, "gather"), None)
        if send is None and gather is None:
            return
        device = (send if send is not None else gather).device
        flat = torch.zeros(numel, dtype=torch.float32, device=device)
        old_chunk = -(-numel // old_world)
        if send is not None:
            flat += send[:, :old_chunk].reshape(-1)[:numel]
        if gather is not None:
            begin = min(numel, old_rank * old_chunk)
            end = min(numel, begin + old_chunk)
            flat[begin:end] += gather[0, : end - begin]
        self.feedback.keep((key, "send"), self._rows(flat, world, self._padded(numel, world)))

    def state_tensors(self) -> list[torch.Tensor]:
        return self.feedback.tensors()

    def stores(self) -> dict[str, dict]:
        """The per-key state a checkpoint keeps (see `feedback.keyed_tensors`)."""
        return {"residual": self.feedback.residuals, "layout": self.layouts}
