"""Decode steps a CUDA graph can replay: one batch, one cache capacity, the lengths on the device.

The eager step (``generate.decode``) plans on the host: it builds a decode layout, asks the
cache for the new tokens' slots and hands every layer host-known counts, so each token costs a
host round trip plus one launch per op (~1000 at 24 layers), and a GPU decode is launch-bound.
Here the step's whole state lives in device buffers that never move:

* ``StaticRows``: the ``KVCache``'s own buffers at their capacity ``C``; each row's length (the
  position of its next token), the slot that token writes and whether the row still runs are
  device tensors the step updates in place (``lengths += active``);
* ``StaticDecodePlan``: the model's ``AttentionPlan`` over those buffers (positions = lengths),
  whose attention is ``ops/decode_rows.py`` — every slot of every row, masked by the lengths, on
  the flash-decoding kernel with its grid sized by ``C`` (on CPU: one masked SDPA);
* ``StaticDecoder``: runs that plan through the unchanged model; with ``graph=True`` (CUDA) it
  captures the step once and replays it for every later token.

A step does the same ops on the same shapes whatever the lengths, and reads nothing back
(tests/test_static_decode.py records the ops of two steps on CPU and compares them). Rows that
finished stay in the batch and stop advancing (their slot keeps what it holds, and their query
stays inside their row even when it is full); the caller samples only the rows it still runs, so
the tokens and the sampling generator's draws are those of the eager loop.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from orthros_train.errors import UserError
from orthros_train.model.cache import KVCache
from orthros_train.model.orthros import AttentionPlan, ModuleFactory, OrthrosForCausalLM
from orthros_train.ops.decode_rows import decode_rows_torch, decode_rows_triton
from orthros_train.ops.keys import UNBOUNDED

log = logging.getLogger(__name__)

WARMUP_STEPS = 2  # eager runs before capture: Triton compiles and cuBLAS picks its kernels there


def check_static_decode(model: torch.nn.Module) -> None:
    """Refuse the models a static step cannot serve, naming why and what to do instead."""
    if not isinstance(model, OrthrosForCausalLM):
        raise UserError(f"cuda_graph decoding needs an OrthrosForCausalLM, got {type(model).__name__}")
    if type(model.factory) is not ModuleFactory:
        raise UserError("cuda_graph decoding runs the single-device model; a tensor/context-parallel model "
                        "decodes eagerly (leave cuda_graph off)")  # fmt: skip
    if model.config.num_experts:
        raise UserError("cuda_graph decoding does not cover mixture-of-experts models: their token dispatch "
                        "sizes its buffers on the host every step; leave cuda_graph off")  # fmt: skip


class StaticRows:
    """The cache as a static step writes it (the interface the model's attention calls)."""

    def __init__(self, cache: KVCache, device: torch.device) -> None:
        rows, capacity = cache.num_rows, cache.capacity
        if any(t is None or t.shape[0] != rows * capacity for t in (*cache.k, *cache.v)):
            raise ValueError("a static decode step needs a prefilled cache whose buffers hold its capacity")
        self.cache, self.capacity = cache, capacity
        self.lengths = cache.lengths.to(device).clone()  # position of each row's next token
        self.active = torch.ones(rows, dtype=torch.long, device=device)  # 1: the row advances
        self.row_starts = torch.arange(rows, device=device) * capacity
        # the position each row's query sits at: its length, kept inside the row for a finished
        # row that filled it (length C), so its query reads its own slots and not the next row's
        self.positions = torch.empty_like(self.lengths)
        self.dest = torch.empty_like(self.lengths)  # the slot each row's new token writes
        self.refresh()
        self.host_lengths = cache.lengths.clone()  # mirrored on the host from the active rows, no sync

    def refresh(self) -> None:
        """Positions and slots of this step's tokens (in place: a captured graph reads these buffers)."""
        torch.clamp(self.lengths, max=self.capacity - 1, out=self.positions)
        torch.add(self.row_starts, self.positions, out=self.dest)

    def extend(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor, new_lengths: torch.Tensor):
        """Write the running rows' keys and values; a finished row's slot keeps what it holds (a
        row that filled its capacity sits on its last real token)."""
        k, v = self.cache.k[layer], self.cache.v[layer]
        running = self.active.view(-1, *(1,) * (k_new.dim() - 1)).bool()
        k.index_copy_(0, self.dest, torch.where(running, k_new.to(k.dtype), k.index_select(0, self.dest)))
        v.index_copy_(0, self.dest, torch.where(running, v_new.to(v.dtype), v.index_select(0, self.dest)))
        return k, v

    def advance(self, new_lengths: torch.Tensor) -> None:
        self.lengths.add_(new_lengths)


@dataclass
class StaticDecodePlan(AttentionPlan):
    """One token per row at the device-held lengths, keys = every slot of the row's buffer."""

    capacity: int = 0
    kernel: bool = False  # ops/decode_rows.py's Triton op (else plain torch)

    def reset(self) -> None:
        """Drop what the previous step's layers cached (this step recomputes it on the device)."""
        self.attention_meta.clear()
        self.router_losses.clear()

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, with_base: bool,
               backend: str = "auto") -> torch.Tensor:  # fmt: skip
        windows = ((self.base_window,) if with_base else ()) + ((UNBOUNDED,) if self.num_outputs else ())
        op = decode_rows_triton if self.kernel else decode_rows_torch
        return op(q, k, v, self.base_positions, self.capacity, windows, self.sink_tokens)


