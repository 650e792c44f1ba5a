"""The mixture of experts of a sparse layer with megatron-core's token dispatcher and experts.

``model/moe.py`` is the one statement of the routing (the policies ``independent``/``tied``/
``joint``, the mixing weights, the load-balancing and z losses). This module runs it at scale:

* **Router.** An adapter in place of megatron's ``TopKRouter``: the router logits of this rank's
  rows are gathered over the TP group under sequence parallelism (a position's base and output
  tokens may sit on different ranks, and the tied/joint policies need both), the model's own
  ``route`` picks every row's experts and mixing weights on the whole pass, and this rank keeps
  its rows in megatron's ``(probs, routing_map)`` form (``[rows, E]``, zero / False off the
  chosen experts). The aux losses are the model's functions of the whole pass's routing, so they
  equal the one-device model's (megatron's own aux loss normalises over its sequence-parallel
  shard and the ``moe_aux_loss_coeff``/``topk`` of its config instead).
* **Dispatch.** megatron-core's ``MoEAlltoAllTokenDispatcher`` sends every (token, expert) row to
  the rank holding the expert (all-to-all over the expert-parallel group) and brings the outputs
  back; nothing here communicates tokens itself.
* **Experts.** megatron-core's ``SequentialMLP`` loop over this rank's ``num_experts /
  expert_parallel`` local experts; the experts are the model's SwiGLU under their reference names
  (``mlp.experts.{e}.gate_proj.weight`` with ``e`` the global index), so checkpoints map them by
  name at any EP size (``parallel/state_dict.py``). Expert tensor parallel is 1: an expert is
  whole on its rank.
* **Shared expert** (Qwen2-MoE): TP-split like the dense MLP, its sigmoid gate replicated.

Expert parameters that differ between the ranks of the data-parallel group (EP > 1) or see only
part of the tokens (TP > 1 under SP) are DeepSpeed MoE parameters (``allreduce=False``,
``group_name``): DeepSpeed reduces their gradients over megatron's expert-data-parallel group
(``parallel/engine.py`` registers it) and ZeRO partitions them there.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import deepspeed.moe.layer
import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_utils import ProcessGroupCollection
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
from torch import nn

from orthros_train.model.config import OrthrosConfig
from orthros_train.model.layers import SwiGLU, _plain_linear
from orthros_train.model.moe import MoEOutput, SparseMoE, StreamPairs, load_balancing_loss, route, router_z_loss
from orthros_train.parallel.streams import StreamShards, gather_tokens


class MoEFactory(Protocol):
    """What a sparse layer reads of ``parallel/model.py``'s ``TensorParallelFactory`` (named here as
    a protocol: that module imports this one)."""

    tp: int
    tp_rank: int
    sequence_parallel: bool
    stream_shards: int
    mcfg: TransformerConfig

    def linear(self, name: str, in_features: int, out_features: int, bias: bool) -> nn.Module: ...


EXPERT_GROUP_PREFIX = "ep_size_"  # DeepSpeed's name of an expert group: ep_size_<expert_parallel>


def expert_group_name(expert_parallel: int) -> str:
    """The ``group_name`` DeepSpeed files expert parameters and their process groups under."""
    return f"{EXPERT_GROUP_PREFIX}{expert_parallel}"


def local_expert_range(num_experts: int) -> range:
    """The global indices of the experts this rank holds (a contiguous block, megatron's order)."""
    ep = parallel_state.get_expert_model_parallel_world_size()
    rank = parallel_state.get_expert_model_parallel_rank()
    per_rank = num_experts // ep
    return range(rank * per_rank, (rank + 1) * per_rank)


def moe_megatron_config(mcfg: TransformerConfig, cfg: OrthrosConfig) -> TransformerConfig:
    """megatron's config of the dispatcher and the experts: dropless all-to-all, no fused permute
    (it needs Transformer Engine), expert tensor parallel 1. Routing is ours, so megatron's router
    settings are not used."""
    return dataclasses.replace(
        mcfg,
        num_moe_experts=cfg.num_experts,
        moe_router_topk=cfg.num_experts_per_tok,
        moe_ffn_hidden_size=cfg.moe_intermediate_size,
        moe_token_dispatcher_type="alltoall",
        moe_permute_fusion=False,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=1,
    )


class Expert(SwiGLU):
    """One routed expert, whole on its rank, called the way megatron's ``SequentialMLP`` calls an
    expert: ``(tokens, probs) -> (output, bias)``. The weight multiplies the expert's output, as
    the one-device model does (``model/moe.py: combine_experts``)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__(hidden_size, intermediate_size, _plain_linear)

    def forward(self, x: torch.Tensor, probs: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        out = super().forward(x)
        return (out if probs is None else out * probs[:, None].to(out.dtype)), None


class LocalExperts(SequentialMLP):
    """megatron-core's ``SequentialMLP`` (one expert after another on the rows the dispatcher sorted
    by expert) over this rank's experts, registered under their global indices: the parameter
    names are the reference model's (``experts.{e}.gate_proj.weight``) at every EP size, which
    megatron's own ``local_experts.{i}.linear_fc1`` (gate and up fused) would not be."""

    def __init__(self, config: TransformerConfig, hidden_size: int, experts: range) -> None:
        MegatronModule.__init__(self, config=config)  # SequentialMLP.__init__ would build megatron MLPs
        self.num_local_experts = len(experts)
        for e in experts:
            self.add_module(str(e), Expert(hidden_size, config.moe_ffn_hidden_size))

    @property
    def local_experts(self) -> list[nn.Module]:  # what SequentialMLP.forward iterates
        return list(self.children())


