"""The Orthros model (DESIGN.md section 1), single device, no parallelism.

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
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from orthros_train.model.cache import KVCache
from orthros_train.model.config import OrthrosConfig
from orthros_train.model.layers import RMSNorm, RotaryEmbedding, SwiGLU, apply_rope
from orthros_train.ops.attention import UNBOUNDED, orthros_attention
from orthros_train.phase.builders import decode_layout, positions_layout, prefill_layout
from orthros_train.phase.layout import IGNORE_INDEX, OrthrosLayout


@dataclass
class AttentionPlan:
    """Where every query and key of one forward pass sits; shared by all layers."""

    base_positions: torch.Tensor  # [T] RoPE positions of the base tokens
    out_positions: torch.Tensor  # [N] RoPE positions of the output tokens
    base_key_index: torch.Tensor  # [T] key index of each base token (its own K/V)
    out_key_index: torch.Tensor  # [N] key index of the base token each output token sits on
    key_cu_seqlens: torch.Tensor  # document boundaries of the keys
    base_window: int
    new_lengths: torch.Tensor | None = None  # per-row new tokens when a KV cache is extended

    def queries(self, with_base: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(positions, key index, window) of the queries ``[base; output]`` (or output only)."""
        out_window = torch.full_like(self.out_key_index, UNBOUNDED)
        if not with_base:
            return self.out_positions, self.out_key_index, out_window
        base_window = torch.full_like(self.base_key_index, self.base_window)
        return (
            torch.cat([self.base_positions, self.out_positions]),
            torch.cat([self.base_key_index, self.out_key_index]),
            torch.cat([base_window, out_window]),
        )


def plan_for_layout(config: OrthrosConfig, layout: OrthrosLayout, cache: KVCache | None = None) -> AttentionPlan:
    """Query/key bookkeeping of one forward pass (keys continue the cache rows when given)."""
    window = UNBOUNDED if config.attention_type == "dense" else config.sliding_window
    if cache is None:
        key_index = torch.arange(layout.num_tokens, device=layout.input_ids.device)
        cu, new_lengths = layout.cu_seqlens, None
    else:
        if layout.cu_seqlens.numel() - 1 != layout.num_rows or layout.num_rows != cache.num_rows:
            raise ValueError("a cached forward needs exactly one document per cache row")
        new_lengths = (layout.cu_seqlens[1:] - layout.cu_seqlens[:-1]).long()
        cu, key_index = cache.key_space(new_lengths)
        cu, key_index = cu.to(layout.input_ids.device), key_index.to(layout.input_ids.device)
    # Baselines have no output stream: their outputs are read off the base stream at the end.
    out_index = layout.output_index if config.attention_type == "orthros" else layout.output_index[:0]
    return AttentionPlan(
        base_positions=layout.positions,
        out_positions=layout.positions[out_index],
        base_key_index=key_index,
        out_key_index=key_index[out_index],
        key_cu_seqlens=cu,
        base_window=window,
        new_lengths=new_lengths,
    )


