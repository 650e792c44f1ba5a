"""The Orthros model, single device, no parallelism (``docs/architecture.md``).

Every layer carries two token streams that share all weights except a per-head affine on the
output stream's queries:

* base stream ``x`` — one token per input position; sliding-window causal self-attention
  (window ``W``); it alone produces the layer's K/V, i.e. the whole KV cache;
* output stream ``y`` — one token per position that must predict the next token (a copy of the
  input token's embedding at layer 0); its query attends every base key of its document up to
  its own position. It writes no K/V and nobody attends to it.

Token-wise ops (norms, projections, MLP) run on the concatenation ``[x; y]``; only attention
knows which is which. The LM head and loss see the output stream only, so the last layer skips
the base stream's attention output and MLP.

``attention_type="dense"`` / ``"sliding"`` are the baselines trained by the same code: no output
stream, one causal stream with unbounded / ``W`` window, read out at the output positions.

This file is the only statement of that math. Tensor, sequence and context parallelism
(``orthros_train/parallel``) build the same classes through a ``ModuleFactory`` that returns
megatron-core's parallel linears under the same names, and a specialised ``AttentionPlan``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from orthros_train.common.safetensors_io import WEIGHTS_NAME, SafetensorsReader, save_safetensors
from orthros_train.model.cache import KVCache
from orthros_train.model.config import OrthrosConfig
from orthros_train.model.fused import attention_inputs, fusion_active, join_streams
from orthros_train.model.layers import RMSNorm, RotaryEmbedding, SwiGLU
from orthros_train.model.moe import MoEOutput, SparseMoE, StreamPairs
from orthros_train.ops.attention import UNBOUNDED, orthros_attention, prepare_attention
from orthros_train.ops.fused_tokenwise import add_rms_norm, linear_cross_entropy, rms_norm
from orthros_train.ops.keys import KeyRule, answer_tail_flags
from orthros_train.options import FusedTokenwise
from orthros_train.phase.builders import decode_layout, positions_layout, prefill_layout
from orthros_train.phase.layout import IGNORE_INDEX, OrthrosLayout


@dataclass
class AttentionPlan:
    """Where every token, query and key of one forward pass sits; shared by all layers.

    This plan covers the whole layout on one device. Context parallelism specialises it
    (``orthros_train.parallel.context.ContextPlan``: one rank's share of the sequence) by
    overriding the methods below; the model only ever calls them.
    """

    input_ids: torch.Tensor  # [T] base token ids of this pass
    output_rows: torch.Tensor  # [N] base row each output token starts from (baselines: is read out at)
    base_positions: torch.Tensor  # [T] RoPE positions of the base tokens
    out_positions: torch.Tensor  # [N'] RoPE positions of the output tokens (N' = 0 for baselines)
    base_key_index: torch.Tensor  # [T] key index of each base token (its own K/V)
    out_key_index: torch.Tensor  # [N'] key index of the base token each output token sits on
    key_cu_seqlens: torch.Tensor  # document boundaries of the keys
    base_window: int
    sink_tokens: int = 0  # the base stream's attention sinks (``OrthrosConfig.sink_tokens``)
    # [T] bool or None: base queries that see their whole document (the global tail, ``ops/keys.py``)
    base_global: torch.Tensor | None = None
    num_global: int = 0  # how many (host-known, for the kernels' plan; -1: not known on the host)
    new_lengths: torch.Tensor | None = None  # per-row new tokens when a KV cache is extended (CPU)
    # Per-forward attention metadata, filled by the first layer and reused by every later layer
    # and the backward (the kernels' query sort and tile plan, host-known counts): no layer
    # rebuilds it or waits for the device to size it.
    attention_meta: dict = field(default_factory=dict, repr=False, compare=False)
    # (load-balancing loss, z-loss) of every sparse layer of this pass, appended as the layers run.
    router_losses: list = field(default_factory=list, repr=False, compare=False)

    @property
    def num_base(self) -> int:
        """Base-stream tokens of this pass (the rows of ``x``)."""
        return self.base_positions.numel()

    @property
    def num_outputs(self) -> int:
        """Output-stream tokens of this pass (the rows of ``y``; 0 for the baselines)."""
        return self.out_positions.numel()

    def queries(self, with_base: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(positions, key index, window) of the queries ``[base; output]`` (or output only)."""
        out_window = torch.full_like(self.out_key_index, UNBOUNDED)
        if not with_base:
            return self.out_positions, self.out_key_index, out_window
        meta = self.attention_meta
        if "base_windows" not in meta:  # built once per pass: every layer asks
            rule = KeyRule(self.base_window, self.sink_tokens)
            meta["base_windows"] = rule.base_windows(self.base_global, self.base_key_index)
        base_window = meta["base_windows"]
        return (
            torch.cat([self.base_positions, self.out_positions]),
            torch.cat([self.base_key_index, self.out_key_index]),
            torch.cat([base_window, out_window]),
        )

    def rotary_angles(self, rotary: RotaryEmbedding, with_base: bool) -> tuple[tuple, tuple]:
        """``((cos, sin) of the queries, (cos, sin) of the keys)``, computed by the first layer and
        reused by every later one and the backward: every layer rotates by the same frequencies
        (one ``rope_theta`` and ``rope_scaling`` per model), so recomputing them per layer only
        repeated the same trigonometry."""
        meta, key = self.attention_meta, ("rope", with_base)
        if key not in meta:
            for stream, positions in (("rope_base", self.base_positions), ("rope_out", self.out_positions)):
                if stream not in meta:
                    meta[stream] = rotary.cos_sin(positions)
            base, out = meta["rope_base"], meta["rope_out"]
            queries = tuple(torch.cat(pair) for pair in zip(base, out)) if with_base else out
            meta[key] = (queries, base)
        return meta[key]

    def stream_pairs(self, with_base: bool) -> StreamPairs:
        """The rows of an MLP input ``[x; y]`` (or ``y`` alone): each output token and its base token."""
        # Baselines have no output stream (num_outputs = 0): their tokens route alone.
        pairs = self.output_rows[: self.num_outputs]
        return StreamPairs(num_base=self.num_base if with_base else 0, out_base_row=pairs)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, with_base: bool, backend: str = "auto"
    ) -> torch.Tensor:
        """Attention of the queries ``[base; output]`` (or output only) over the keys ``k``/``v``."""
        _, q_index, q_window = self.queries(with_base)
        key = (with_base, k.shape[0], backend)
        if key not in self.attention_meta:
            # the base queries but the global ones are the windowed ones when the window is shorter
            # than the keys
            n_band = 0
            if with_base and self.base_window <= k.shape[0]:
                n_band = None if self.num_global < 0 else self.num_base - self.num_global
            self.attention_meta[key] = prepare_attention(
                q_index, q_window, self.key_cu_seqlens, k.shape[0], backend, sink_tokens=self.sink_tokens,
                n_band=n_band, max_range=self.attention_meta.get("max_range"), query=(q.dtype, q.shape[-1]),
            )
        return orthros_attention(
            q, k, v, q_index, q_window, self.key_cu_seqlens, backend=backend, prepared=self.attention_meta[key],
            sink_tokens=self.sink_tokens,
        )

    def output_targets(self, layout: OrthrosLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """(labels, loss weights) of this pass's output tokens, in the order of their logits."""
        return layout.labels, layout.loss_weights

    def whole_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss of the whole layout from this pass's share of it (here: the share is all)."""
        return loss

    def whole_logits(self, logits: torch.Tensor, layout: OrthrosLayout) -> torch.Tensor:
        """Logits of every output token of ``layout`` from this pass's (here: all of them)."""
        return logits


def plan_for_layout(config: OrthrosConfig, layout: OrthrosLayout, cache: KVCache | None = None) -> AttentionPlan:
    """Query/key bookkeeping of one forward pass (keys continue the cache rows when given)."""
    window = config.base_window
    meta: dict = {}
    if cache is None:
        key_index = torch.arange(layout.num_tokens, device=layout.input_ids.device)
        cu, new_lengths = layout.cu_seqlens, None
    else:
        if layout.cu_seqlens.numel() - 1 != layout.num_rows or layout.num_rows != cache.num_rows:
            raise ValueError("a cached forward needs exactly one document per cache row")
        # host bookkeeping: one copy per step, so no layer's cache write waits for the device
        cu_host = layout.cu_seqlens.cpu()
        new_lengths = (cu_host[1:] - cu_host[:-1]).long()
        cu, key_index = cache.key_space(new_lengths)
        cu, key_index = cu.to(layout.input_ids.device), key_index.to(layout.input_ids.device)
        meta["max_range"] = int((cache.lengths + new_lengths).max())  # longest key range (decode grid)
    # Baselines have no output stream: their outputs are read off the base stream at the end.
    out_index = layout.output_index if config.attention_type == "orthros" else layout.output_index[:0]
    return AttentionPlan(
        input_ids=layout.input_ids,
        output_rows=layout.output_index,
        base_positions=layout.positions,
        out_positions=layout.positions[out_index],
        base_key_index=key_index,
        out_key_index=key_index[out_index],
        key_cu_seqlens=cu,
        base_window=window,
        sink_tokens=config.base_sink_tokens,
        **global_queries(config, layout),
        new_lengths=new_lengths,
        attention_meta=meta,
    )


def global_queries(config: OrthrosConfig, layout: OrthrosLayout) -> dict:
    """``base_global`` and ``num_global`` of a pass (``ops/keys.py``): the layout's own flags (a
    prompt's tail), or those an answer layout implies (SFT/RL), or none. ``num_global`` -1: not
    known on the host (derived on the device; the kernels count it)."""
    tail = config.base_global_tail
    if not tail:
        return {}
    if layout.base_global is not None:
        return {"base_global": layout.base_global, "num_global": layout.num_global}
    if layout.answers:
        flags = answer_tail_flags(layout.output_index, layout.cu_seqlens, layout.num_tokens, tail)
        return {"base_global": flags, "num_global": -1}
    return {}


def initial_value(
    config: OrthrosConfig, name: str, shape: torch.Size, generator: torch.Generator | None = None
) -> torch.Tensor:
    """The random initialisation of parameter ``name`` (its whole, unsplit tensor)."""
    std = config.initializer_range
    if name.endswith("gamma") or "norm" in name:
        return torch.ones(shape)
    if name.endswith(("beta", "bias")):
        return torch.zeros(shape)
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        # GPT-2 style: residual writes shrink with depth so the stream's variance stays put.
        std = std / (2 * config.num_hidden_layers) ** 0.5
    return torch.empty(shape).normal_(0.0, std, generator=generator)


class LMHead(nn.Linear):
    """The output projection. Its logits may be split over the vocabulary (tensor parallelism),
    so the cross entropy and the full logits are asked of the head that made them."""

    def token_losses(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-token cross entropy in fp32 (0 where the label is ``IGNORE_INDEX``)."""
        return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="none")

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary."""
        return logits


class ModuleFactory:
    """How the model builds its parts. This one builds plain single-device torch modules;
    ``orthros_train.parallel`` passes a subclass that builds tensor-parallel ones under the same
    names and shapes per rank, so neither the math below nor the parameter names depend on how
    the model is split. ``name`` is the HF/reference name of the module being built."""

    def linear(self, name: str, in_features: int, out_features: int, bias: bool) -> nn.Module:
        return nn.Linear(in_features, out_features, bias=bias)

    def embedding(self, num_embeddings: int, dim: int) -> nn.Module:
        return nn.Embedding(num_embeddings, dim)

    def lm_head(self, hidden_size: int, vocab_size: int) -> LMHead:
        return LMHead(hidden_size, vocab_size, bias=False)

    def norm(self, name: str, dim: int, eps: float) -> RMSNorm:
        return RMSNorm(dim, eps)

    def head_parameter(self, fill: float, heads: int, head_dim: int) -> nn.Parameter:
        """A per-head parameter ``[heads, head_dim]`` (the output-query affine)."""
        return nn.Parameter(torch.full((heads, head_dim), fill))

    def attention(self, config: OrthrosConfig, layer_idx: int) -> "OrthrosAttention":
        return OrthrosAttention(config, layer_idx, self)

    def mlp(self, config: OrthrosConfig) -> SwiGLU:
        return SwiGLU(config.hidden_size, config.intermediate_size, self.linear)

    def moe(self, config: OrthrosConfig) -> SparseMoE:
        """The mixture of experts of a sparse layer (``config.is_sparse_layer``)."""
        return SparseMoE(config, self.linear)

    def block(self, config: OrthrosConfig, layer_idx: int) -> "OrthrosBlock":
        return OrthrosBlock(config, layer_idx, self)

    def plan(self, config: OrthrosConfig, layout: OrthrosLayout, cache: KVCache | None) -> AttentionPlan:
        return plan_for_layout(config, layout, cache)

    def fused_tokenwise(self, config: OrthrosConfig) -> FusedTokenwise:
        """The ``model.fused_tokenwise`` the modules built here use (a split model may refuse it)."""
        return config.fused_tokenwise

    def initialise(self, model: "OrthrosForCausalLM") -> None:
        model.reset_parameters()


class OrthrosAttention(nn.Module):
    def __init__(self, config: OrthrosConfig, layer_idx: int, factory: ModuleFactory | None = None) -> None:
        super().__init__()
        factory = factory or ModuleFactory()
        self.config = config
        self.layer_idx = layer_idx
        h, kv, hd, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.hidden_size
        self.head_dim = hd
        bias = config.attention_bias
        self.q_proj = factory.linear("q_proj", d, h * hd, bias)
        self.k_proj = factory.linear("k_proj", d, kv * hd, bias)
        self.v_proj = factory.linear("v_proj", d, kv * hd, bias)
        self.o_proj = factory.linear("o_proj", h * hd, d, False)
        self.q_norm = factory.norm("q_norm", hd, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = factory.norm("k_norm", hd, config.rms_norm_eps) if config.qk_norm else None
        # The only weights the output stream does not share: q_out = norm_q(y W_q) * gamma + beta.
        self.gamma = factory.head_parameter(1.0, h, hd)
        self.beta = factory.head_parameter(0.0, h, hd)
        self.rotary = RotaryEmbedding(hd, config.rope_theta, config.rope_scaling)
        self.fusion = factory.fused_tokenwise(config)

    def forward(
        self, h: torch.Tensor, plan: AttentionPlan, cache: KVCache | None, with_base_queries: bool
    ) -> torch.Tensor:
        """``h`` is the normed ``[x; y]``; returns the attention output of ``[x; y]`` or of ``y``."""
        return self.o_proj(self.head_outputs(h, plan, cache, with_base_queries))

    def head_outputs(
        self, h: torch.Tensor, plan: AttentionPlan, cache: KVCache | None, with_base_queries: bool
    ) -> torch.Tensor:
        """Attention of ``[x; y]`` (or ``y``) before the output projection, ``[rows, heads * head_dim]``."""
        q_angles, k_angles = plan.rotary_angles(self.rotary, with_base_queries)
        if fusion_active(self.fusion, h):
            q, k, v = attention_inputs(self, h, plan.num_base, with_base_queries, q_angles, k_angles)
        else:
            q, k, v = self.eager_inputs(h, plan.num_base, with_base_queries, q_angles, k_angles)
        if cache is not None:
            k, v = cache.extend(self.layer_idx, k, v, plan.new_lengths)
        o = self.core(q, k, v, plan, with_base_queries)
        return o.flatten(1)  # also for no queries (a prefill chunk without its output token)

    def eager_inputs(
        self, h: torch.Tensor, n_base: int, with_base_queries: bool, q_angles: tuple, k_angles: tuple
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q, k, v)`` of the normed ``[x; y]``: projections, q/k norms, the output affine, RoPE
        (``model/fused.py: attention_inputs`` is the same in fewer passes)."""
        hd = self.head_dim
        n_out = h.shape[0] - n_base
        base = h[:n_base]
        k = self.k_proj(base).view(n_base, -1, hd)
        v = self.v_proj(base).view(n_base, -1, hd)
        q = self.q_proj(h if with_base_queries else h[n_base:]).view(-1, self.gamma.shape[0], hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if n_out:
            q_out = q[q.shape[0] - n_out :] * self.gamma + self.beta
            q = torch.cat([q[: q.shape[0] - n_out], q_out])
        return self.rotary(q, *q_angles), self.rotary(k, *k_angles), v

    def core(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan, with_base_queries: bool
    ) -> torch.Tensor:
        """The attention op itself (what selective activation recompute recomputes)."""
        return plan.attend(q, k, v, with_base_queries, backend=self.config.attention_backend)


class OrthrosBlock(nn.Module):
    def __init__(self, config: OrthrosConfig, layer_idx: int, factory: ModuleFactory | None = None) -> None:
        super().__init__()
        factory = factory or ModuleFactory()
        self.layer_idx = layer_idx
        d, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = factory.norm("input_layernorm", d, eps)
        self.self_attn = factory.attention(config, layer_idx)
        self.post_attention_layernorm = factory.norm("post_attention_layernorm", d, eps)
        self.sparse = config.is_sparse_layer(layer_idx)
        self.mlp = factory.moe(config) if self.sparse else factory.mlp(config)
        self.fusion = factory.fused_tokenwise(config)

    def forward(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        plan: AttentionPlan,
        cache: KVCache | None = None,
        base_feeds_nothing: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer over both streams. With ``base_feeds_nothing`` (the last Orthros layer) the
        base stream only supplies K/V and ``x`` is returned unchanged."""
        if fusion_active(self.fusion, x):
            return self.fused_forward(x, y, plan, cache, base_feeds_nothing)
        n_base = x.shape[0]
        h = torch.cat([x, y])
        attn = self.self_attn(self.input_layernorm(h), plan, cache, not base_feeds_nothing)
        if base_feeds_nothing:
            h = y + attn
            return x, h + self.feed_forward(self.post_attention_layernorm(h), plan, with_base=False)
        h = h + attn
        h = h + self.feed_forward(self.post_attention_layernorm(h), plan, with_base=True)
        return h[:n_base], h[n_base:]

    def fused_forward(
        self, x: torch.Tensor, y: torch.Tensor, plan: AttentionPlan, cache: KVCache | None, base_feeds_nothing: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` in fewer passes (``model.fused_tokenwise``, ``model/fused.py``): ``[x; y]`` kept
        in the previous layer's buffer, each residual add done by the RMSNorm kernel after it."""
        n_base = x.shape[0]
        h = join_streams(x, y)
        pre, post = self.input_layernorm, self.post_attention_layernorm
        attn = self.self_attn(rms_norm(h, pre.weight, pre.eps), plan, cache, not base_feeds_nothing)
        if base_feeds_nothing:
            normed, h = add_rms_norm(y, attn, post.weight, post.eps)
            return x, h + self.feed_forward(normed, plan, with_base=False, fused=True)
        normed, h = add_rms_norm(h, attn, post.weight, post.eps)
        h = h + self.feed_forward(normed, plan, with_base=True, fused=True)
        return h[:n_base], h[n_base:]

    def feed_forward(self, h: torch.Tensor, plan: AttentionPlan, with_base: bool, fused: bool = False) -> torch.Tensor:
        """The MLP of the normed ``[x; y]`` (or ``y``): dense, or the experts routed by stream pairs."""
        if not self.sparse:
            return self.mlp.fused_forward(h) if fused else self.mlp(h)
        out: MoEOutput = self.mlp(h, plan.stream_pairs(with_base))
        plan.router_losses.append((out.aux_loss, out.z_loss))
        return out.hidden


@dataclass
class OrthrosOutput:
    logits: torch.Tensor | None  # None when the caller asked for the loss only
    loss: torch.Tensor | None = None
    # Sparse layers: router_aux_loss_coef x load balancing + router_z_loss_coef x z-loss, averaged
    # over the sparse layers (detached; in training mode ``loss`` includes it).
    router_loss: torch.Tensor | None = None


class OrthrosForCausalLM(nn.Module):
    def __init__(self, config: OrthrosConfig, factory: ModuleFactory | None = None) -> None:
        super().__init__()
        self.config = config
        self.factory = factory or ModuleFactory()
        self.embed_tokens = self.factory.embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.factory.block(config, i) for i in range(config.num_hidden_layers))
        self.norm = self.factory.norm("norm", config.hidden_size, config.rms_norm_eps)
        self.lm_head = self.factory.lm_head(config.hidden_size, config.vocab_size)
        self.fusion = self.factory.fused_tokenwise(config)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.factory.initialise(self)

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Random weights by ``initial_value``, drawn in parameter order."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(initial_value(self.config, name, p.shape, generator))

    @property
    def is_orthros(self) -> bool:
        return self.config.attention_type == "orthros"

    def hidden_states(self, layout: OrthrosLayout, cache: KVCache | None = None) -> torch.Tensor:
        """Final normed hidden states of the output tokens, ``[N, hidden]``."""
        return self._hidden_states(self.factory.plan(self.config, layout, cache), cache)

    def _hidden_states(self, plan: AttentionPlan, cache: KVCache | None) -> torch.Tensor:
        x = self.embed_tokens(plan.input_ids)
        # Output token p starts as a copy of input token p (layer 0); baselines have no stream y.
        y = x[plan.output_rows] if self.is_orthros else x[:0]
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x, y = layer(x, y, plan, cache, base_feeds_nothing=self.is_orthros and i == last)
        if cache is not None:
            cache.advance(plan.new_lengths)
        if not self.is_orthros:
            y = x[plan.output_rows]
        return rms_norm(y, self.norm.weight, self.norm.eps) if fusion_active(self.fusion, y) else self.norm(y)

    def forward_layout(
        self,
        layout: OrthrosLayout,
        cache: KVCache | None = None,
        loss_normalizer: float | None = None,
        return_logits: bool = True,
    ) -> OrthrosOutput:
        """Logits ``[N, vocab]`` of the output tokens and, when any label is set, the loss
        ``sum(w * CE) / loss_normalizer`` (default: this layout's labelled tokens).

        ``return_logits=False`` skips assembling the full logits (training needs the loss only).
        """
        plan = self.factory.plan(self.config, layout, cache)
        hidden = self._hidden_states(plan, cache)
        # Fused, a loss-only pass never holds the [tokens, vocab] logits (chunked head + cross entropy).
        chunked = not return_logits and layout.num_loss_tokens and fusion_active(self.fusion, hidden)
        logits = None if chunked else self.lm_head(hidden)
        loss = None
        if layout.num_loss_tokens:
            labels, weights = plan.output_targets(layout)
            normalizer = layout.num_loss_tokens if loss_normalizer is None else loss_normalizer
            if chunked:
                ce = linear_cross_entropy(hidden, self.lm_head.weight, labels, weights, normalizer)
            else:
                ce = weighted_cross_entropy(logits, labels, weights, normalizer, self.lm_head.token_losses)
            loss = plan.whole_loss(ce)
        router = self.router_loss(plan)
        if router is not None and loss is not None and self.training:
            # Like the cross entropy, a mean over this micro batch: DeepSpeed's 1/accumulation and
            # data-parallel average make it the step's mean. Added after whole_loss: each context-
            # parallel rank balances its own chunk's routing, the average of which is the sequence's.
            loss = loss + router
        full = plan.whole_logits(self.lm_head.full_logits(logits), layout) if return_logits else None
        return OrthrosOutput(logits=full, loss=loss, router_loss=None if router is None else router.detach())

    def logits_of_plan(self, plan: AttentionPlan, cache: KVCache | None = None) -> torch.Tensor:
        """Full-vocabulary logits of the output tokens of a plan made elsewhere (a decode step
        whose plan lives on the device: ``infer/static_decode.py``)."""
        return self.lm_head.full_logits(self.lm_head(self._hidden_states(plan, cache)))

    def router_loss(self, plan: AttentionPlan) -> torch.Tensor | None:
        """``router_aux_loss_coef`` x the mean load-balancing loss + ``router_z_loss_coef`` x the mean
        z-loss of the pass's sparse layers (None for a dense model)."""
        if not plan.router_losses:
            return None
        aux = torch.stack([a for a, _ in plan.router_losses]).mean()
        z = torch.stack([z for _, z in plan.router_losses]).mean()
        return self.config.router_aux_loss_coef * aux + self.config.router_z_loss_coef * z

    def forward(
        self,
        input_ids: torch.Tensor | OrthrosLayout,
        output_positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        loss_normalizer: float | None = None,
    ) -> OrthrosOutput:
        """``input_ids [B, T]``; output tokens at ``output_positions`` (default: every position).

        Returns logits ``[B, N, vocab]``; ``labels [B, N]`` (targets of the output tokens) adds
        the mean loss over non-ignored labels. Given a packed ``OrthrosLayout`` instead (what the
        training engine passes) it returns the loss only, as ``forward_layout(...,
        return_logits=False)``.
        """
        if isinstance(input_ids, OrthrosLayout):
            return self.forward_layout(input_ids, loss_normalizer=loss_normalizer, return_logits=False)
        b = 1 if input_ids.dim() == 1 else input_ids.shape[0]
        layout = positions_layout(input_ids, output_positions, document_ids, labels)
        out = self.forward_layout(layout)
        return OrthrosOutput(
            logits=out.logits.view(b, -1, out.logits.shape[-1]), loss=out.loss, router_loss=out.router_loss
        )

    def save_pretrained(self, directory: str | Path) -> None:
        """``config.json`` + ``model.safetensors`` (tied weights stored once)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_safetensors(state, directory / WEIGHTS_NAME)
        (directory / "config.json").write_text(json.dumps(self.config.to_dict(), indent=2) + "\n")

    @classmethod
    def from_pretrained(cls, directory: str | Path, **overrides: object) -> "OrthrosForCausalLM":
        """Load a directory written by ``save_pretrained`` (or by ``orthros-convert from-hf``).

        ``overrides`` replace config fields that do not change the weights (e.g. sliding_window).
        """
        directory = Path(directory)
        config_path = directory / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"{config_path} not found: not an Orthros checkpoint directory")
        config = OrthrosConfig.from_dict({**json.loads(config_path.read_text()), **overrides})
        model = cls(config)
        model.load_pretrained_weights(directory)
        return model

    def load_pretrained_weights(self, directory: str | Path) -> None:
        """Copy weights from a checkpoint directory (``SafetensorsReader``), one tensor at a time.
        Unreadable or missing files raise ``SafetensorsFileError``; tensors of another name or
        shape raise ValueError."""
        directory = Path(directory)
        own = self.state_dict()
        seen: set[str] = set()
        with SafetensorsReader(directory) as weights:
            for name in weights:
                f = weights.info(name).file
                if name not in own:
                    raise ValueError(f"{f} holds {name!r}, which this model does not have")
                shape = weights.info(name).shape
                if tuple(own[name].shape) != shape:
                    raise ValueError(
                        f"{f}: {name} has shape {shape}, the model expects {tuple(own[name].shape)}"
                        " (the checkpoint was made for another config)"
                    )
                with torch.no_grad():
                    own[name].copy_(weights[name])
                seen.add(name)
        if self.config.tie_word_embeddings:
            seen.add("lm_head.weight")
        missing = sorted(set(own) - seen)
        if missing:
            raise ValueError(f"checkpoint {directory} lacks {len(missing)} tensors, e.g. {missing[:5]}")

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, KVCache]:
        """Read a prompt ``[B, T]`` with one output token (the last): ``(logits [B, V], cache)``."""
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        cache = KVCache(self.config.num_hidden_layers, input_ids.shape[0])
        layout = prefill_layout(input_ids, global_tail=self.config.base_global_tail)
        return self.forward_layout(layout, cache).logits, cache

    @torch.no_grad()
    def decode_step(self, next_ids: torch.Tensor, cache: KVCache) -> tuple[torch.Tensor, KVCache]:
        """Append one base+output pair per row: ``(logits [B, V], cache)``."""
        layout = decode_layout(next_ids.to(self.embed_tokens.weight.device), cache.lengths,
                               self.config.base_global_tail)
        return self.forward_layout(layout, cache).logits, cache

    @torch.no_grad()
    def generate_greedy(
        self, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id: int | None = None
    ) -> torch.Tensor:
        """Greedy continuation through prefill + decode; returns the new tokens ``[B, <=max]``
        (``[B, 0]`` for ``max_new_tokens <= 0``)."""
        if max_new_tokens <= 0:
            return input_ids.new_empty((input_ids.shape[0], 0))
        logits, cache = self.prefill(input_ids)
        new = []
        for _ in range(max_new_tokens):
            nxt = logits.argmax(-1)
            new.append(nxt)
            if eos_token_id is not None and bool((nxt == eos_token_id).all()):
                break
            logits, cache = self.decode_step(nxt, cache)
        return torch.stack(new, dim=1)


def weighted_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    normalizer: float | None = None,
    token_losses: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``sum(w * CE) / normalizer`` in fp32. The default normalizer is the number of labelled
    tokens (a plain mean when all weights are 1); a trainer passes the count of a whole step's
    batch so that every token (or sequence) of the step weighs the same. ``token_losses``
    computes the per-token CE (default: ``F.cross_entropy``; a vocab-parallel head brings its own)."""
    if token_losses is None:
        ce = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="none")
    else:
        ce = token_losses(logits, labels)
    valid = labels != IGNORE_INDEX
    total = (ce * weights * valid).sum()
    return total / (valid.sum().clamp(min=1) if normalizer is None else normalizer)
