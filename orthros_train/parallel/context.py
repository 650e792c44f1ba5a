"""Context parallelism: one packed sequence split across the ranks of the CP group.

Chunk order (load balance for the causal output stream): the sequence, padded to a multiple of
``2 * cp``, is cut into ``2 * cp`` equal chunks and rank ``r`` holds chunks ``r`` and
``2 * cp - 1 - r``. The unbounded output stream costs more the later its position; one early
and one late chunk per rank evens that out (megatron-core and Llama 3 use the same order).

Attention of the queries of one local chunk ``c = [s, e)``:

* windowed queries (the base stream, window ``W``) need the keys ``[s - (W - 1), e)``: the chunk
  itself and a *halo* of the ``W - 1`` keys before it, which other ranks hold. Each rank puts
  the tails of its two chunks into one all-gather, so per query only ``W`` keys are moved and
  scored and the base stream stays linear in the sequence length;
* unbounded queries (the output stream; also the dense baseline's base stream) attend the
  local chunk and the past ``[0, s)`` in two calls of the attention op, merged exactly through
  their log-sum-exp. The past comes from an all-gather of every rank's chunks; queries whose
  document starts inside the chunk skip the past call;
* sink tokens (``sink_tokens = S``): a windowed query whose window no longer reaches its
  document's first ``S`` keys also attends them, as a third partial over a compact *sink key
  space* (the first ``S`` keys of every document longer than ``W``, ``S`` keys per such document,
  wherever they live), merged into the window partial by LSE. When the output stream already
  all-gathers every key, the sink keys are rows of that gather (no extra traffic); otherwise
  (the sliding baseline, layouts without output tokens) they come from a gather of just those
  rows, so the base stream stays linear: ``S`` keys per long document, never the sequence.

The all-gathers are megatron-core's ``gather_from_sequence_parallel_region`` on the CP group:
its backward is a reduce-scatter, so each rank gets back the gradient of its own K/V summed over
every rank that attended it. Everything else is plain autograd (the attention op returns a
differentiable LSE, which the merge needs).

Every CP rank receives the same full layout (token ids are cheap even at 128K); ``ContextPlan``,
a specialisation of the model's ``AttentionPlan``, picks this rank's tokens out of it. Loss
tokens are counted over the whole layout, so the loss every rank reports is the loss of the
whole sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from orthros_train.model.config import OrthrosConfig
from orthros_train.model.orthros import AttentionPlan, global_queries
from orthros_train.ops.attention import UNBOUNDED, prepare_attention, resolve_backend
from orthros_train.ops.keys import key_ranges, sink_queries
from orthros_train.ops.reference import merge_partial_attention
from orthros_train.parallel import collectives
from orthros_train.phase.layout import OrthrosLayout

GatherFn = Callable[[torch.Tensor], torch.Tensor]


def chunk_owner(chunk: int, cp: int) -> tuple[int, int]:
    """(rank, slot) holding ``chunk`` in the load-balanced order (slot 0: early, 1: late)."""
    return (chunk, 0) if chunk < cp else (2 * cp - 1 - chunk, 1)


def clip_cu_seqlens(cu: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Document boundaries of the key range ``[lo, hi)``, shifted to start at 0."""
    inner = cu[(cu > lo) & (cu < hi)]
    return torch.cat([cu.new_tensor([lo]), inner, cu.new_tensor([hi])]) - lo


