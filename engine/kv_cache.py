"""A preallocated key/value cache: one row per sequence slot, each with its own length.

Rolling back a sequence only shortens its length: entries past it are never read (the attention
mask stops at each query's own position) and are overwritten by the next forward.
"""

from __future__ import annotations

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
    ) -> None:
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        # One spare position per row: padded tokens of a ragged batch write there (`scratch_pos`).
        shape = (num_layers, max_batch_size, max_seq_len + 1, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = [0] * max_batch_size
        self._free = list(range(max_batch_size - 1, -1, -1))

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
