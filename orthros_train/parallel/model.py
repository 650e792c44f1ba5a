"""Tensor, sequence and context parallelism applied to the one Orthros model from outside.

``orthros_train/model/orthros.py`` is the only statement of the Orthros math. This module builds
that same ``OrthrosForCausalLM`` through ``TensorParallelFactory``, a ``ModuleFactory`` that
returns megatron-core's parallel parts under the model's own (HF/reference) names:

* heads (and the output-stream query affine ``gamma``/``beta``, which lives per head) are split
  across tensor-parallel ranks: ``ColumnParallelLinear`` for q, k, v, the MLP's gate/up and the
  LM head, ``RowParallelLinear`` for the attention output and the MLP's down projection,
  ``VocabParallelEmbedding`` and vocab-parallel cross entropy for the vocabulary;
* sequence parallelism shards the token dimension of ``[base; output]`` between the layers:
  each rank holds a slice of the base stream and a slice of the output stream (each padded to a
  multiple of the TP size). The first layer scatters the streams, attention and the MLP gather
  them (once per sub-layer) and their row-parallel output projections reduce-scatter back, the
  last layer gathers the stream the LM head reads;
* weights that every rank holds but that see only part of the work (norms under SP, the q/k
  norms shared by all heads) are used through ``copy_to_tensor_model_parallel_region``, so their
  gradient is summed over the TP group inside autograd — it is final when ``backward`` returns,
  before any ZeRO hook reads it;
* context parallelism swaps the attention plan for ``parallel/context.py``'s ``ContextPlan``:
  each CP rank holds two chunks of the sequence and its attention exchanges K/V with the other
  CP ranks; everything token-wise is unchanged.

Because parameter names and per-rank shapes follow the reference model, a weight's split rule
(``parallel/state_dict.py``) is all that maps a TP rank's tensors to the reference layout.

Activation recompute follows megatron's ``recompute_granularity``: ``selective`` recomputes the
attention core (the op and, under CP, its K/V all-gathers) in the backward, ``full`` recomputes
each layer from its input.
"""

from __future__ import annotations

import dataclasses

import torch
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
from megatron.core.transformer import TransformerConfig
from torch import nn
from torch.utils.checkpoint import checkpoint

from orthros_train.errors import UserError
from orthros_train.model.cache import KVCache
from orthros_train.model.config import OrthrosConfig
from orthros_train.model.layers import RMSNorm, SwiGLU
from orthros_train.model.moe import SparseMoE
from orthros_train.model.orthros import (
    AttentionPlan,
    ModuleFactory,
    OrthrosAttention,
    OrthrosBlock,
    OrthrosForCausalLM,
    initial_value,
    plan_for_layout,
)
from orthros_train.options import FusedTokenwise
from orthros_train.parallel.compile import apply_regional_compile
from orthros_train.parallel.context import context_plan
from orthros_train.parallel.setup import ParallelConfig, check_parallel_layout
from orthros_train.parallel.state_dict import SPLIT_ROWS, reference_shapes, shard_tensor, split_rule
from orthros_train.parallel.streams import StreamShards, gather_tokens
from orthros_train.phase.layout import IGNORE_INDEX, OrthrosLayout


def megatron_config(
    cfg: OrthrosConfig, tp: int, sequence_parallel: bool, dtype: torch.dtype, recompute: str = "none"
) -> TransformerConfig:
    """The megatron TransformerConfig of an Orthros model (weights are set by us, not megatron)."""
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
        perform_initialization=False,  # TensorParallelFactory.initialise sets every shard
        gradient_accumulation_fusion=False,
    )


# -- megatron's parallel parts on [tokens, features] ------------------------------------------------
# megatron's linears take [tokens, batch, features] and return (output, bias); the model's
# modules work on packed [tokens, features] and return the output.


class ColumnLinear(ColumnParallelLinear):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # megatron tags split weights only when it initialises them; ours are set by the
        # factory. The grad norm (and DeepSpeed's clipping) counts a tagged tensor's shards on
        # every TP rank and an untagged one once: untagged, the TP=2 norm missed rank 1's shards.
        if self.weight is not None:
            set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=0, stride=1)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        out, _ = super().forward(x[:, None], weight=weight)
        return out[:, 0]


