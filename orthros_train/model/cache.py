"""KV cache for prefill/decode, and the key-space bookkeeping shared with training.

Only the base stream writes K/V, so the cache is exactly the per-layer base K/V of every token
seen so far (the output stream reads all of it). Rows may have different lengths.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, num_rows: int) -> None:
        self.num_layers = num_layers
        self.num_rows = num_rows
        self.k: list[list[torch.Tensor | None]] = [[None] * num_rows for _ in range(num_layers)]
        self.v: list[list[torch.Tensor | None]] = [[None] * num_rows for _ in range(num_layers)]
        self.lengths = torch.zeros(num_rows, dtype=torch.long)

    def key_space(self, new_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Key layout after appending ``new_lengths[b]`` tokens to row b.

        Returns ``cu_seqlens`` of the keys (one document per row: cache then new tokens) and the
        key index of every new token in packed order.
        """
        new_lengths = new_lengths.long().cpu()
        if new_lengths.numel() != self.num_rows:
            raise ValueError(f"cache has {self.num_rows} rows, the batch has {new_lengths.numel()}")
        totals = self.lengths + new_lengths
        cu = torch.zeros(self.num_rows + 1, dtype=torch.long)
        cu[1:] = torch.cumsum(totals, 0)
        index = torch.cat([torch.arange(int(cu[r] + self.lengths[r]), int(cu[r + 1])) for r in range(self.num_rows)])
        return cu.to(torch.int32), index

    def extend(
        self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor, new_lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append one layer's new K/V ([sum(new_lengths), Hkv, D]); return all keys packed by row."""
        sizes = [int(n) for n in new_lengths]
        ks, vs = [], []
        for r, (kr, vr) in enumerate(zip(k_new.split(sizes), v_new.split(sizes))):
            old_k, old_v = self.k[layer][r], self.v[layer][r]
            self.k[layer][r] = kr if old_k is None else torch.cat([old_k, kr])
            self.v[layer][r] = vr if old_v is None else torch.cat([old_v, vr])
            ks.append(self.k[layer][r])
            vs.append(self.v[layer][r])
        return torch.cat(ks), torch.cat(vs)

    def advance(self, new_lengths: torch.Tensor) -> None:
        """Record that every layer now holds the new tokens (call once per forward)."""
        self.lengths = self.lengths + new_lengths.long().cpu()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.k + self.v for t in layer if t is not None)

    def bytes_per_token(self) -> float:
        tokens = int(self.lengths.sum())
        return self.nbytes() / tokens if tokens else 0.0