@dataclass(kw_only=True)
class ContextPlan(AttentionPlan):
    """This CP rank's share of a packed layout: an ``AttentionPlan`` whose tokens are the local
    ones and whose attention, targets, loss and logits know about the other ranks.

    Local base stream: the tokens of chunk ``r`` then chunk ``2cp-1-r``. Local output stream:
    the output tokens whose position lies in those chunks, in the same order. Key indices
    (``base_key_index``, ``out_key_index``) and ``key_cu_seqlens`` refer to the padded sequence.
    """

    cp: int
    rank: int
    chunk_len: int
    output_select: torch.Tensor  # [N_local] which entries of layout.output_index are local
    has_outputs: bool  # whether any rank has output queries (collectives must match)
    gather: GatherFn | None = None  # autograd all-gather over the CP group along dim 0 (rank-major)
    # Host copies, so attention never reads a device value: the output tokens held in each
    # local chunk and the document boundaries. ``_meta`` keeps what the first layer derives
    # from them (per-chunk clips, the attention op's prepared metadata) for the later layers.
    slot_outputs: tuple[int, int] = (0, 0)
    host_cu_seqlens: torch.Tensor | None = None
    # The global tail (``ops/keys.py``): each slot's base rows (relative to the slot) whose query
    # sees its whole document; ``any_global``: whether any rank has one (collectives must match).
    global_rows: tuple[torch.Tensor, torch.Tensor] | None = None
    any_global: bool = False
    _meta: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def chunks(self) -> tuple[int, int]:
        return self.rank, 2 * self.cp - 1 - self.rank

    def output_targets(self, layout: OrthrosLayout) -> tuple[torch.Tensor, torch.Tensor]:
        return layout.labels[self.output_select], layout.loss_weights[self.output_select]

    def whole_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss of the whole sequence as its value, ``cp`` x this rank's share as its gradient.

        Every CP rank then reports (and NaN-checks) the same loss, and DeepSpeed, which averages
        gradients over the data x context parallel group, ends with the gradient of the whole
        sequence's loss: the mean over CP ranks of ``cp`` x each rank's share is their sum.
        """
        total = collectives.all_reduce(loss.detach().clone(), group=self._group())
        return total + self.cp * (loss - loss.detach())

    def whole_logits(self, logits: torch.Tensor, layout: OrthrosLayout) -> torch.Tensor:
        """Every CP rank's output-token logits back in layout order (for eval and tests, no grad)."""
        counts = [output_select(layout, r, self.cp) for r in range(self.cp)]
        width = max(c.numel() for c in counts)
        padded = logits.new_zeros(width, *logits.shape[1:])
        padded[: logits.shape[0]] = logits.detach()
        parts = collectives.all_gather(padded, group=self._group())
        full = logits.new_empty(layout.num_outputs, *logits.shape[1:])
        for select, part in zip(counts, parts):
            full[select] = part[: select.numel()]
        return full

    @staticmethod
    def _group():
        from megatron.core import parallel_state

        return parallel_state.get_context_parallel_group()

    # -- attention -------------------------------------------------------------------------
    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, with_base: bool, backend: str = "auto"
    ) -> torch.Tensor:
        """Attention of the local queries (``[base; output]`` or output only) over all keys.

        ``k``/``v`` are this rank's base-stream keys ``[T_local, Hkv, D]``; the other ranks' come
        through ``self.gather``.
        """
        if self.gather is None:
            raise ValueError("a ContextPlan needs its CP all-gather (context_plan(..., gather=...))")
        gather = self.gather
        op = self._op(backend, with_base)
        _, q_global, _ = self.queries(with_base)
        kv = torch.cat([k, v], dim=1)  # one collective for both
        h_kv = k.shape[1]
        halo = self._gather_halo(kv, gather) if with_base and self.base_window < UNBOUNDED else None
        full = (self._gather_full(kv, gather)
                if self.has_outputs or self.any_global or self.base_window >= UNBOUNDED else None)  # fmt: skip
        sinks = self._sink_meta(q.device) if with_base and self.base_window < UNBOUNDED and self.sink_tokens else None
        sink_kv = None
        if sinks is not None:
            # Rows of the full gather when the output stream made one anyway; else a gather of the
            # sink rows alone (every rank takes this branch or none: it depends on the layout only).
            sink_kv = full[sinks["full_index"]] if full is not None else self._gather_sinks(kv, gather, sinks)
        out = q.new_zeros(q.shape)
        # Local queries: base tokens of slot 0 then slot 1 (chunk_len each), then the output
        # tokens of slot 0 then slot 1: every chunk's rows are ranges known on the host.
        n_base = self.chunk_len * 2 if with_base else 0
        dense_base = with_base and self.base_window >= UNBOUNDED
        out_start = (n_base, n_base + self.slot_outputs[0])
        for slot, chunk in enumerate(self.chunks):
            s, e = chunk * self.chunk_len, (chunk + 1) * self.chunk_len
            local_kv = kv[slot * self.chunk_len : (slot + 1) * self.chunk_len]
            base_rows = (slot * self.chunk_len, (slot + 1) * self.chunk_len) if with_base else (0, 0)
            if with_base and not dense_base:
                rows = torch.arange(*base_rows, device=q.device)
                keys = torch.cat([halo[chunk], local_kv]) if halo is not None else local_kv
                lo = e - keys.shape[0]
                # every base row takes the window here; the global ones are computed again below
                # over the whole past and replace these rows
                o, lse = op(
                    ("halo", slot), q[rows], *keys.split(h_kv, dim=1), q_global[rows] - lo,
                    torch.full_like(rows, self.base_window), self._clip(lo, e, q.device),
                    rows.numel() if self.base_window <= keys.shape[0] else 0,
                )
                if sinks is not None and sinks["rows"][slot].numel():
                    o = self._merge_sinks(op, slot, q, o, lse, sink_kv, sinks, h_kv)
                out = out.index_copy(0, rows, o)
            spans = [(out_start[slot], out_start[slot] + self.slot_outputs[slot])]
            if dense_base:
                spans.insert(0, base_rows)
            global_rows = self.global_rows[slot] + slot * self.chunk_len if with_base and self.global_rows else None
            if sum(b - a for a, b in spans) or (global_rows is not None and global_rows.numel()):
                rows = torch.cat([torch.arange(a, b, device=q.device) for a, b in spans])
                if global_rows is not None:
                    rows = torch.cat([global_rows, rows])
                out = out.index_copy(
                    0, rows, self._unbounded(op, slot, q, rows, q_global, local_kv, full, s, e, h_kv)
                )
        return out

    def _sink_meta(self, device: torch.device) -> dict | None:
        """The sink partial's bookkeeping, from host copies once per forward (``None``: no
        document is longer than the window, so no query lacks a sink key and S > 0 is S = 0).

        ``rows[slot]``: the slot's base rows (relative to the slot) whose window misses sink
        keys; ``index``/``window``: those queries in the compact sink key space (``cu``: S keys
        per document longer than W); ``full_index``: the sink keys' rows of the full sequence;
        ``gather_index``: their rows in a gather of every rank's sink rows (``local_rows`` each,
        ``width`` rows per rank).
        """
        if "sinks" in self._meta:
            return self._meta["sinks"]
        cu = self.host_cu_seqlens.long()
        lengths = cu[1:] - cu[:-1]
        long_docs = torch.nonzero(lengths > self.base_window).flatten()
        if long_docs.numel() == 0:
            self._meta["sinks"] = None
            return None
        s_tok, w = self.sink_tokens, self.base_window
        starts = cu[long_docs]
        # Sink keys in sequence order, S per long document (S < W < its length); compact offsets.
        full_index = (starts[:, None] + torch.arange(s_tok)[None, :]).flatten()
        offset = torch.full((cu.numel() - 1,), -1, dtype=torch.long)
        offset[long_docs] = torch.arange(long_docs.numel()) * s_tok
        rows, index, window = [], [], []
        for chunk in self.chunks:
            q_global = torch.arange(chunk * self.chunk_len, (chunk + 1) * self.chunk_len)
            r, s_index, s_window = sink_queries(q_global, torch.full_like(q_global, w), cu, s_tok)
            doc = torch.searchsorted(cu, s_index, right=True) - 1
            rows.append(r.to(device))
            index.append((offset[doc] + s_index - cu[doc]).to(device))
            window.append(s_window.to(device))
        # Which rank holds each sink key, at which local row: the gather of every rank's sink rows.
        owner_rank, owner_row = [], []
        for key in full_index.tolist():
            chunk = key // self.chunk_len
            r, slot = chunk_owner(chunk, self.cp)
            owner_rank.append(r)
            owner_row.append(slot * self.chunk_len + key % self.chunk_len)
        owner_rank_t, owner_row_t = torch.tensor(owner_rank), torch.tensor(owner_row)
        local_rows = [owner_row_t[owner_rank_t == r] for r in range(self.cp)]
        width = max(x.numel() for x in local_rows)
        rank_pos = torch.zeros_like(owner_rank_t)  # position of each key among its rank's sink rows
        for r in range(self.cp):
            rank_pos[owner_rank_t == r] = torch.arange(local_rows[r].numel())
        meta = {
            "rows": rows,
            "index": index,
            "window": window,
            "cu": (torch.arange(long_docs.numel() + 1) * s_tok).to(device=device, dtype=torch.int32),
            "full_index": full_index.to(device),
            "local_rows": local_rows[self.rank].to(device),
            "width": width,
            "gather_index": (owner_rank_t * width + rank_pos).to(device),
        }
        self._meta["sinks"] = meta
        return meta

    def _gather_sinks(self, kv: torch.Tensor, gather: GatherFn, sinks: dict) -> torch.Tensor:
        """The sink keys ``[S * long documents, 2 Hkv, D]`` from a gather of each rank's sink rows
        (padded to the same count on every rank); the backward sums their gradients back."""
        mine = kv[sinks["local_rows"]]
        pad = sinks["width"] - mine.shape[0]
        if pad:
            mine = torch.cat([mine, mine.new_zeros(pad, *mine.shape[1:])])
        return gather(mine)[sinks["gather_index"]]

    def _merge_sinks(self, op, slot, q, o, lse, sink_kv, sinks, h_kv) -> torch.Tensor:
        """The slot's window partial ``o``/``lse`` merged with the sink partial of its rows
        that lack sink keys."""
        rows = sinks["rows"][slot]
        base = slot * self.chunk_len
        o_s, lse_s = op(
            ("sink", slot), q[rows + base], *sink_kv.split(h_kv, dim=1), sinks["index"][slot],
            sinks["window"][slot], sinks["cu"], rows.numel(),
        )
        merged, _ = merge_partial_attention(o[rows], lse[:, rows], o_s, lse_s)
        return o.index_copy(0, rows, merged)

    def _clip(self, lo: int, hi: int, device: torch.device) -> torch.Tensor:
        """``clip_cu_seqlens`` of the keys ``[lo, hi)``, from the host copy, once per forward."""
        if ("clip", lo, hi) not in self._meta:
            clipped = clip_cu_seqlens(self.host_cu_seqlens, lo, hi)
            self._meta["clip", lo, hi] = clipped.to(device=device, dtype=torch.int32)
        return self._meta["clip", lo, hi]

    def _op(self, backend: str, with_base: bool):
        """The attention op for one call site: ``op(site, q, k, v, q_index, q_window, cu, n_band)``.

        The first layer prepares the backend's metadata of each call site (its queries and keys
        are the same in every layer) and the later layers reuse it; ``n_band`` is the host count
        of windowed queries (``None``: mixed, unknown).
        """

        def run(site, q, k, v, q_index, q_window, cu, n_band):
            key = ("prepared", site, with_base, backend)
            if key not in self._meta:
                self._meta[key] = prepare_attention(
                    q_index, q_window, cu, k.shape[0], backend, need_lse=True, n_band=n_band
                )
            prepared = self._meta[key]
            fn = resolve_backend(backend, q.device)
            if prepared is None or prepared.fn is not fn:
                return fn(q, k, v, q_index, q_window, cu)
            return fn(q, k, v, q_index, q_window, cu, prepared=prepared.payload)

        return run

    def _unbounded(self, op, slot, q, rows, q_global, local_kv, full, s, e, h_kv) -> torch.Tensor:
        """Queries ``rows`` of chunk ``[s, e)``: local chunk and past, merged by LSE."""
        idx = q_global[rows]
        unbounded = torch.full_like(idx, UNBOUNDED)
        o, lse = op(("local", slot), q[rows], *local_kv.split(h_kv, dim=1), idx - s, unbounded,
                    self._clip(s, e, q.device), 0)
        if s == 0:
            return o
        doc_start, _ = key_ranges(idx, unbounded, self.key_cu_seqlens)  # unbounded: the document start
        sees_past = doc_start < s
        # q_index = s - 1: the last past key, which lies in the query's document because that
        # document starts before s and runs up to the query. Queries whose document starts in
        # this chunk get a window of 1 there and their partial is dropped below: every query
        # runs the same call, so no shape depends on the data.
        past = full[:s]
        o_p, lse_p = op(
            ("past", slot), q[rows], *past.split(h_kv, dim=1), torch.full_like(idx, s - 1),
            torch.where(sees_past, unbounded, torch.ones_like(unbounded)), self._clip(0, s, q.device), None,
        )
        merged, _ = merge_partial_attention(o, lse, o_p, lse_p)
        return torch.where(sees_past[:, None, None], merged, o)

    def _gather_full(self, kv: torch.Tensor, gather: GatherFn) -> torch.Tensor:
        """Every rank's chunks, in sequence order ``[T_padded, 2 Hkv, D]``."""
        per_rank = gather(kv).view(self.cp, 2, self.chunk_len, *kv.shape[1:])
        order = [chunk_owner(c, self.cp) for c in range(2 * self.cp)]
        return torch.cat([per_rank[r, slot] for r, slot in order])

    def _gather_halo(self, kv: torch.Tensor, gather: GatherFn) -> dict[int, torch.Tensor]:
        """For each local chunk, the (up to) ``W - 1`` keys just before it."""
        need = self.base_window - 1
        tail = min(need, self.chunk_len)
        if tail == 0:
            return {c: kv[:0] for c in self.chunks}
        c_len = self.chunk_len
        tails = torch.cat([kv[c_len - tail : c_len], kv[2 * c_len - tail :]])
        per_rank = gather(tails).view(self.cp, 2, tail, *kv.shape[1:])
        back = -(-need // tail)  # chunks a halo reaches back (tail == chunk_len when W-1 > it)
        halos = {}
        for chunk in self.chunks:
            before = [per_rank[chunk_owner(c, self.cp)] for c in range(max(0, chunk - back), chunk)]
            keys = torch.cat(before) if before else kv[:0]
            halos[chunk] = keys[max(0, keys.shape[0] - need) :]
        return halos


def chunk_length(num_tokens: int, cp: int) -> int:
    """Tokens per chunk: ``2 * cp`` equal chunks cover the sequence, padded at the end."""
    return -(-num_tokens // (2 * cp))


def output_select(layout: OrthrosLayout, rank: int, cp: int) -> torch.Tensor:
    """Indices into ``layout.output_index`` of the output tokens rank ``rank`` holds, in its order."""
    chunk = layout.output_index.long() // chunk_length(layout.num_tokens, cp)
    return torch.cat([torch.nonzero(chunk == c).flatten() for c in (rank, 2 * cp - 1 - rank)])


def context_plan(
    config: OrthrosConfig, layout: OrthrosLayout, rank: int, cp: int, gather: GatherFn | None = None
) -> ContextPlan:
    """Rank ``rank``'s share of ``layout`` under ``cp``-way context parallelism; ``gather`` is the
    autograd all-gather over the CP group (``orthros_train.parallel.model`` passes megatron's)."""
    device = layout.input_ids.device
    t = layout.num_tokens
    chunk_len = chunk_length(t, cp)
    padded = 2 * cp * chunk_len
    cu = layout.cu_seqlens.long()
    ids, positions = layout.input_ids, layout.positions
    if padded > t:
        # The padding is one document of its own with no output tokens: nothing attends it.
        cu = torch.cat([cu, cu.new_tensor([padded])])
        ids = torch.cat([ids, ids.new_zeros(padded - t)])
        positions = torch.cat([positions, torch.arange(padded - t, device=device, dtype=positions.dtype)])
    first, last = rank, 2 * cp - 1 - rank
    token_global = torch.cat(
        [torch.arange(c * chunk_len, (c + 1) * chunk_len, device=device) for c in (first, last)]
    )
    orthros = config.attention_type == "orthros"
    tail = _global_tail_rows(config, layout, token_global, padded, chunk_len)
    select = output_select(layout, rank, cp)
    output_global = layout.output_index.long()[select]
    slot = (output_global // chunk_len == last).long()
    late = int(slot.sum())  # once per forward: every layer's attention then reads host counts only
    output_base_row = slot * chunk_len + output_global % chunk_len
    return ContextPlan(
        input_ids=ids[token_global],
        output_rows=output_base_row,
        base_positions=positions[token_global],
        out_positions=positions[output_global] if orthros else positions[:0],
        base_key_index=token_global,
        out_key_index=output_global if orthros else output_global[:0],
        key_cu_seqlens=cu,
        base_window=config.base_window,
        sink_tokens=config.base_sink_tokens,
        cp=cp,
        rank=rank,
        chunk_len=chunk_len,
        output_select=select,
        has_outputs=orthros and layout.num_outputs > 0,
        gather=gather,
        slot_outputs=(slot.numel() - late, late) if orthros else (0, 0),
        host_cu_seqlens=cu.cpu(),
        **tail,
    )


def _global_tail_rows(config: OrthrosConfig, layout: OrthrosLayout, token_global: torch.Tensor, padded: int,
                      chunk_len: int) -> dict:
    """The ``ContextPlan`` fields of the global tail: the local base flags, their rows per slot
    (host copies, once per forward) and whether any rank has a global query."""
    flags = global_queries(config, layout).get("base_global")
    if flags is None:
        return {}
    device = token_global.device
    host = torch.cat([flags.cpu(), torch.zeros(padded - flags.numel(), dtype=torch.bool)])  # padding: windowed
    local = host[token_global.cpu()]
    rows = tuple(torch.nonzero(local[i * chunk_len : (i + 1) * chunk_len]).flatten().to(device) for i in (0, 1))
    return {"base_global": local.to(device), "num_global": int(local.sum()), "global_rows": rows,
            "any_global": bool(host.any())}
