"""KV cache for prefill/decode, and the key-space bookkeeping shared with training.

Only the base stream writes K/V, so the cache is exactly the per-layer base K/V of every token
seen so far (the output stream reads all of it; the base stream itself would only need the last
``W``, and with sink tokens its document's first ``S``). Rows may have different lengths. Nothing
is ever evicted: a row's sink keys are simply its first ``S`` slots (the start of its document in
the key layout below), so sinks cost no memory; a cache trimmed to the window would have to keep
them.

Storage: one preallocated buffer per layer for K and one for V, ``[rows * capacity, Hkv, D]``,
row ``r`` owning slots ``[r * capacity, (r + 1) * capacity)``. Appending writes in place (no
``torch.cat`` of the whole cache per step); when a row outgrows ``capacity`` every buffer is
reallocated geometrically (amortised O(1) per token), or once up front with ``reserve``.

The attention op sees the whole buffer as its keys with one *document per row* spanning the row's
slots (``cu_seqlens = [0, C, 2C, ...]``). A row's unused tail slots sit after every query of that
row, so the causal rule (key index <= query index) keeps them out of every attention: the buffer
is handed to the op as is, with no packing copy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


class KVCache:
    def __init__(self, num_layers: int, num_rows: int, capacity: int = 0, growth: float = 1.5) -> None:
        if num_layers < 1 or num_rows < 1:
            raise ValueError(f"a KV cache needs >= 1 layer and >= 1 row, got {num_layers} and {num_rows}")
        if growth <= 1.0:
            raise ValueError(f"growth must be > 1, got {growth}")
        self.num_layers = num_layers
        self.num_rows = num_rows
        self.capacity = int(capacity)  # slots per row; buffers follow it lazily
        self.growth = growth
        self.k: list[torch.Tensor | None] = [None] * num_layers  # [num_rows * capacity, Hkv, D]
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.lengths = torch.zeros(num_rows, dtype=torch.long)
        self._dest: tuple[tuple[int, ...], tuple[int, ...], torch.Tensor] | None = None
        self._dest_dev: tuple[torch.Tensor, torch.Tensor] | None = None
        # (new_lengths, slots) of the step ``key_space`` prepared; extend() trusts that object
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None

    # -- key layout ---------------------------------------------------------------------------
    def reserve(self, tokens_per_row: int) -> None:
        """Make room for ``tokens_per_row`` tokens in every row (avoids regrowth during decode)."""
        self.capacity = max(self.capacity, int(tokens_per_row))

    def _check(self, new_lengths: torch.Tensor) -> torch.Tensor:
        new_lengths = torch.as_tensor(new_lengths).long().cpu().reshape(-1)
        if new_lengths.numel() != self.num_rows:
            raise ValueError(f"cache has {self.num_rows} rows, the batch has {new_lengths.numel()}")
        if bool((new_lengths < 0).any()):
            raise ValueError("new_lengths must be >= 0")
        return new_lengths

    def _destinations(self, new_lengths: torch.Tensor) -> torch.Tensor:
        """Slot of every new token in packed (row-major) order, for the current capacity."""
        key = (tuple(self.lengths.tolist()), tuple(new_lengths.tolist()))
        if self._dest is not None and self._dest[:2] == key:
            return self._dest[2]
        rows = torch.repeat_interleave(torch.arange(self.num_rows), new_lengths)
        starts = torch.cumsum(new_lengths, 0) - new_lengths
        within = torch.arange(int(new_lengths.sum())) - torch.repeat_interleave(starts, new_lengths)
        dest = rows * self.capacity + self.lengths[rows] + within
        self._dest = (*key, dest)
        return dest

    def key_space(self, new_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Key layout after appending ``new_lengths[b]`` tokens to row b (grows the capacity).

        Returns ``cu_seqlens`` of the keys (one document of ``capacity`` slots per row) and the
        key index of every new token in packed order.
        """
        given, new_lengths = new_lengths, self._check(new_lengths)
        needed = int((self.lengths + new_lengths).max())
        if needed > self.capacity:
            grown = math.ceil(self.capacity * self.growth) if self.capacity else 0
            self.capacity = max(needed, grown)
            self._dest = None
        cu = torch.arange(self.num_rows + 1, dtype=torch.long) * self.capacity
        dest = self._destinations(new_lengths)
        self._pending = (given, dest)
        return cu.to(torch.int32), dest.clone()

    def _buffers(self, layer: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's K/V buffers at the current capacity (allocated or regrown)."""
        k, v = self.k[layer], self.v[layer]
        shape = (self.num_rows * self.capacity, *like.shape[1:])
        if k is not None and tuple(k.shape) == shape:
            return k, v
        new_k = like.new_zeros(shape)
        new_v = like.new_zeros(shape)
        if k is not None:
            if tuple(k.shape[1:]) != tuple(like.shape[1:]):
                raise ValueError(f"layer {layer}: K/V shape changed {tuple(k.shape[1:])} -> {tuple(like.shape[1:])}")
            old_cap = k.shape[0] // self.num_rows
            keep = min(old_cap, self.capacity)
            for new, old in ((new_k, k), (new_v, v)):
                new.view(self.num_rows, self.capacity, *shape[1:])[:, :keep] = old.view(
                    self.num_rows, old_cap, *shape[1:]
                )[:, :keep]
        self.k[layer], self.v[layer] = new_k, new_v
        return new_k, new_v

    def extend(
        self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor, new_lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write one layer's new K/V ([sum(new_lengths), Hkv, D]) in place; return the whole buffers.

        Call ``key_space`` first (it fixes the capacity); the returned keys match its layout.
        Passing the very ``new_lengths`` tensor given to ``key_space`` (as the model does for
        every layer) reuses its checks and slots: a layer's write then reads no tensor value.
        """
        pending = self._pending
        if pending is not None and new_lengths is pending[0]:
            dest = pending[1]
            if k_new.shape[0] != dest.numel() or v_new.shape != k_new.shape:
                raise ValueError(f"k_new/v_new must hold {dest.numel()} tokens, got {tuple(k_new.shape)}")
        else:
            new_lengths = self._check(new_lengths)
            if int((self.lengths + new_lengths).max()) > self.capacity:
                raise ValueError("extend() past the cache capacity: call key_space() for this step first")
            if k_new.shape[0] != int(new_lengths.sum()) or v_new.shape != k_new.shape:
                raise ValueError(f"k_new/v_new must hold {int(new_lengths.sum())} tokens, got {tuple(k_new.shape)}")
            dest = self._destinations(new_lengths)
        k, v = self._buffers(layer, k_new)
        if dest.device != k.device:  # one host-to-device copy per step, shared by all layers
            if self._dest_dev is None or self._dest_dev[0] is not dest:
                self._dest_dev = (dest, dest.to(k.device))
            dest = self._dest_dev[1]
        k.index_copy_(0, dest, k_new.to(k.dtype))
        v.index_copy_(0, dest, v_new.to(v.dtype))
        return k, v

    def advance(self, new_lengths: torch.Tensor) -> None:
        """Record that every layer now holds the new tokens (call once per forward)."""
        self.lengths = self.lengths + self._check(new_lengths)
        self._dest = None
        self._pending = None

    def set_lengths(self, lengths: torch.Tensor) -> None:
        """Record row lengths written elsewhere (a decode step that kept them on the device)."""
        lengths = self._check(lengths)
        if int(lengths.max()) > self.capacity:
            raise ValueError(f"lengths {lengths.tolist()} exceed the capacity {self.capacity}")
        self.lengths = lengths.clone()
        self._dest = None
        self._pending = None

    def clone(self, capacity: int | None = None) -> "KVCache":
        """An independent copy (optionally with more capacity per row)."""
        other = KVCache(self.num_layers, self.num_rows, self.capacity, self.growth)
        other.lengths = self.lengths.clone()
        other.k = [None if t is None else t.clone() for t in self.k]
        other.v = [None if t is None else t.clone() for t in self.v]
        if capacity is not None and capacity > self.capacity:
            other.capacity = int(capacity)
            for layer, t in enumerate(other.k):
                if t is not None:
                    other._buffers(layer, t)
        return other

    # -- views and accounting -----------------------------------------------------------------
    def select(self, rows: Sequence[int] | torch.Tensor) -> "KVCacheRows":
        """A view on some rows (sorted, unique) that the model can run on; writes go to this cache."""
        return KVCacheRows(self, rows)

    def token_bytes(self) -> int:
        """Bytes one token occupies across all layers (K and V), 0 before the first write."""
        return sum(2 * t[0].numel() * t.element_size() for t in self.k if t is not None and t.numel())

    def nbytes(self) -> int:
        """Bytes of K/V actually held (tokens x bytes per token), excluding spare capacity."""
        return int(self.lengths.sum()) * self.token_bytes()

    def allocated_nbytes(self) -> int:
        """Bytes of the buffers, spare capacity included."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None)

    def bytes_per_token(self) -> float:
        tokens = int(self.lengths.sum())
        return self.nbytes() / tokens if tokens else 0.0

    def row(self, layer: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of row ``r`` in ``layer`` ([length, Hkv, D] views)."""
        k, v = self.k[layer], self.v[layer]
        n = int(self.lengths[r])
        if k is None:
            raise ValueError("the cache is empty")
        start = r * self.capacity
        return k[start : start + n], v[start : start + n]


class KVCacheRows:
    """Some rows of a ``KVCache``, presented to the model as a cache of their own.

    Lets a batch continue only its unfinished rows (ragged chunked prefill, decode after a row
    stopped) without copying: the other rows simply get no new tokens.
    """

    def __init__(self, parent: KVCache, rows: Sequence[int] | torch.Tensor) -> None:
        rows = torch.as_tensor(rows, dtype=torch.long).reshape(-1).cpu()
        if rows.numel() == 0:
            raise ValueError("select() needs at least one row")
        if bool((rows[1:] <= rows[:-1]).any()) or int(rows.min()) < 0 or int(rows.max()) >= parent.num_rows:
            raise ValueError(f"rows must be sorted, unique and in [0, {parent.num_rows}), got {rows.tolist()}")
        self.parent = parent
        self.rows = rows
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def num_rows(self) -> int:
        return self.rows.numel()

    @property
    def num_layers(self) -> int:
        return self.parent.num_layers

    @property
    def lengths(self) -> torch.Tensor:
        return self.parent.lengths[self.rows]

    def _full(self, new_lengths: torch.Tensor) -> torch.Tensor:
        # the same object for the same step, so the parent's extend() recognises key_space's step
        if self._last is not None and self._last[0] is new_lengths:
            return self._last[1]
        given = new_lengths
        new_lengths = torch.as_tensor(new_lengths).long().cpu().reshape(-1)
        if new_lengths.numel() != self.num_rows:
            raise ValueError(f"this view has {self.num_rows} rows, the batch has {new_lengths.numel()}")
        full = torch.zeros(self.parent.num_rows, dtype=torch.long)
        full[self.rows] = new_lengths
        self._last = (given, full)
        return full

    def key_space(self, new_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.parent.key_space(self._full(new_lengths))

    def extend(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor, new_lengths: torch.Tensor):
        return self.parent.extend(layer, k_new, v_new, self._full(new_lengths))

    def advance(self, new_lengths: torch.Tensor) -> None:
        self.parent.advance(self._full(new_lengths))

    def nbytes(self) -> int:
        return int(self.lengths.sum()) * self.parent.token_bytes()

    def bytes_per_token(self) -> float:
        return self.parent.bytes_per_token()
