"""The mixture-of-experts MLP of a sparse Orthros layer (Qwen3-MoE's, plus Qwen2-MoE's shared expert).

A sparse layer replaces the dense SwiGLU by ``num_experts`` SwiGLU experts and a linear router
(``gate``): every routed token takes the softmax of its router logits over all experts, keeps the
top-k, optionally renormalises them to sum to 1 (``norm_topk_prob``) and sums its experts'
outputs weighted by them. Qwen2-MoE adds a shared expert every token passes, scaled by a sigmoid
gate. Parameter names are the Hugging Face ones (``mlp.gate.weight``,
``mlp.experts.{e}.{gate,up,down}_proj.weight``, ``mlp.shared_expert.*``,
``mlp.shared_expert_gate.weight``), so a converted checkpoint keeps every tensor's name.

Orthros has two tokens per position that must predict: the base token (it writes K/V) and the
output token. Both pass the layer's MLP, so without care a position's pair reads up to ``2k``
experts; a decode step is bound by those weight reads. ``moe_routing`` says how a pair picks:

* ``independent``: every token routes on its own router probabilities (what a naive port does);
* ``tied``: an output token uses the experts its base token chose, weighted by its *own* router
  probabilities over that set (renormalised when ``norm_topk_prob``). Its own weights rather than
  the base token's: the output token's gate still adapts to its own hidden state, the loss (which
  only the output stream carries) trains the router through it, and when both tokens would pick the
  same set (e.g. gamma = 1, beta = 0 and a window covering the sequence) it is exactly
  ``independent``. Taking the base token's weights too would make the output stream's MLP a pure
  function of the base token's routing: fewer degrees of freedom and no router gradient from the
  loss at all outside the last layer;
* ``joint``: the pair routes once on the mean of both tokens' probabilities, and each token
  weights the chosen experts by its own probabilities (renormalised when ``norm_topk_prob``).
  Neither stream is subordinate; a pair still reads k experts.

A base token without an output token (SFT/RL prompts, prefill) routes alone under every policy.
The last Orthros layer runs no MLP on the base stream, so there the output tokens route alone.

The load-balancing loss is transformers' (Switch Transformer's) per layer,
``E * sum_e f_e * P_e`` with ``f_e`` the fraction of tokens that picked expert e among their
top-k and ``P_e`` the mean router probability of e, over every token the layer routed; the router
z-loss is ``mean(logsumexp(logits)^2)``. ``MoEOutput`` carries both to the model, which adds
``router_aux_loss_coef * aux + router_z_loss_coef * z`` (averaged over sparse layers) to the
training loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from orthros_train.model.config import OrthrosConfig
from orthros_train.model.layers import LinearFactory, SwiGLU, _plain_linear
from orthros_train.options import MoERouting


@dataclass
class StreamPairs:
    """Which rows of an MLP input ``h`` are base tokens and which base row each output row pairs with.

    ``h`` holds ``num_base`` base rows, then one row per output token; ``out_base_row[j]`` is the
    row (``< num_base``) of output token j's base token. ``num_base = 0`` means the output tokens
    have no base partner in this call (the last layer, where the base stream skips the MLP, or a
    baseline model with one stream).
    """

    num_base: int
    out_base_row: torch.Tensor  # [N] long

    @classmethod
    def alone(cls, rows: int, device: torch.device | None = None) -> "StreamPairs":
        """``rows`` tokens that route on their own (one stream, no pairs)."""
        return cls(num_base=rows, out_base_row=torch.zeros(0, dtype=torch.long, device=device))

    @property
    def num_out(self) -> int:
        return self.out_base_row.numel()


@dataclass
class Routing:
    """What the router decided for every row of one MLP call."""

    logits: torch.Tensor  # [R, E] router logits (fp32)
    probs: torch.Tensor  # [R, E] softmax of the logits (fp32)
    experts: torch.Tensor  # [R, k] chosen experts (long)
    weights: torch.Tensor  # [R, k] their mixing weights (fp32)
    pairs: StreamPairs


def select_experts(probs: torch.Tensor, pairs: StreamPairs, policy: MoERouting, top_k: int) -> torch.Tensor:
    """``[R, k]`` experts of every row from the router probabilities (no gradient flows through a
    choice). The one statement of the policies: the tensor-parallel router calls it on the probabilities
    of the whole sequence, and the serving model too."""
    n_base, n_out = pairs.num_base, pairs.num_out
    experts = torch.topk(probs, top_k, dim=-1).indices
    if n_base and n_out and policy != MoERouting.independent:
        base_of = pairs.out_base_row
        if policy == MoERouting.joint:
            chosen = torch.topk(0.5 * (probs[base_of] + probs[n_base:]), top_k, dim=-1).indices
            experts = experts.clone()
            experts[base_of] = chosen  # a base token with a partner takes the pair's choice
        else:  # tied: the base tokens' own choice
            chosen = experts[base_of]
        experts = torch.cat([experts[:n_base], chosen])
    return experts


def mixing_weights(probs: torch.Tensor, experts: torch.Tensor, norm_topk_prob: bool) -> torch.Tensor:
    """Each row's own probabilities at its experts, renormalised to sum to 1 when ``norm_topk_prob``."""
    weights = probs.gather(-1, experts)
    return weights / weights.sum(-1, keepdim=True) if norm_topk_prob else weights


