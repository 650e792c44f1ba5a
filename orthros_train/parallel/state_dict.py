"""Map weights between the reference model (``model/``) and its tensor-parallel twin.

The reference state dict is the interchange format: checkpoints, HF conversion and random
initialisation all go through it, so a run's weights never depend on its TP size.

Per-rank layouts: q rows, gamma/beta rows, embedding and LM-head rows are contiguous chunks of
heads/vocab; ``linear_kv`` is ``[k_r; v_r]``; the MLP's ``linear_fc1`` is ``[gate_r; up_r]``;
``linear_proj`` and ``linear_fc2`` hold column chunks.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from orthros_train.model.config import OrthrosConfig

# reference suffix -> (parallel suffix, how it is split)
_LAYER_MAP = {
    "input_layernorm.weight": ("input_layernorm.weight", "replicate"),
    "post_attention_layernorm.weight": ("post_attention_layernorm.weight", "replicate"),
    "self_attn.q_proj.weight": ("self_attention.linear_q.weight", "rows"),
    "self_attn.q_proj.bias": ("self_attention.linear_q.bias", "rows"),
    "self_attn.o_proj.weight": ("self_attention.linear_proj.weight", "cols"),
    "self_attn.q_norm.weight": ("self_attention.q_norm.weight", "replicate"),
    "self_attn.k_norm.weight": ("self_attention.k_norm.weight", "replicate"),
    "self_attn.gamma": ("self_attention.gamma", "rows"),
    "self_attn.beta": ("self_attention.beta", "rows"),
    "mlp.down_proj.weight": ("mlp.linear_fc2.weight", "cols"),
}
# Pairs fused into one column-parallel weight, per rank [first_r; second_r].
_FUSED = {
    ("self_attn.k_proj.weight", "self_attn.v_proj.weight"): "self_attention.linear_kv.weight",
    ("self_attn.k_proj.bias", "self_attn.v_proj.bias"): "self_attention.linear_kv.bias",
    ("mlp.gate_proj.weight", "mlp.up_proj.weight"): "mlp.linear_fc1.weight",
}
_TOP_MAP = {
    "embed_tokens.weight": ("embedding.weight", "rows"),
    "norm.weight": ("final_norm.weight", "replicate"),
    "lm_head.weight": ("output_layer.weight", "rows"),
}


def _split(t: torch.Tensor, how: str, tp: int, rank: int) -> torch.Tensor:
    if how == "replicate":
        return t.clone()
    dim = 0 if how == "rows" else 1
    return t.chunk(tp, dim=dim)[rank].clone()


class LazyCheckpoint(Mapping[str, torch.Tensor]):
    """Tensors of a safetensors checkpoint directory, read one at a time on access.

    Sharding an 8B checkpoint for one TP rank then holds one full tensor plus the rank's slices,
    never the whole model.
    """

    def __init__(self, directory: str | Path) -> None:
        from safetensors import safe_open

        directory = Path(directory)
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors weights in {directory}: not an Orthros checkpoint directory")
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where = {key: h for h in self._handles for key in h.keys()}

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._where:
            raise KeyError(f"the checkpoint has no tensor {key!r}")
        return self._where[key].get_tensor(key)

    def __contains__(self, key: object) -> bool:  # Mapping's default would read the tensor
        return key in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def shard_state_dict(
    full: Mapping[str, torch.Tensor], cfg: OrthrosConfig, tp: int, rank: int
) -> dict[str, torch.Tensor]:
    """The reference state dict -> the state dict of TP rank ``rank`` of ``tp``."""
    targets = []
    for name, (target, _) in _TOP_MAP.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name not in full:
            raise KeyError(f"weights lack {name!r} (is tie_word_embeddings set right for this checkpoint?)")
        targets.append(target)
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        # Optional tensors (biases, q/k norms) are sharded when the checkpoint has them.
        targets += [p + target for suffix, (target, _) in _LAYER_MAP.items() if p + suffix in full]
        targets += [p + target for (a, _), target in _FUSED.items() if p + a in full]
    return {target: shard_tensor(target, full, cfg, tp, rank) for target in targets}


# parallel name (suffix within a layer, or top-level) -> how its TP parts join into reference tensors
_LAYER_SOURCES = {source: (ref, how) for ref, (source, how) in _LAYER_MAP.items()}
_FUSED_SOURCES = {source: pair for pair, source in _FUSED.items()}
_TOP_SOURCES = {source: (ref, how) for ref, (source, how) in _TOP_MAP.items()}


def _join(parts: list[torch.Tensor], how: str) -> torch.Tensor:
    if how == "replicate":
        return parts[0].clone()
    return torch.cat(parts, dim=0 if how == "rows" else 1)


def _reference_sources(name: str) -> tuple[list[str], str] | None:
    """The reference tensor(s) parallel tensor ``name`` is made of, and how its TP parts join
    (``replicate``/``rows``/``cols``, or ``fused`` for ``[a_r; b_r]``); None outside the map."""
    if name in _TOP_SOURCES:
        ref, how = _TOP_SOURCES[name]
        return [ref], how
    prefix, _, rest = name.partition(".")
    layer, _, suffix = rest.partition(".")
    if prefix != "layers" or not layer.isdigit():
        return None
    p = f"layers.{layer}."
    if suffix in _LAYER_SOURCES:
        ref, how = _LAYER_SOURCES[suffix]
        return [p + ref], how
    if suffix in _FUSED_SOURCES:
        return [p + ref for ref in _FUSED_SOURCES[suffix]], "fused"
    return None


def unshard_tensor(name: str, parts: list[torch.Tensor], cfg: OrthrosConfig) -> dict[str, torch.Tensor]:
    """The TP parts (in rank order) of one parallel tensor -> its reference tensor(s).

    Works for anything shaped like the parameter (weights, gradients, Adam moments), one tensor at
    a time, so a caller can stream a model through it. Names outside the map give ``{}``.
    """
    sources = _reference_sources(name)
    if sources is None or (name.startswith("layers.") and int(name.split(".")[1]) >= cfg.num_hidden_layers):
        return {}
    refs, how = sources
    if how == "fused":
        halves = [t.chunk(2, dim=0) for t in parts]  # each rank holds [a_r; b_r]
        return {ref: torch.cat([h[i] for h in halves]) for i, ref in enumerate(refs)}
    return {refs[0]: _join(parts, how)}


def shard_tensor(
    name: str, full: Mapping[str, torch.Tensor], cfg: OrthrosConfig, tp: int, rank: int
) -> torch.Tensor | None:
    """TP rank ``rank``'s part of the parallel tensor ``name``, read from the reference tensors of
    ``full`` (the inverse of ``unshard_tensor``; one tensor at a time). None for names outside the
    map; KeyError when ``full`` lacks a source tensor."""
    sources = _reference_sources(name)
    if sources is None:
        return None
    refs, how = sources
    if how == "fused":
        return torch.cat([_split(full[ref], "rows", tp, rank) for ref in refs])
    return _split(full[refs[0]], how, tp, rank)


def unshard_state_dicts(shards: list[dict[str, torch.Tensor]], cfg: OrthrosConfig) -> dict[str, torch.Tensor]:
    """State dicts of all TP ranks (in rank order) -> the reference state dict."""
    full: dict[str, torch.Tensor] = {}
    for name in shards[0]:
        full.update(unshard_tensor(name, [s[name] for s in shards], cfg))
    _tie(full, cfg)
    return full


def _tie(full: dict[str, torch.Tensor], cfg: OrthrosConfig) -> None:
    if "embed_tokens.weight" not in full:
        raise KeyError("the parallel state dict has no embedding.weight")
    if cfg.tie_word_embeddings:
        full["lm_head.weight"] = full["embed_tokens.weight"]
    elif "lm_head.weight" not in full:
        raise KeyError("the parallel state dict has no output_layer.weight (untied LM head)")


def gather_reference_tensor(name: str, local: torch.Tensor, cfg: OrthrosConfig) -> dict[str, torch.Tensor]:
    """All-gather one tensor over the TP group and unshard it (collective over TP ranks; every TP
    rank gets the result). Peak memory: one full tensor plus its parts."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp == 1:
        return unshard_tensor(name, [local], cfg)
    gathered = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(gathered, local.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return unshard_tensor(name, gathered, cfg)


def _gather_over_tp(local: dict[str, torch.Tensor], cfg: OrthrosConfig) -> dict[str, torch.Tensor]:
    full: dict[str, torch.Tensor] = {}
    for name, tensor in local.items():
        full.update(gather_reference_tensor(name, tensor, cfg))
    _tie(full, cfg)
    return full


def gather_full_state_dict(model: torch.nn.Module, cfg: OrthrosConfig) -> dict[str, torch.Tensor]:
    """All-gather the TP shards of ``model`` into the reference state dict (on every rank)."""
    local = {k: v.detach() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    return _gather_over_tp(local, cfg)


def gather_full_grads(model: torch.nn.Module, cfg: OrthrosConfig) -> dict[str, torch.Tensor]:
    """The gradients of ``model`` in reference layout (tests, debugging)."""
    grads = {n: (p.grad.detach() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
    return _gather_over_tp(grads, cfg)