class RowLinear(RowParallelLinear):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=1, stride=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = super().forward(x[:, None])
        return out[:, 0]


class VocabEmbedding(VocabParallelEmbedding):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=0, stride=1)


class VocabParallelLMHead(ColumnLinear):
    """The LM head with vocab-split logits ``[N, V / tp]``: megatron's vocab-parallel cross
    entropy reads them where they are, and the full logits are gathered only when asked for."""

    def token_losses(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # megatron's kernel works in place on its input: give it a copy (``.float()`` of bf16 is one).
        ce_input = logits.clone() if logits.dtype == torch.float32 else logits.float()
        targets = torch.where(labels != IGNORE_INDEX, labels, 0)
        return vocab_parallel_cross_entropy(ce_input[:, None], targets[:, None])[:, 0]

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return gather_from_tensor_model_parallel_region(logits)


class TPReducedRMSNorm(RMSNorm):
    """RMSNorm whose weight gradient is summed over the TP group (it sees part of the work:
    a slice of the tokens under SP, a slice of the heads for the q/k norms)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return copy_to_tensor_model_parallel_region(self.weight) * self.normalize(x)


def _gather_context_parallel(t: torch.Tensor) -> torch.Tensor:
    """All-gather along dim 0 over the CP group; the backward reduce-scatters (sums) the grads."""
    return gather_from_sequence_parallel_region(
        t, tensor_parallel_output_grad=True, group=parallel_state.get_context_parallel_group()
    )


class ParallelAttention(OrthrosAttention):
    """The model's attention on this rank's heads: gathers the normed streams once for q, k and
    v, and hands ``o_proj`` (row-parallel) the rows in the order its reduce-scatter returns."""

    def __init__(self, config: OrthrosConfig, layer_idx: int, factory: "TensorParallelFactory") -> None:
        super().__init__(config, layer_idx, factory)
        self.sequence_parallel = factory.sequence_parallel
        self.shards = factory.stream_shards
        self.selective_recompute = factory.recompute == "selective"

    def forward(
        self, h: torch.Tensor, plan: AttentionPlan, cache: KVCache | None, with_base_queries: bool
    ) -> torch.Tensor:
        h = gather_tokens(h, self.sequence_parallel)
        if self.shards == 1:  # TP alone: every rank already holds [x; y] in order
            return self.o_proj(self.head_outputs(h, plan, cache, with_base_queries))
        shards = StreamShards(plan, self.shards)
        x, y = shards.split(h)
        o = self.head_outputs(torch.cat([x, y]), plan, cache, with_base_queries)
        if with_base_queries:
            return self.o_proj(shards.join(o[: shards.n_base], o[shards.n_base :]))
        return self.o_proj(shards.pad(o, shards.out_local))

    def core(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan, with_base_queries: bool
    ) -> torch.Tensor:
        if self.selective_recompute:
            # Non-reentrant torch checkpoint: no dropout here, so megatron's RNG-tracking variant
            # is not needed, and collectives inside (CP all-gathers) rerun in the same order.
            return checkpoint(super().core, q, k, v, plan, with_base_queries, use_reentrant=False)
        return super().core(q, k, v, plan, with_base_queries)


class ParallelSwiGLU(SwiGLU):
    """The model's MLP on this rank's slice of the intermediate features: the input is gathered
    once for gate and up; ``down_proj`` (row-parallel) reduces (or reduce-scatters) the output."""

    def __init__(self, config: OrthrosConfig, factory: "TensorParallelFactory") -> None:
        super().__init__(config.hidden_size, config.intermediate_size, factory.linear)
        self.sequence_parallel = factory.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(gather_tokens(x, self.sequence_parallel))


class ParallelBlock(OrthrosBlock):
    """The model's layer between the stream layouts: the first layer shards the streams over the
    TP ranks (SP), the last gathers the stream that is read out; ``full`` recompute reruns the
    layer in the backward."""

    def __init__(self, config: OrthrosConfig, layer_idx: int, factory: "TensorParallelFactory") -> None:
        super().__init__(config, layer_idx, factory)
        self.sequence_parallel = factory.sequence_parallel
        self.shards = factory.stream_shards
        self.first, self.last = layer_idx == 0, layer_idx == config.num_hidden_layers - 1
        self.read_out_base = config.attention_type != "orthros"  # the baselines read out x
        self.full_recompute = factory.recompute == "full"

    def forward(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        plan: AttentionPlan,
        cache: KVCache | None = None,
        base_feeds_nothing: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        shards = StreamShards(plan, self.shards)
        if self.sequence_parallel and self.first:
            x = scatter_to_sequence_parallel_region(shards.pad(x, shards.base_local)[:, None])[:, 0]
            y = scatter_to_sequence_parallel_region(shards.pad(y, shards.out_local)[:, None])[:, 0]
        args = (x, y, plan, cache, base_feeds_nothing)
        if self.full_recompute and cache is None:  # a cached forward is inference: nothing to recompute
            x, y = checkpoint(super().forward, *args, use_reentrant=False)
        else:
            x, y = super().forward(*args)
        if self.sequence_parallel and self.last:
            # What follows (final norm, LM head) is replicated on every rank and the LM head's
            # input gradient is summed over TP there, so the backward only takes this rank's rows.
            if self.read_out_base:
                x = gather_tokens(x, True, output_grad_partial=False)[: shards.n_base]
            else:
                y = gather_tokens(y, True, output_grad_partial=False)[: shards.n_out]
        return x, y


class TensorParallelFactory(ModuleFactory):
    """Builds the model's parts as this rank's tensor-parallel shards (megatron-core) under the
    reference names; picks the context-parallel plan when the CP group has several ranks."""

    def __init__(
        self,
        config: OrthrosConfig,
        pcfg: ParallelConfig,
        dtype: torch.dtype = torch.float32,
        seed: int | None = 0,
    ) -> None:
        self.tp = parallel_state.get_tensor_model_parallel_world_size()
        if self.tp != pcfg.tensor_parallel:
            raise ValueError(
                f"megatron's parallel state has tensor_parallel={self.tp}, the recipe {pcfg.tensor_parallel}; "
                "call init_parallel with the same ParallelConfig first"
            )
        check_parallel_layout(pcfg, config)
        self.mcfg = megatron_config(config, self.tp, pcfg.sequence_parallel, dtype, pcfg.recompute)
        self.sequence_parallel = self.mcfg.sequence_parallel
        self.stream_shards = self.tp if self.sequence_parallel else 1
        self.recompute = pcfg.recompute
        self.cp = parallel_state.get_context_parallel_world_size()
        self.cp_rank = parallel_state.get_context_parallel_rank()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.config = config
        self.seed = seed
        # Linears inside a sub-layer see inputs already gathered once (SP) or copied once (TP), so
        # they must neither gather again nor reduce their input gradient a second time.
        self._inner = dataclasses.replace(self.mcfg, sequence_parallel=False)

    def linear(self, name: str, in_features: int, out_features: int, bias: bool) -> nn.Module:
        if split_rule(name + ".weight") == SPLIT_ROWS:
            return ColumnLinear(
                in_features, out_features, config=self._inner, init_method=self.mcfg.init_method,
                bias=bias, gather_output=False, skip_bias_add=False, disable_grad_reduce=True,
            )
        return RowLinear(
            in_features, out_features, config=self.mcfg, init_method=self.mcfg.output_layer_init_method,
            bias=bias, input_is_parallel=True, skip_bias_add=False,
        )

    def embedding(self, num_embeddings: int, dim: int) -> nn.Module:
        # Full rows on every TP rank (all-reduced); the first layer shards them under SP.
        return VocabEmbedding(num_embeddings, dim, init_method=self.mcfg.init_method, config=self._inner)

    def lm_head(self, hidden_size: int, vocab_size: int) -> VocabParallelLMHead:
        # Reads the full (gathered) output stream; its copy-to-TP sums the input gradient. A tied
        # head gets the embedding's weight from the model, so it allocates none of its own.
        return VocabParallelLMHead(
            hidden_size, vocab_size, config=self._inner, init_method=self.mcfg.init_method,
            bias=False, gather_output=False, skip_bias_add=False,
            skip_weight_param_allocation=self.config.tie_word_embeddings,
        )

    def norm(self, name: str, dim: int, eps: float) -> RMSNorm:
        partial = name in ("q_norm", "k_norm") or (self.sequence_parallel and name != "norm")
        return TPReducedRMSNorm(dim, eps) if partial and self.tp > 1 else RMSNorm(dim, eps)

    def head_parameter(self, fill: float, heads: int, head_dim: int) -> nn.Parameter:
        p = nn.Parameter(torch.full((heads // self.tp, head_dim), fill))
        set_tensor_model_parallel_attributes(p, is_parallel=True, dim=0, stride=1)
        return p

    def attention(self, config: OrthrosConfig, layer_idx: int) -> OrthrosAttention:
        return ParallelAttention(config, layer_idx, self)

    def mlp(self, config: OrthrosConfig) -> SwiGLU:
        return ParallelSwiGLU(config, self)

    def moe(self, config: OrthrosConfig) -> SparseMoE:
        # Imported here: parallel/moe.py imports DeepSpeed, which must come after the CPU shims
        # (init_parallel) have set its accelerator.
        from orthros_train.parallel.moe import build_moe

        return build_moe(config, self)

    def block(self, config: OrthrosConfig, layer_idx: int) -> OrthrosBlock:
        return ParallelBlock(config, layer_idx, self)

    def fused_tokenwise(self, config: OrthrosConfig) -> FusedTokenwise:
        # The fused path reads the norms' and the LM head's weights directly, without the TP
        # communication these modules carry when split (the norms' gradient sum, the vocab-parallel
        # cross entropy): it runs at tensor_parallel=1 only (context parallelism keeps it).
        mode = config.fused_tokenwise
        if self.tp == 1 or mode == FusedTokenwise.off:
            return mode
        if mode == FusedTokenwise.on:
            raise UserError(
                f"model.fused_tokenwise=on with parallel.tensor_parallel={self.tp}: the fused token-wise path "
                "runs at tensor_parallel=1 only; set model.fused_tokenwise=auto (eager under TP) or off"
            )
        return FusedTokenwise.off

    def plan(self, config: OrthrosConfig, layout: OrthrosLayout, cache: KVCache | None) -> AttentionPlan:
        # A cached forward (generation) is not split over CP: every CP rank holds all the weights
        # and decodes the whole sequence, as under TP alone.
        if self.cp > 1 and cache is None:
            return context_plan(config, layout, self.cp_rank, self.cp, gather=_gather_context_parallel)
        return plan_for_layout(config, layout, cache)

    def initialise(self, model: OrthrosForCausalLM) -> None:
        """Each shard from the whole tensor ``initial_value`` draws, in reference order from one
        seeded generator: the weights are the same at every TP size. One full tensor at a time.
        With ``seed=None`` nothing is drawn: the caller loads every weight (a checkpoint)."""
        if self.seed is None:
            return
        generator = torch.Generator().manual_seed(self.seed)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, shape in reference_shapes(self.config).items():
                full = {name: initial_value(self.config, name, shape, generator)}
                if name in params:  # a tied LM head is the embedding
                    params[name].copy_(shard_tensor(name, full, self.config, self.tp, self.tp_rank))


def build_parallel_model(
    config: OrthrosConfig, pcfg: ParallelConfig, dtype: torch.dtype = torch.float32, seed: int | None = 0
) -> OrthrosForCausalLM:
    """This rank's shard of the Orthros model (megatron's parallel state must be initialised),
    randomly initialised with ``seed`` the same way at every TP size; ``seed=None`` leaves the
    weights for the caller to load (``parallel.state_dict.load_reference_shards``)."""
    model = OrthrosForCausalLM(config, TensorParallelFactory(config, pcfg, dtype, seed))
    if pcfg.compile:
        apply_regional_compile(model)
    return model
