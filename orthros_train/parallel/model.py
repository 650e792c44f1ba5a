"""The Orthros model built from megatron-core tensor-parallel parts.

Same math as ``orthros_train/model/orthros.py`` (the readable reference); this file only adds
how it is split:

* heads (and the output-stream query affine ``gamma``/``beta``, which lives per head) are split
  across tensor-parallel ranks: ``ColumnParallelLinear`` for q, kv, the MLP's gate/up and the LM
  head, ``RowParallelLinear`` for the attention output and the MLP's down projection,
  ``VocabParallelEmbedding`` and vocab-parallel cross entropy for the vocabulary;
* sequence parallelism shards the token dimension of ``[base; output]``: each rank holds a
  slice of the base stream and a slice of the output stream (each padded to a multiple of the
  TP size), gathered only around attention and the column-parallel linears;
* weights that every rank holds but that see only part of the work (norms under SP, the q/k
  norms shared by all heads) are used through ``copy_to_tensor_model_parallel_region``, so their
  gradient is summed over the TP group inside autograd — it is final when ``backward`` returns,
  before any ZeRO hook reads it.

The attention op is called per rank on its local heads. Under context parallelism
(``parallel/context.py``) each CP rank holds two chunks of the sequence and its attention
exchanges K/V with the other CP ranks; everything token-wise is unchanged.

Activation recompute comes from megatron's ``TransformerConfig.recompute_granularity``:
``selective`` recomputes the attention core (the op and, under CP, its K/V all-gathers) in the
backward, ``full`` recomputes each layer from its input.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
    vocab_parallel_cross_entropy,
)
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer import ModuleSpec, TransformerConfig
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module
from torch import nn
from torch.utils.checkpoint import checkpoint

from orthros_train.model.config import OrthrosConfig
from orthros_train.model.layers import RMSNorm, RotaryEmbedding, apply_rope
from orthros_train.model.orthros import AttentionPlan, OrthrosOutput, plan_for_layout
from orthros_train.ops.attention import orthros_attention
from orthros_train.parallel.context import ContextPlan, context_plan, output_select
from orthros_train.parallel.setup import ParallelConfig, check_parallel_layout
from orthros_train.phase.layout import IGNORE_INDEX, OrthrosLayout


class TPReducedRMSNorm(RMSNorm):
    """RMSNorm; with ``partial_grad`` its weight gradient is summed over the TP group.

    ``partial_grad`` is for norms that see only this rank's part of the work: the hidden-state
    norms under sequence parallelism (a slice of the tokens) and the q/k norms (a slice of the
    heads). The sum happens in autograd, so ``.grad`` is final when ``backward`` returns.
    """

    def __init__(self, dim: int, eps: float, partial_grad: bool) -> None:
        super().__init__(dim, eps)
        self.partial_grad = partial_grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = copy_to_tensor_model_parallel_region(self.weight) if self.partial_grad else self.weight
        return weight * self.normalize(x)


def megatron_config(
    cfg: OrthrosConfig, tp: int, sequence_parallel: bool, dtype: torch.dtype, recompute: str = "none"
) -> TransformerConfig:
    """The megatron TransformerConfig of an Orthros model (weights are loaded, not initialised)."""
    granularity = {"none": {}, "selective": {"recompute_granularity": "selective"}}.get(
        recompute, {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    )
    return TransformerConfig(
        **granularity,
        num_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_key_value_heads,
        kv_channels=cfg.head_dim,
        ffn_hidden_size=cfg.intermediate_size,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        bias_activation_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.rms_norm_eps,
        tensor_model_parallel_size=tp,
        sequence_parallel=sequence_parallel and tp > 1,
        params_dtype=dtype,
        use_cpu_initialization=not torch.cuda.is_available(),
        perform_initialization=False,  # weights come from the reference model's state dict
        gradient_accumulation_fusion=False,
    )


@dataclass
class OrthrosAttentionSubmodules:
    linear_q: type = ColumnParallelLinear
    linear_kv: type = ColumnParallelLinear
    linear_proj: type = RowParallelLinear


@dataclass
class OrthrosLayerSubmodules:
    self_attention: ModuleSpec
    mlp: ModuleSpec


def orthros_layer_spec() -> ModuleSpec:
    """ModuleSpec of one Orthros layer: swap any part (e.g. TE linears) without touching code."""
    return ModuleSpec(
        module=ParallelOrthrosLayer,
        submodules=OrthrosLayerSubmodules(
            self_attention=ModuleSpec(module=ParallelOrthrosAttention, submodules=OrthrosAttentionSubmodules()),
            mlp=ModuleSpec(
                module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
            ),
        ),
    )


class StreamShards:
    """Token-dimension bookkeeping of the two streams under sequence parallelism.

    Base and output streams are padded separately to multiples of ``shards`` (the TP size under
    SP, else 1); rank r holds ``[x_r; y_r]``. Gathering yields ``[x_0; y_0; x_1; y_1; ...]``,
    which ``split`` reorders into the full ``x`` and ``y``; ``join`` is the inverse order, so a
    reduce-scatter hands every rank its own ``[x_r; y_r]`` back.
    """

    def __init__(self, n_base: int, n_out: int, shards: int) -> None:
        self.shards = shards
        self.n_base, self.n_out = n_base, n_out
        self.base_local = -(-n_base // shards)
        self.out_local = -(-n_out // shards)

    def pad(self, x: torch.Tensor, n_local: int) -> torch.Tensor:
        missing = n_local * self.shards - x.shape[0]
        return torch.cat([x, x.new_zeros((missing, *x.shape[1:]))]) if missing else x

    def split(self, full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        per_rank = full.view(self.shards, self.base_local + self.out_local, *full.shape[1:])
        x = per_rank[:, : self.base_local].reshape(-1, *full.shape[1:])
        y = per_rank[:, self.base_local :].reshape(-1, *full.shape[1:])
        return x, y

    def join(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.pad(x, self.base_local).view(self.shards, self.base_local, *x.shape[1:])
        y = self.pad(y, self.out_local).view(self.shards, self.out_local, *y.shape[1:])
        return torch.cat([x, y], dim=1).reshape(-1, *x.shape[2:])


class ParallelOrthrosAttention(MegatronModule):
    def __init__(
        self, config: TransformerConfig, submodules: OrthrosAttentionSubmodules, ocfg: OrthrosConfig, layer_idx: int
    ) -> None:
        super().__init__(config)
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.ocfg, self.layer_idx = ocfg, layer_idx
        self.heads = ocfg.num_attention_heads // tp
        self.kv_heads = ocfg.num_key_value_heads // tp
        self.head_dim = hd = ocfg.head_dim
        d, bias = ocfg.hidden_size, ocfg.attention_bias
        # The layer gathers (SP) or copies (TP) the normed input once for q and kv together, so
        # these linears must neither gather it again nor reduce its gradient a second time.
        no_sp = dataclasses.replace(config, sequence_parallel=False)
        common = dict(config=no_sp, init_method=config.init_method, gather_output=False, skip_bias_add=False)
        self.linear_q = build_module(
            submodules.linear_q, d, ocfg.num_attention_heads * hd, bias=bias, disable_grad_reduce=True, **common
        )
        self.linear_kv = build_module(
            submodules.linear_kv, d, 2 * ocfg.num_key_value_heads * hd, bias=bias, disable_grad_reduce=True, **common
        )
        self.linear_proj = build_module(
            submodules.linear_proj,
            ocfg.num_attention_heads * hd,
            d,
            config=config,
            init_method=config.output_layer_init_method,
            bias=False,
            input_is_parallel=True,
            skip_bias_add=False,
        )
        self.q_norm = TPReducedRMSNorm(hd, ocfg.rms_norm_eps, partial_grad=True) if ocfg.qk_norm else None
        self.k_norm = TPReducedRMSNorm(hd, ocfg.rms_norm_eps, partial_grad=True) if ocfg.qk_norm else None
        self.gamma = nn.Parameter(torch.ones(self.heads, hd))
        self.beta = nn.Parameter(torch.zeros(self.heads, hd))
        for p in (self.gamma, self.beta):
            set_tensor_model_parallel_attributes(p, is_parallel=True, dim=0, stride=1)
        self.rotary = RotaryEmbedding(hd, ocfg.rope_theta, ocfg.rope_scaling)

    def forward(
        self, x: torch.Tensor, y: torch.Tensor, plan: AttentionPlan, with_base_queries: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Full-sequence normed streams ``x [T, d]``, ``y [N, d]`` -> per-rank head outputs."""
        n_base, n_out = x.shape[0], y.shape[0]
        kv, _ = self.linear_kv(x[:, None])  # megatron linears take [tokens, batch=1, hidden]
        k, v = kv.view(n_base, 2, self.kv_heads, self.head_dim).unbind(1)
        q, _ = self.linear_q((torch.cat([x, y]) if with_base_queries else y)[:, None])
        q = q.view(-1, self.heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if n_out:
            q = torch.cat([q[: q.shape[0] - n_out], q[q.shape[0] - n_out :] * self.gamma + self.beta])
        positions, q_index, q_window = plan.queries(with_base_queries)
        q = apply_rope(q, *self.rotary.cos_sin(positions))
        k = apply_rope(k, *self.rotary.cos_sin(plan.base_positions))
        if self.config.recompute_granularity == "selective":
            # Non-reentrant torch checkpoint: no dropout here, so megatron's RNG-tracking variant
            # is not needed, and collectives inside (CP all-gathers) rerun in the same order.
            o = checkpoint(self._core, q, k, v, plan, with_base_queries, use_reentrant=False)
        else:
            o = self._core(q, k, v, plan, with_base_queries)
        o = o.reshape(o.shape[0], -1)
        if not with_base_queries:
            return None, o
        return o[:n_base], o[n_base:]

    def _core(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan | ContextPlan, with_base: bool
    ) -> torch.Tensor:
        backend = self.ocfg.attention_backend
        if isinstance(plan, ContextPlan):
            return plan.attention(q, k, v, with_base, _gather_context_parallel, backend=backend)
        _, q_index, q_window = plan.queries(with_base)
        return orthros_attention(q, k, v, q_index, q_window, plan.key_cu_seqlens, backend=backend)


def _gather_context_parallel(t: torch.Tensor) -> torch.Tensor:
    """All-gather along dim 0 over the CP group; the backward reduce-scatters (sums) the grads."""
    return gather_from_sequence_parallel_region(
        t, tensor_parallel_output_grad=True, group=parallel_state.get_context_parallel_group()
    )


class ParallelOrthrosLayer(MegatronModule):
    def __init__(
        self, config: TransformerConfig, submodules: OrthrosLayerSubmodules, ocfg: OrthrosConfig, layer_idx: int
    ) -> None:
        super().__init__(config)
        self.sequence_parallel = config.sequence_parallel
        sp = self.sequence_parallel
        self.input_layernorm = TPReducedRMSNorm(ocfg.hidden_size, ocfg.rms_norm_eps, partial_grad=sp)
        self.self_attention = build_module(submodules.self_attention, config=config, ocfg=ocfg, layer_idx=layer_idx)
        self.post_attention_layernorm = TPReducedRMSNorm(ocfg.hidden_size, ocfg.rms_norm_eps, partial_grad=sp)
        self.mlp = build_module(submodules.mlp, config=config)

    def _gather(self, h: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return gather_from_sequence_parallel_region(h[:, None], tensor_parallel_output_grad=True)[:, 0]
        return copy_to_tensor_model_parallel_region(h)

    def forward(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        plan: AttentionPlan,
        shards: StreamShards,
        base_feeds_nothing: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``/``y`` are this rank's shards ``[T_local, d]``/``[N_local, d]`` (whole under no SP)."""
        n_base_local = x.shape[0]
        h = torch.cat([x, y])
        full_x, full_y = shards.split(self._gather(self.input_layernorm(h)))
        attn_x, attn_y = self.self_attention(
            full_x[: shards.n_base], full_y[: shards.n_out], plan, not base_feeds_nothing
        )
        if base_feeds_nothing:
            o, _ = self.linear_proj_rows(shards.pad(attn_y, shards.out_local))
            y = y + o
            y = y + self._mlp(self.post_attention_layernorm(y))
            return x, y
        o, _ = self.linear_proj_rows(shards.join(attn_x, attn_y))
        h = h + o
        h = h + self._mlp(self.post_attention_layernorm(h))
        return h[:n_base_local], h[n_base_local:]

    def linear_proj_rows(self, o: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        out, bias = self.self_attention.linear_proj(o[:, None])
        return out[:, 0], bias

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        out, _ = self.mlp(h[:, None])
        return out[:, 0]


class ParallelOrthrosForCausalLM(MegatronModule):
    """Tensor/sequence-parallel Orthros; ``forward_layout`` mirrors the reference model's."""

    def __init__(self, ocfg: OrthrosConfig, config: TransformerConfig, spec: ModuleSpec | None = None) -> None:
        super().__init__(config)
        tp = parallel_state.get_tensor_model_parallel_world_size()
        check_parallel_layout(ParallelConfig(tensor_parallel=tp), ocfg)
        self.ocfg = ocfg
        self.sequence_parallel = config.sequence_parallel
        self.tp = tp
        self.embedding = VocabParallelEmbedding(
            ocfg.vocab_size, ocfg.hidden_size, init_method=config.init_method, config=config
        )
        spec = spec or orthros_layer_spec()
        self.layers = nn.ModuleList(
            build_module(spec, config=config, ocfg=ocfg, layer_idx=i) for i in range(ocfg.num_hidden_layers)
        )
        self.final_norm = TPReducedRMSNorm(ocfg.hidden_size, ocfg.rms_norm_eps, partial_grad=self.sequence_parallel)
        self.output_layer = ColumnParallelLinear(
            ocfg.hidden_size,
            ocfg.vocab_size,
            config=config,
            init_method=config.init_method,
            bias=False,
            gather_output=False,
            skip_bias_add=False,
            skip_weight_param_allocation=ocfg.tie_word_embeddings,
        )
        self._mark_tensor_parallel_weights()

    def _mark_tensor_parallel_weights(self) -> None:
        """megatron tags its split weights ``tensor_model_parallel`` only when it initialises them
        (``perform_initialization``); ours are loaded instead, so tag them here. The gradient norm
        (and DeepSpeed's clipping) count a tagged tensor's shards on every TP rank, an untagged
        one once: untagged, the TP=2 norm missed rank 1's shards (1.540 vs 1.836 at TP=1)."""
        for module in self.modules():
            if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
                dim = 0
            elif isinstance(module, RowParallelLinear):
                dim = 1
            else:
                continue
            if getattr(module, "weight", None) is not None:
                set_tensor_model_parallel_attributes(module.weight, is_parallel=True, dim=dim, stride=1)

    @property
    def is_orthros(self) -> bool:
        return self.ocfg.attention_type == "orthros"

    def _vocab_logits(self, layout: OrthrosLayout, shards: StreamShards, y: torch.Tensor) -> torch.Tensor:
        weight = self.embedding.weight if self.ocfg.tie_word_embeddings else None
        logits, _ = self.output_layer(self.final_norm(y)[:, None], weight=weight)
        return logits[: shards.n_out, 0]  # [N, V / tp]; SP gathered the rows inside the linear

    def attention_plan(self, layout: OrthrosLayout) -> AttentionPlan | ContextPlan:
        """The whole layout's plan, or this CP rank's share of it under context parallelism."""
        cp = parallel_state.get_context_parallel_world_size()
        if cp > 1:
            return context_plan(self.ocfg, layout, parallel_state.get_context_parallel_rank(), cp)
        return plan_for_layout(self.ocfg, layout, None)

    def hidden_and_shards(
        self, layout: OrthrosLayout, plan: AttentionPlan | ContextPlan
    ) -> tuple[torch.Tensor, StreamShards]:
        if isinstance(plan, ContextPlan):
            input_ids, out_rows = plan.input_ids, plan.output_base_row
        else:
            input_ids, out_rows = layout.input_ids, layout.output_index
        n_base = input_ids.numel()
        emb = self.embedding(input_ids)  # [T, d], identical on every TP rank
        shards = StreamShards(n_base, out_rows.numel() if self.is_orthros else 0, self._shards)
        x = shards.pad(emb, shards.base_local)
        y = shards.pad(emb[out_rows] if self.is_orthros else emb[:0], shards.out_local)
        if self.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x[:, None])[:, 0]
            y = scatter_to_sequence_parallel_region(y[:, None])[:, 0]
        last = len(self.layers) - 1
        full_recompute = self.config.recompute_granularity == "full"
        for i, layer in enumerate(self.layers):
            args = (x, y, plan, shards, self.is_orthros and i == last)
            x, y = checkpoint(layer, *args, use_reentrant=False) if full_recompute else layer(*args)
        if not self.is_orthros:
            # Baselines read their outputs off the base stream.
            if self.sequence_parallel:
                # What follows is replicated on every rank, so the backward only splits the grad.
                x = gather_from_sequence_parallel_region(x[:, None], tensor_parallel_output_grad=False)[:, 0]
            y = x[out_rows]
            shards = StreamShards(n_base, out_rows.numel(), self._shards)
            y = shards.pad(y, shards.out_local)
            if self.sequence_parallel:
                y = scatter_to_sequence_parallel_region(y[:, None])[:, 0]
        return y, shards

    @property
    def _shards(self) -> int:
        return self.tp if self.sequence_parallel else 1

    def forward(self, layout: OrthrosLayout, return_logits: bool = False) -> OrthrosOutput:
        """What engines (DeepSpeed) call: the training forward, loss only."""
        return self.forward_layout(layout, return_logits=return_logits)

    def forward_layout(self, layout: OrthrosLayout, return_logits: bool = True) -> OrthrosOutput:
        """Loss (as in the reference model) and, unless ``return_logits=False``, the full
        ``[N, vocab]`` logits (all-gathered over TP). Training skips the logits: megatron's
        vocab-parallel cross entropy works in place on them to save memory."""
        plan = self.attention_plan(layout)
        y, shards = self.hidden_and_shards(layout, plan)
        logits = self._vocab_logits(layout, shards, y)
        local = plan.output_select if isinstance(plan, ContextPlan) else None
        loss = None
        if layout.num_loss_tokens:
            labels, weights = layout.labels, layout.loss_weights
            if local is not None:
                labels, weights = labels[local], weights[local]
            valid = labels != IGNORE_INDEX
            ce_input = logits.float().clone() if return_logits or logits.dtype == torch.float32 else logits.float()
            per_token = vocab_parallel_cross_entropy(ce_input[:, None], torch.where(valid, labels, 0)[:, None])[:, 0]
            loss = (per_token * weights * valid).sum() / layout.num_loss_tokens
            if local is not None:
                loss = _whole_sequence_loss(loss, plan.cp)
        full = gather_from_tensor_model_parallel_region(logits) if return_logits else None
        if full is not None and local is not None:
            full = _gather_context_outputs(full, layout, plan.cp)
        return OrthrosOutput(logits=full, loss=loss)


def _whole_sequence_loss(local: torch.Tensor, cp: int) -> torch.Tensor:
    """The loss of the whole sequence as its value, ``cp`` x this rank's share as its gradient.

    Every CP rank then reports (and NaN-checks) the same loss, and DeepSpeed, which averages
    gradients over the data x context parallel group, ends with the gradient of the whole
    sequence's loss: the mean over CP ranks of ``cp`` x each rank's share is their sum.
    """
    total = local.detach().clone()
    dist.all_reduce(total, group=parallel_state.get_context_parallel_group())
    return total + cp * (local - local.detach())


def _gather_context_outputs(logits: torch.Tensor, layout: OrthrosLayout, cp: int) -> torch.Tensor:
    """Every CP rank's output-token logits back in layout order (for eval and tests, no grad)."""
    counts = [output_select(layout, r, cp) for r in range(cp)]
    width = max(c.numel() for c in counts)
    padded = logits.new_zeros(width, *logits.shape[1:])
    padded[: logits.shape[0]] = logits.detach()
    parts = [torch.empty_like(padded) for _ in range(cp)]
    dist.all_gather(parts, padded, group=parallel_state.get_context_parallel_group())
    full = logits.new_empty(layout.num_outputs, *logits.shape[1:])
    for select, part in zip(counts, parts):
        full[select] = part[: select.numel()]
    return full