class SharedExpert(SwiGLU):
    """Qwen2-MoE's shared expert: TP-split like the dense MLP (gate/up column-, down row-parallel),
    so under SP its input is gathered once and its output reduce-scattered back to this rank's rows."""

    def __init__(self, hidden_size: int, width: int, factory: MoEFactory) -> None:
        super().__init__(hidden_size, width, factory.linear)
        self.sequence_parallel = factory.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(gather_tokens(x, self.sequence_parallel))


class ReplicatedLinear(nn.Linear):
    """A bias-free linear every TP rank holds whole (the router, the shared expert's gate). Under SP
    each rank applies it to its own rows, so its weight gradient is summed over TP in autograd."""

    def __init__(self, in_features: int, out_features: int, tp_reduce: bool) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.tp_reduce = tp_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = copy_to_tensor_model_parallel_region(self.weight) if self.tp_reduce else self.weight
        return F.linear(x, weight)


class ParallelSparseMoE(SparseMoE):
    """The model's ``SparseMoE`` on this rank: router adapter, megatron's all-to-all dispatcher and
    ``SequentialMLP`` over the local experts, the shared expert split over TP."""

    def __init__(self, config: OrthrosConfig, factory: MoEFactory) -> None:
        # SparseMoE.__init__ would build all experts through the factory's TP linears: build this
        # rank's parts instead (the next __init__ in the MRO still runs, for the DeepSpeed kind).
        super(SparseMoE, self).__init__()
        d = config.hidden_size
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.policy = config.moe_routing
        self.routing_log = None
        self.sequence_parallel = factory.sequence_parallel
        self.shards = factory.stream_shards
        self.tp_rank = factory.tp_rank
        self.gate = ReplicatedLinear(d, config.num_experts, tp_reduce=self.sequence_parallel)
        mcfg = moe_megatron_config(factory.mcfg, config)
        experts = local_expert_range(config.num_experts)
        self.experts = LocalExperts(mcfg, d, experts)
        # megatron's dispatcher: a plain object holding no parameters (nothing in the state dict).
        self.dispatcher = MoEAlltoAllTokenDispatcher(
            len(experts), list(experts), mcfg,
            pg_collection=ProcessGroupCollection.use_mpu_process_groups(required_pgs=["ep", "expt_tp", "tp_ep"]),
        )  # fmt: skip
        self.shared_expert = None
        self.shared_expert_gate = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = SharedExpert(d, config.shared_expert_intermediate_size, factory)
            self.shared_expert_gate = ReplicatedLinear(d, 1, tp_reduce=self.sequence_parallel)

    def forward(self, h: torch.Tensor, pairs: StreamPairs) -> MoEOutput:
        """``h``: this rank's rows of the normed ``[x; y]`` (under SP its slice ``[x_r; y_r]``);
        ``pairs``: the stream pairs of the whole pass."""
        probs, routing_map, aux, z = self.router(h, pairs)
        dispatcher = self.dispatcher
        tokens, probs = dispatcher.dispatch_preprocess(h, routing_map, probs)
        tokens, probs = dispatcher.token_dispatch(tokens, probs)
        tokens, tokens_per_expert, probs = dispatcher.dispatch_postprocess(tokens, probs)
        expert_out, _ = self.experts(tokens, tokens_per_expert, probs)
        out = dispatcher.combine_preprocess(expert_out)
        out = dispatcher.token_combine(out)
        out = dispatcher.combine_postprocess(out)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(h)) * self.shared_expert(h)
        return MoEOutput(out, aux, z)

    def router(
        self, h: torch.Tensor, pairs: StreamPairs
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """megatron's ``(probs [rows, E], routing_map [rows, E])`` of this rank's rows, with the
        model's load-balancing and z losses of the whole pass."""
        logits = self.gate(h)
        streams = None
        if self.shards > 1:
            # Every rank routes the whole pass (a [rows, E] tensor: small next to the hidden
            # states) and computes the same losses from it; the gather's backward keeps each
            # rank's own rows, so the router gradient of every row is counted once.
            streams = StreamShards.of_rows(pairs.num_base, pairs.num_out, self.shards)
            x, y = streams.split(gather_tokens(logits, True, output_grad_partial=False))
            logits = torch.cat([x, y])
        routing = route(logits, pairs, self.policy, self.top_k, self.norm_topk_prob)
        aux, z = load_balancing_loss(routing, self.num_experts), router_z_loss(routing)
        experts, weights = routing.experts, routing.weights
        valid = torch.ones(experts.shape[0], dtype=torch.bool, device=experts.device)
        if streams is not None:  # this rank's rows; its padding rows go to no expert
            experts = streams.local(experts, self.tp_rank)
            weights = streams.local(weights, self.tp_rank)
            valid = streams.local(valid, self.tp_rank)
        routing_map = torch.zeros(experts.shape[0], self.num_experts, dtype=torch.bool, device=experts.device)
        routing_map.scatter_(1, experts, True)
        routing_map &= valid[:, None]
        probs = torch.zeros(experts.shape[0], self.num_experts, dtype=weights.dtype, device=weights.device)
        probs = probs.scatter(1, experts, weights) * valid[:, None]
        return probs, routing_map, aux, z


class _DeepSpeedMoEKind(deepspeed.moe.layer.MoE):
    """Makes a module a DeepSpeed ``MoE`` layer by type, which is how DeepSpeed's engine decides to
    reduce expert gradients over the expert-data-parallel groups (``has_moe_layers``) and how ZeRO
    accepts the optimizer's MoE param groups. DeepSpeed's own layer (its gate, experts and
    all-to-all) is not built: ``__init__`` is ``nn.Module``'s."""

    def __init__(self) -> None:
        nn.Module.__init__(self)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        # DeepSpeed calls this to create its own expert groups; ours are megatron's, registered
        # under the same name by parallel/engine.py before the engine is built.
        return None


class ExpertParallelSparseMoE(ParallelSparseMoE, _DeepSpeedMoEKind):
    """``ParallelSparseMoE`` whose experts are not replicated across the data-parallel group: they
    differ between expert-parallel ranks (EP > 1) or see only this TP rank's tokens (TP > 1 under
    SP). Their parameters are DeepSpeed MoE parameters of group ``ep_size_<expert_parallel>``,
    tagged as split over TP so DeepSpeed's gradient norm counts every rank's part once."""

    def __init__(self, config: OrthrosConfig, factory: MoEFactory) -> None:
        super().__init__(config, factory)
        self.ep_size = parallel_state.get_expert_model_parallel_world_size()
        self.expert_group_name = expert_group_name(self.ep_size)
        self.num_local_experts = self.experts.num_local_experts
        for p in self.experts.parameters():
            mark_expert_parameter(p, self.expert_group_name)


def mark_expert_parameter(p: nn.Parameter, group_name: str) -> None:
    """DeepSpeed's marks of an expert parameter (``deepspeed.moe.utils.is_moe_param``)."""
    p.allreduce = False
    p.group_name = group_name
    set_tensor_model_parallel_attributes(p, is_parallel=True, dim=0, stride=1)


def build_moe(config: OrthrosConfig, factory: MoEFactory) -> ParallelSparseMoE:
    """The sparse layer for this rank's layout (see ``ExpertParallelSparseMoE`` for when experts
    have their own gradient group)."""
    distinct = parallel_state.get_expert_model_parallel_world_size() > 1 or factory.tp > 1
    return (ExpertParallelSparseMoE if distinct else ParallelSparseMoE)(config, factory)


__all__ = [
    "ExpertParallelSparseMoE",
    "MoEFactory",
    "LocalExperts",
    "ParallelSparseMoE",
    "build_moe",
    "expert_group_name",
    "local_expert_range",
    "mark_expert_parameter",
]