def static_plan(model: OrthrosForCausalLM, rows: StaticRows, ids: torch.Tensor, kernel: bool) -> StaticDecodePlan:
    """The plan of a step over ``rows`` reading its tokens from ``ids``."""
    config, n = model.config, rows.lengths.numel()
    outputs = slice(None) if model.is_orthros else slice(0, 0)  # baselines: no output stream
    return StaticDecodePlan(
        input_ids=ids, output_rows=torch.arange(n, device=ids.device), base_positions=rows.positions,
        out_positions=rows.positions[outputs], base_key_index=rows.dest, out_key_index=rows.dest[outputs],
        key_cu_seqlens=(torch.arange(n + 1, device=ids.device) * rows.capacity).to(torch.int32),
        base_window=config.key_rule.decode_window, sink_tokens=config.base_sink_tokens, new_lengths=rows.active,
        capacity=rows.capacity, kernel=kernel,
    )  # fmt: skip


def uses_kernel(model: OrthrosForCausalLM, device: torch.device) -> bool:
    """The Triton op on CUDA (the fast and graph-safe one) and where the model names a Triton
    backend (the interpreter on CPU, as the tests run it); plain torch otherwise."""
    from orthros_train.ops.attention import available_backends

    if "triton" not in available_backends():
        return False
    return device.type == "cuda" or model.config.attention_backend.startswith("triton")


class StaticDecoder:
    """Decode steps over a prefilled ``cache`` at its capacity; ``graph``: capture on CUDA.

    ``step(rows, next_ids)`` appends ``next_ids`` to ``rows`` (the rows still running, as in
    ``generate.decode``) and returns their logits. ``close()`` hands the lengths back to the cache.
    """

    def __init__(self, model: OrthrosForCausalLM, cache: KVCache, graph: bool = False) -> None:
        check_static_decode(model)
        device = next(model.parameters()).device
        if graph and device.type != "cuda":
            raise ValueError(f"a CUDA graph needs a CUDA model, this one is on {device}")
        self.model, self.graph = model, graph
        self.rows = StaticRows(cache, device)
        self.ids = torch.zeros(cache.num_rows, dtype=torch.long, device=device)
        self.plan = static_plan(model, self.rows, self.ids, uses_kernel(model, device))
        self.running: tuple[int, ...] = tuple(range(cache.num_rows))
        self._running_index = torch.arange(cache.num_rows, device=device)  # self.running on the device
        self._graph: torch.cuda.CUDAGraph | None = None
        self._logits: torch.Tensor | None = None

    @torch.no_grad()
    def _forward(self) -> torch.Tensor:
        self.plan.reset()
        self.rows.refresh()
        return self.model.logits_of_plan(self.plan, self.rows)

    def _set_rows(self, rows: Sequence[int]) -> torch.Tensor:
        rows = tuple(int(r) for r in rows)
        if rows != self.running:  # a row finished: it stops advancing
            if not rows or any(r not in self.running for r in rows):
                raise ValueError(f"rows {rows} are not a subset of the running rows {self.running}")
            mask = torch.zeros(self.ids.numel(), dtype=torch.long)
            mask[list(rows)] = 1
            self.rows.active.copy_(mask.to(self.ids.device))
            self.running = rows
            # copied to the device only when the rows change: a copy from pageable host memory
            # per token would wait for the device every step
            self._running_index = torch.tensor(rows, dtype=torch.long).to(self.ids.device)
        lengths = self.rows.host_lengths[list(rows)]
        if int(lengths.max()) >= self.rows.capacity:
            raise ValueError(f"a row is full: the cache holds {self.rows.capacity} tokens per row")
        return self._running_index

    def step(self, rows: Sequence[int], next_ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[len(rows), V]`` after appending ``next_ids`` to ``rows``."""
        index = self._set_rows(rows)
        self.ids.index_copy_(0, index, next_ids.reshape(-1).to(self.ids.device, torch.long))
        if not self.graph:
            logits = self._forward()
        else:
            if self._graph is None:
                self.capture()
            self._graph.replay()
            logits = self._logits
        self.rows.host_lengths[list(self.running)] += 1
        return logits[index]

    def capture(self) -> None:
        """Warm up on a side stream (no row advances: the writes land on the slots the real step
        writes next), then capture one step; the first ``step`` does it when not called before
        (a benchmark calls it first, so no timed step includes the capture). No-op without graph."""
        if not self.graph or self._graph is not None:
            return
        active = self.rows.active.clone()
        self.rows.active.zero_()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_STEPS):
                self._forward()
        torch.cuda.current_stream().wait_stream(stream)
        self.rows.active.copy_(active)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = self._forward()
        self._graph, self._logits = graph, logits  # kept only once captured: a failed capture is retried
        log.info("decode step captured in a CUDA graph: %d rows x %d slots", self.ids.numel(), self.rows.capacity)

    def close(self) -> None:
        """Give the cache its lengths back (the eager path and its accounting read them)."""
        self.rows.cache.set_lengths(self.rows.host_lengths)
        self._graph = None
        self._logits = None


__all__ = ["StaticDecodePlan", "StaticDecoder", "StaticRows", "check_static_decode", "static_plan"]
