"""How each weight of the Orthros model is split over tensor- and expert-parallel ranks.

The parallel model (``parallel/model.py``) uses the reference model's parameter names at every
TP size, so the reference state dict (the interchange format: checkpoints, HF conversion,
random initialisation) maps to a rank's tensors by one rule per weight: ``rows`` (a contiguous
chunk of dim 0: heads, the MLP's intermediate features, the vocabulary), ``cols`` (a chunk of
dim 1: the inputs of the row-parallel output projections) or ``replicate`` (norms, the MoE
router and the shared expert's gate).

Routed experts (``layers.L.mlp.experts.E.*``) are whole on the rank that holds them (expert
tensor parallel = 1) and keep their global name there: expert-parallel rank r of ``ep`` holds
experts ``[r * E / ep, (r + 1) * E / ep)``. A rank's expert tensor *is* the reference tensor of
the same name (``replicate`` over TP), so loading at any EP size reads the experts the rank
holds by name; saving gathers every rank's experts over the expert-parallel group.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from megatron.core import parallel_state

from orthros_train.errors import UserError
from orthros_train.model.config import OrthrosConfig
from orthros_train.model.orthros import OrthrosForCausalLM
from orthros_train.parallel import collectives

SPLIT_ROWS, SPLIT_COLS, REPLICATE = "rows", "cols", "replicate"

# The last one or two components of a parameter name -> its split rule.
_RULES = {
    "embed_tokens.weight": SPLIT_ROWS,
    "lm_head.weight": SPLIT_ROWS,
    "q_proj.weight": SPLIT_ROWS,
    "q_proj.bias": SPLIT_ROWS,
    "k_proj.weight": SPLIT_ROWS,
    "k_proj.bias": SPLIT_ROWS,
    "v_proj.weight": SPLIT_ROWS,
    "v_proj.bias": SPLIT_ROWS,
    "gate_proj.weight": SPLIT_ROWS,
    "up_proj.weight": SPLIT_ROWS,
    "gamma": SPLIT_ROWS,
    "beta": SPLIT_ROWS,
    "o_proj.weight": SPLIT_COLS,
    "down_proj.weight": SPLIT_COLS,
    "input_layernorm.weight": REPLICATE,
    "post_attention_layernorm.weight": REPLICATE,
    "q_norm.weight": REPLICATE,
    "k_norm.weight": REPLICATE,
    "norm.weight": REPLICATE,
    "gate.weight": REPLICATE,  # the MoE router (mlp.gate)
    "shared_expert_gate.weight": REPLICATE,
}


def split_rule(name: str) -> str | None:
    """``rows`` / ``cols`` / ``replicate`` for a parameter name of the model; None for anything
    else (e.g. megatron's ``_extra_state`` entries)."""
    parts = name.split(".")
    rule = _RULES.get(".".join(parts[-2:])) or _RULES.get(parts[-1])
    if rule is not None and routed_expert_index(name) is not None:
        return REPLICATE  # whole on the rank holding it (no expert tensor parallelism)
    return rule


def routed_expert_index(name: str) -> int | None:
    """The global index ``e`` of ``...mlp.experts.<e>.<proj>.weight`` (a routed expert), else None."""
    parts = name.split(".")
    for i in range(len(parts) - 2):
        if parts[i] == "mlp" and parts[i + 1] == "experts" and parts[i + 2].isdigit():
            return int(parts[i + 2])
    return None


def expert_name(name: str, expert: int) -> str:
    """``name`` (a routed expert's tensor) for expert ``expert`` of the same layer."""
    parts = name.split(".")
    i = parts.index("experts")
    return ".".join([*parts[: i + 1], str(expert), *parts[i + 2 :]])


def _in_model(name: str, cfg: OrthrosConfig) -> bool:
    parts = name.split(".")
    return not (parts[0] == "layers" and (not parts[1].isdigit() or int(parts[1]) >= cfg.num_hidden_layers))


def _split(t: torch.Tensor, how: str, tp: int, rank: int) -> torch.Tensor:
    if how == REPLICATE:
        return t.clone()
    dim = 0 if how == SPLIT_ROWS else 1
    return t.chunk(tp, dim=dim)[rank].clone()


def _join(parts: list[torch.Tensor], how: str) -> torch.Tensor:
    if how == REPLICATE:
        return parts[0].clone()
    return torch.cat(parts, dim=0 if how == SPLIT_ROWS else 1)


def shard_tensor(
    name: str, full: Mapping[str, torch.Tensor], cfg: OrthrosConfig, tp: int, rank: int
) -> torch.Tensor | None:
    """TP rank ``rank``'s part of parameter ``name``, read from ``full[name]`` (reference layout;
    anything shaped like the parameter: weights, Adam moments). None for names without a rule;
    KeyError when ``full`` lacks the tensor."""
    how = split_rule(name)
    if how is None or not _in_model(name, cfg):
        return None
    return _split(full[name], how, tp, rank)


def unshard_tensor(name: str, parts: list[torch.Tensor], cfg: OrthrosConfig) -> dict[str, torch.Tensor]:
    """The TP parts (in rank order) of one tensor -> ``{name: reference tensor}`` (``{}`` for
    names without a rule). One tensor at a time, so a caller can stream a model through it."""
    how = split_rule(name)
    if how is None or not _in_model(name, cfg):
        return {}
    return {name: _join(parts, how)}


def reference_shapes(cfg: OrthrosConfig) -> dict[str, torch.Size]:
    """Every parameter of the reference model and its whole shape, in parameter order (a tied
    LM head is the embedding and not listed). Built on the meta device: no memory."""
    with torch.device("meta"):
        model = OrthrosForCausalLM(cfg)
    return {name: p.shape for name, p in model.named_parameters()}


def load_reference_shards(model: torch.nn.Module, full: Mapping[str, torch.Tensor], cfg: OrthrosConfig) -> None:
    """Copy this TP rank's part of every weight from ``full`` (reference layout, e.g. a
    ``SafetensorsReader``) into ``model``, one tensor at a time."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    # Every tensor of the reference model, not only this rank's: the experts other EP ranks hold
    # are in a full checkpoint too.
    own = set(model.state_dict()) | set(reference_shapes(cfg))
    unexpected = sorted(k for k in full if k not in own)
    if unexpected:
        raise UserError(
            f"the weights hold {len(unexpected)} tensors this model does not have, e.g. {unexpected[:5]} "
            "(they were made for another model config)"
        )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name not in full:
                raise UserError(
                    f"the weights lack {name!r}"
                    + (" (is tie_word_embeddings set right for this checkpoint?)" if name == "lm_head.weight" else "")
                )
            value = shard_tensor(name, full, cfg, tp, rank)
            if value is None or value.shape != param.shape:
                raise UserError(
                    f"{name} has shape {tuple(full[name].shape)}, the model expects "
                    f"{tuple(reference_shapes(cfg)[name])} (the checkpoint was made for another config)"
                )
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                raise UserError(
                    f"{name} holds NaN or infinite values: the weights are corrupt or were saved from a diverged "
                    "run; start from an earlier checkpoint or fetch the weights again"
                )
            param.copy_(value)


def gather_reference_tensor(name: str, local: torch.Tensor, cfg: OrthrosConfig) -> dict[str, torch.Tensor]:
    """All-gather one tensor over the TP group and unshard it (collective over TP ranks; every TP
    rank gets the result). Peak memory: one full tensor plus its parts.

    A routed expert's tensor is gathered over the expert-parallel group instead: the result holds
    the same tensor of every EP rank's expert at this local index (``ep`` reference tensors, in
    expert order), so every rank sees the same names in the same order."""
    expert = routed_expert_index(name)
    if expert is not None and _in_model(name, cfg):
        ep = parallel_state.get_expert_model_parallel_world_size()
        if ep == 1:
            return {name: local}
        local_index = expert % (cfg.num_experts // ep)
        gathered = collectives.all_gather(local, group=parallel_state.get_expert_model_parallel_group())
        per_rank = cfg.num_experts // ep
        return {expert_name(name, r * per_rank + local_index): t for r, t in enumerate(gathered)}
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1 or split_rule(name) == REPLICATE:
        return unshard_tensor(name, [local], cfg)
    gathered = collectives.all_gather(local, group=parallel_state.get_tensor_model_parallel_group())
    return unshard_tensor(name, gathered, cfg)


def _gather_over_tp(local: dict[str, torch.Tensor], cfg: OrthrosConfig) -> dict[str, torch.Tensor]:
    full: dict[str, torch.Tensor] = {}
    for name, tensor in local.items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue  # the embedding, gathered once
        full.update(gather_reference_tensor(name, tensor, cfg))
    if "embed_tokens.weight" not in full:
        raise KeyError("the parallel state dict has no embed_tokens.weight")
    if cfg.tie_word_embeddings:
        full["lm_head.weight"] = full["embed_tokens.weight"]
    return full


def gather_full_state_dict(model: torch.nn.Module, cfg: OrthrosConfig) -> dict[str, torch.Tensor]:
    """All-gather the TP shards of ``model`` into the reference state dict (on every rank)."""
    local = {k: v.detach() for k, v in model.state_dict().items() if split_rule(k) is not None}
    return _gather_over_tp(local, cfg)


def gather_full_grads(model: torch.nn.Module, cfg: OrthrosConfig) -> dict[str, torch.Tensor]:
    """The gradients of ``model`` in reference layout (tests, debugging)."""
    grads = {n: (p.grad.detach() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
    return _gather_over_tp(grads, cfg)
