"""The sparse MLP of a mixture-of-experts Orthros layer in vLLM, on vLLM's fused MoE layer.

The experts are vLLM's fused MoE layer (``FusedMoEFactory``) (its fused kernels on CPU and GPU, its tensor/expert
parallelism and its checkpoint loading of ``mlp.experts.{e}.{gate,up,down}_proj``). The routing is
the project's (``orthros_train/model/moe.py``): every row's router probabilities, then
``select_experts`` under the checkpoint's ``moe_routing`` policy, where an output row knows its
base row (``rows``: the token row each output token starts from). Under ``tied`` an output token
takes the experts its base token chose; under ``joint`` a base token with an output token in the
same call and that output token take the choice of the mean of their probabilities; every row
then weights its experts by its own probabilities (``mixing_weights``, renormalised when
``norm_topk_prob``). In the last layer only the output stream passes the MLP: it routes alone.

vLLM's router decides per row from that row's logits alone, so the decision reaches it packed
into the router logits: ``[own logits | a k-hot row of the chosen experts]``, and the layer's
custom routing function (``packed_routing``) takes the top-k of the second half and the mixing
weights from the first. The choice is made in the model's own (compiled) code, with the pairing
as an input of the graph, not state read at run time.

A base token's routing under ``joint`` depends on whether an output token shares its call, so its
K/V do too: the rows that carry output tokens in a step (the last row of each prefill chunk,
verified draft positions, the prompts of prompt-logprob requests) route as pairs, as the
project's model routes whatever its layout pairs. ``tied`` and ``independent`` route base tokens
alone in every layout.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.fused_moe import FusedMoEFactory
from vllm.model_executor.layers.linear import ReplicatedLinear

from orthros_train.model.moe import StreamPairs, mixing_weights, select_experts
from orthros_train.options import MoERouting


def packed_routing(hidden_states: torch.Tensor, gating_output: torch.Tensor, topk: int,
                   renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's custom routing function for the packed logits ``[own logits | k-hot choice]``:
    ``(weights, experts)`` of every row."""
    num_experts = gating_output.shape[-1] // 2
    logits, chosen = gating_output[:, :num_experts], gating_output[:, num_experts:]
    experts = torch.topk(chosen, topk, dim=-1).indices
    weights = mixing_weights(torch.softmax(logits.float(), dim=-1), experts, renormalize)
    return weights, experts


class OrthrosSparseMoE(nn.Module):
    """Router, vLLM's fused experts and Qwen2-MoE's gated shared expert of one sparse layer."""

    def __init__(self, vllm_config: VllmConfig, prefix: str, mlp: Callable[[int, int, str], nn.Module]) -> None:
        """``mlp(hidden, intermediate, prefix)`` builds the shared expert (the model's dense MLP)."""
        super().__init__()
        config = vllm_config.model_config.hf_config
        d = config.hidden_size
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.policy = MoERouting.parse(config.moe_routing, "moe_routing")
        self.gate = ReplicatedLinear(d, self.num_experts, bias=False, prefix=f"{prefix}.gate")
        self.experts = FusedMoEFactory(
            num_experts=self.num_experts, top_k=self.top_k, hidden_size=d,
            intermediate_size=config.moe_intermediate_size, renormalize=bool(config.norm_topk_prob),
            reduce_results=True, custom_routing_function=packed_routing, prefix=f"{prefix}.experts",
        )
        shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
        self.shared_expert = mlp(d, shared, f"{prefix}.shared_expert") if shared else None
        self.shared_expert_gate = (ReplicatedLinear(d, 1, bias=False, prefix=f"{prefix}.shared_expert_gate")
                                   if shared else None)

    def forward(self, h: torch.Tensor, n_base: int, rows: torch.Tensor) -> torch.Tensor:
        """``h``: ``n_base`` base rows, then one row per output token (output token j's base row is
        ``rows[j]``); ``n_base = 0``: the output tokens alone (the last layer)."""
        logits, _ = self.gate(h)
        probs = torch.softmax(logits.float(), dim=-1)
        pairs = StreamPairs(num_base=n_base, out_base_row=rows) if n_base else StreamPairs.alone(h.shape[0], h.device)
        experts = select_experts(probs, pairs, self.policy, self.top_k)
        chosen = torch.zeros_like(probs).scatter_(1, experts, 1.0)
        out = self.experts(hidden_states=h, router_logits=torch.cat([logits.float(), chosen], dim=-1))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(h)[0]) * self.shared_expert(h)
        return out
