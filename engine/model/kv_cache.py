"""A preallocated key/value cache: one row per sequence slot, each with its own length.

Rolling back a sequence only shortens its length: entries past it are never read (the attention
mask stops at each query's own position) and are overwritten by the next forward.
"""

from __future__ import annotations

import math

import torch


class CacheFullError(RuntimeError):
    """No free slot, or a sequence would grow past max_seq_len."""


class KVCache:
    def __init__(
        self,
        num_layers: int,
        max_batch_size: int,
        max_seq_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        transposed_keys: bool = False,
    ) -> None:
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        # One spare position per row: padded tokens of a ragged batch write there (`scratch_pos`).
        shape = (num_layers, max_batch_size, max_seq_len + 1, num_kv_heads, head_dim)
        # The compiled CPU forward (engine/native/) reads keys position-minor, [layers, slots,
        # kv heads, head_dim, positions rounded up to 64], so that scores are a product of tiles
        # with no transposition per forward; `keys` views either layout the same way. It reads
        # values 64 at a time, so a head narrower than that may read up to 64 past the last one.
        self.transposed_keys = transposed_keys
        if transposed_keys:
            positions = -(-(max_seq_len + 1) // 64) * 64
            key_shape = (num_layers, max_batch_size, num_kv_heads, head_dim, positions)
            self.k = torch.zeros(key_shape, dtype=dtype, device=device)
            values = torch.zeros(math.prod(shape) + 64, dtype=dtype, device=device)
            self.v = values[: math.prod(shape)].view(shape)
        else:
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = [0] * max_batch_size
        self._free = list(range(max_batch_size - 1, -1, -1))

    def keys(self, slot: int) -> torch.Tensor:
        """The keys of `slot`, [layers, positions, kv heads, head_dim], whatever the layout."""
        return self.k[:, slot].permute(0, 3, 1, 2) if self.transposed_keys else self.k[:, slot]

    @property
    def scratch_pos(self) -> int:
        return self.max_seq_len

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def allocate(self) -> int:
        if not self._free:
            raise CacheFullError(f"all {self.max_batch_size} cache slots are in use")
        slot = self._free.pop()
        self.lengths[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        if slot in self._free:
            raise ValueError(f"slot {slot} is already free")
        self.lengths[slot] = 0
        self._free.append(slot)

    def truncate(self, slot: int, length: int) -> None:
        """Forget everything after the first `length` tokens of `slot` (O(1))."""
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"cannot truncate slot {slot} of length {self.lengths[slot]} to {length}")
        self.lengths[slot] = length

    def rollback(self, slot: int, n: int) -> None:
        self.truncate(slot, self.lengths[slot] - n)