class OrthrosAttention(nn.Module):
    def __init__(self, config: OrthrosConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        h, kv, hd, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = h, kv, hd
        bias = config.attention_bias
        self.q_proj = nn.Linear(d, h * hd, bias=bias)
        self.k_proj = nn.Linear(d, kv * hd, bias=bias)
        self.v_proj = nn.Linear(d, kv * hd, bias=bias)
        self.o_proj = nn.Linear(h * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(hd, config.rms_norm_eps) if config.qk_norm else None
        # The only weights the output stream does not share: q_out = norm_q(y W_q) * gamma + beta.
        self.gamma = nn.Parameter(torch.ones(h, hd))
        self.beta = nn.Parameter(torch.zeros(h, hd))
        self.rotary = RotaryEmbedding(hd, config.rope_theta, config.rope_scaling)

    def forward(
        self,
        h: torch.Tensor,
        n_base: int,
        plan: AttentionPlan,
        cache: KVCache | None,
        with_base_queries: bool,
    ) -> torch.Tensor:
        """``h`` is the normed ``[x; y]``; returns the attention output of ``[x; y]`` or of ``y``."""
        n_out = h.shape[0] - n_base
        base = h[:n_base]
        k = self.k_proj(base).view(n_base, self.num_kv_heads, self.head_dim)
        v = self.v_proj(base).view(n_base, self.num_kv_heads, self.head_dim)
        q = self.q_proj(h if with_base_queries else h[n_base:]).view(-1, self.num_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if n_out:
            q_out = q[q.shape[0] - n_out :] * self.gamma + self.beta
            q = torch.cat([q[: q.shape[0] - n_out], q_out])

        q_positions, q_index, q_window = plan.queries(with_base_queries)
        q = apply_rope(q, *self.rotary.cos_sin(q_positions))
        k = apply_rope(k, *self.rotary.cos_sin(plan.base_positions))
        if cache is not None:
            k, v = cache.extend(self.layer_idx, k, v, plan.new_lengths)

        o = orthros_attention(q, k, v, q_index, q_window, plan.key_cu_seqlens, backend=self.config.attention_backend)
        return self.o_proj(o.flatten(1))  # also for no queries (a prefill chunk without its output token)


class OrthrosBlock(nn.Module):
    def __init__(self, config: OrthrosConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = OrthrosAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

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
        n_base = x.shape[0]
        h = torch.cat([x, y])
        attn = self.self_attn(self.input_layernorm(h), n_base, plan, cache, not base_feeds_nothing)
        if base_feeds_nothing:
            h = y + attn
            return x, h + self.mlp(self.post_attention_layernorm(h))
        h = h + attn
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h[:n_base], h[n_base:]


@dataclass
class OrthrosOutput:
    logits: torch.Tensor
    loss: torch.Tensor | None = None


class OrthrosForCausalLM(nn.Module):
    def __init__(self, config: OrthrosConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(OrthrosBlock(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.config.initializer_range
        for name, p in self.named_parameters():
            if name.endswith(("gamma",)) or "norm" in name:
                nn.init.ones_(p)
            elif name.endswith(("beta", "bias")):
                nn.init.zeros_(p)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                # GPT-2 style: residual writes shrink with depth so the stream's variance stays put.
                nn.init.normal_(p, std=std / (2 * self.config.num_hidden_layers) ** 0.5)
            else:
                nn.init.normal_(p, std=std)

    @property
    def is_orthros(self) -> bool:
        return self.config.attention_type == "orthros"

    def hidden_states(self, layout: OrthrosLayout, cache: KVCache | None = None) -> torch.Tensor:
        """Final normed hidden states of the output tokens, ``[N, hidden]``."""
        plan = plan_for_layout(self.config, layout, cache)
        x = self.embed_tokens(layout.input_ids)
        # Output token p starts as a copy of input token p (layer 0); baselines have no stream y.
        y = x[layout.output_index] if self.is_orthros else x[:0]
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x, y = layer(x, y, plan, cache, base_feeds_nothing=self.is_orthros and i == last)
        if cache is not None:
            cache.advance(plan.new_lengths)
        if not self.is_orthros:
            y = x[layout.output_index]
        return self.norm(y)

    def forward_layout(self, layout: OrthrosLayout, cache: KVCache | None = None) -> OrthrosOutput:
        """Logits ``[N, vocab]`` of the output tokens and, when any label is set, the loss."""
        logits = self.lm_head(self.hidden_states(layout, cache))
        loss = None
        if layout.num_loss_tokens:
            loss = weighted_cross_entropy(logits, layout.labels, layout.loss_weights)
        return OrthrosOutput(logits=logits, loss=loss)

    def forward(
        self,
        input_ids: torch.Tensor,
        output_positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> OrthrosOutput:
        """``input_ids [B, T]``; output tokens at ``output_positions`` (default: every position).

        Returns logits ``[B, N, vocab]``; ``labels [B, N]`` (targets of the output tokens) adds
        the mean loss over non-ignored labels.
        """
        b = 1 if input_ids.dim() == 1 else input_ids.shape[0]
        layout = positions_layout(input_ids, output_positions, document_ids, labels)
        out = self.forward_layout(layout)
        return OrthrosOutput(logits=out.logits.view(b, -1, out.logits.shape[-1]), loss=out.loss)

    def save_pretrained(self, directory: str | Path) -> None:
        """``config.json`` + ``model.safetensors`` (tied weights stored once)."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
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
        """Copy weights from a checkpoint directory, one safetensors file at a time."""
        from safetensors.torch import load_file

        directory = Path(directory)
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors weights in {directory}")
        own = self.state_dict()
        seen: set[str] = set()
        for f in files:
            for name, tensor in load_file(str(f)).items():
                if name not in own:
                    raise ValueError(f"{f} holds {name!r}, which this model does not have")
                if own[name].shape != tensor.shape:
                    raise ValueError(
                        f"{f}: {name} has shape {tuple(tensor.shape)}, the model expects {tuple(own[name].shape)}"
                        " (the checkpoint was made for another config)"
                    )
                with torch.no_grad():
                    own[name].copy_(tensor)
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
        return self.forward_layout(prefill_layout(input_ids), cache).logits, cache

    @torch.no_grad()
    def decode_step(self, next_ids: torch.Tensor, cache: KVCache) -> tuple[torch.Tensor, KVCache]:
        """Append one base+output pair per row: ``(logits [B, V], cache)``."""
        layout = decode_layout(next_ids.to(self.embed_tokens.weight.device), cache.lengths)
        return self.forward_layout(layout, cache).logits, cache

    @torch.no_grad()
    def generate_greedy(
        self, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id: int | None = None
    ) -> torch.Tensor:
        """Greedy continuation through prefill + decode; returns the new tokens ``[B, <=max]``."""
        logits, cache = self.prefill(input_ids)
        new = []
        for _ in range(max_new_tokens):
            nxt = logits.argmax(-1)
            new.append(nxt)
            if eos_token_id is not None and bool((nxt == eos_token_id).all()):
                break
            logits, cache = self.decode_step(nxt, cache)
        return torch.stack(new, dim=1)


def weighted_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum(w * CE) / number of labelled tokens (fp32); plain mean when all weights are 1."""
    ce = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="none")
    valid = labels != IGNORE_INDEX
    return (ce * weights * valid).sum() / valid.sum().clamp(min=1)