def route(
    logits: torch.Tensor, pairs: StreamPairs, policy: MoERouting, top_k: int, norm_topk_prob: bool
) -> Routing:
    """The routing of every row (see the module docstring for the policies)."""
    probs = torch.softmax(logits.float(), dim=-1)
    experts = select_experts(probs, pairs, policy, top_k)
    weights = mixing_weights(probs, experts, norm_topk_prob)
    return Routing(logits=logits, probs=probs, experts=experts, weights=weights, pairs=pairs)


def load_balancing_loss(routing: Routing, num_experts: int) -> torch.Tensor:
    """Switch Transformer's auxiliary loss as transformers defines it for one layer: ``E * sum_e
    f_e * P_e`` (``f_e``: fraction of rows with e among their experts, ``P_e``: mean probability)."""
    rows = routing.probs.shape[0]
    if rows == 0:
        return routing.probs.sum()
    counts = torch.zeros(num_experts, device=routing.probs.device).index_add_(
        0, routing.experts.flatten(), torch.ones(routing.experts.numel(), device=routing.probs.device)
    )
    return num_experts * torch.sum(counts / rows * routing.probs.mean(0))


def router_z_loss(routing: Routing) -> torch.Tensor:
    """ST-MoE's router z-loss, ``mean(logsumexp(logits)^2)``: keeps the logits small."""
    if routing.logits.shape[0] == 0:
        return routing.logits.sum()
    return torch.logsumexp(routing.logits.float(), dim=-1).pow(2).mean()


@dataclass
class MoEOutput:
    hidden: torch.Tensor
    aux_loss: torch.Tensor  # this layer's load-balancing loss (0-dim)
    z_loss: torch.Tensor  # this layer's router z-loss (0-dim)


class SparseMoE(nn.Module):
    """Router + experts (+ shared expert) of one sparse layer, single device.

    Experts run one after another on the rows that chose them (transformers' loop). Setting
    ``routing_log`` to a list makes every call append its ``Routing`` (detached): how tests and
    benchmarks read which experts a step touched.
    """

    def __init__(self, config: OrthrosConfig, linear: LinearFactory = _plain_linear) -> None:
        super().__init__()
        d = config.hidden_size
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.policy = config.moe_routing
        self.gate = linear("gate", d, config.num_experts, False)
        self.experts = nn.ModuleList(
            SwiGLU(d, config.moe_intermediate_size, linear) for _ in range(config.num_experts)
        )
        self.shared_expert: SwiGLU | None = None
        self.shared_expert_gate: nn.Module | None = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = SwiGLU(d, config.shared_expert_intermediate_size, linear)
            self.shared_expert_gate = linear("shared_expert_gate", d, 1, False)
        self.routing_log: list[Routing] | None = None

    def route(self, h: torch.Tensor, pairs: StreamPairs) -> Routing:
        routing = route(self.gate(h), pairs, self.policy, self.top_k, self.norm_topk_prob)
        if self.routing_log is not None:
            self.routing_log.append(
                Routing(
                    logits=routing.logits.detach(), probs=routing.probs.detach(),
                    experts=routing.experts.detach(), weights=routing.weights.detach(), pairs=pairs,
                )
            )
        return routing

    def forward(self, h: torch.Tensor, pairs: StreamPairs) -> MoEOutput:
        routing = self.route(h, pairs)
        out = self.routed_experts(h, routing)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(h)) * self.shared_expert(h)
        return MoEOutput(out, load_balancing_loss(routing, self.num_experts), router_z_loss(routing))

    def routed_experts(self, h: torch.Tensor, routing: Routing) -> torch.Tensor:
        return combine_experts(h, routing, self.experts)


def combine_experts(
    h: torch.Tensor, routing: Routing, experts: nn.ModuleList | list[Callable[[torch.Tensor], torch.Tensor]]
) -> torch.Tensor:
    """``sum_i weights[r, i] * expert_{experts[r, i]}(h[r])`` for every row ``r``, expert by expert."""
    out = torch.zeros_like(h)
    flat_expert = routing.experts.flatten()
    flat_row = torch.arange(h.shape[0], device=h.device).repeat_interleave(routing.experts.shape[1])
    flat_weight = routing.weights.flatten()
    order = torch.argsort(flat_expert, stable=True)
    counts = torch.bincount(flat_expert, minlength=len(experts)).tolist()
    start = 0
    for e, count in enumerate(counts):
        if count:
            idx = order[start : start + count]
            rows = flat_row[idx]
            y = experts[e](h[rows]) * flat_weight[idx, None].to(h.dtype)
            out.index_add_(0, rows, y)
        start += count
    return out


def expert_reads(routing: Routing) -> dict[str, int]:
    """Distinct experts a call touched, in all and at most per position (a base token with its
    output token): what a decode step reads from memory."""
    n_base = routing.pairs.num_base
    experts = routing.experts
    per_position = experts.shape[1] if experts.numel() else 0
    if routing.pairs.num_out and n_base:
        pair = torch.cat([experts[routing.pairs.out_base_row], experts[n_base:]], dim=1)
        distinct = torch.tensor([row.unique().numel() for row in pair])
        per_position = int(distinct.max())
    return {"distinct": int(experts.unique().numel()), "max_per_position": per_position}


__all__ = [
    "MoEOutput",
    "Routing",
    "SparseMoE",
    "StreamPairs",
    "combine_experts",
    "expert_reads",
    "load_balancing_loss",
    "mixing_weights",
    "route",
    "router_z_loss",
    "select_experts",
]
