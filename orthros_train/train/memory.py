"""Per-GPU memory of one training step: an analytic model (written out in ``docs/memory.md``).

What one rank holds at the peak of a step (the start of the backward pass, after the optimizer
has run once), in bytes:

* **weights**: the rank's parameters (TP shards + replicated norms) in the training dtype
  (DeepSpeed bf16 keeps bf16 parameters); ZeRO-3 partitions them over the ZeRO group;
* **grads**: one gradient per parameter in the training dtype; ZeRO-2/3 keep only their
  partition (plus DeepSpeed's reduce bucket); with bf16 the optimizer step also holds an fp32
  copy of the partition's gradient;
* **optimizer**: fp32 master weights (bf16 only) + Adam's two fp32 moments, partitioned over the
  ZeRO group (ZeRO >= 1) and moved to CPU by ``offload_optimizer``;
* **activations**: what autograd keeps per layer for the backward, for both Orthros streams
  (``T/cp`` base tokens + ``T/cp`` output tokens per rank in pretraining), see
  :func:`layer_activation_bytes`; ``recompute`` drops the attention intermediates (selective) or
  everything but each layer's input (full, plus one layer's working set);
* **kv**: the full-sequence K/V a context-parallel rank all-gathers for its output queries;
  kept per layer without recompute, one layer at a time with it;
* **logits**: the output stream's logits (vocab-parallel: ``V/tp`` columns), cross-entropy's
  fp32 log-softmax and the logits' gradient;
* **teacher** (distillation, ``train/distill.py``): the frozen dense teacher's shard in the
  training dtype, replicated under every ZeRO stage (it is outside DeepSpeed); its activations
  under ``no_grad`` (one layer's working set: nothing is kept for a backward); its logits, held
  through the student's forward, and the KL's fp32 working set (computed block by block of rows,
  recomputed in the backward: four fp32 tensors of one block); in an alignment stage also its base
  stream after every layer but the last.

Sink tokens (``model.sink_tokens``) add no KV memory (the sinks are the cache's first entries);
the attention op keeps the sink partial's output and log-sum-exp for the base rows (and, for the
reference op, ``S`` more scores per base query).

The ZeRO group is data-parallel x context-parallel: CP ranks hold identical weights, so their
optimizer states are partitioned like data-parallel replicas (megatron-core's distributed
optimizer does the same with ``with_context_parallel=True``).

It is a model, not a measurement: allocator fragmentation, CUDA/NCCL workspaces and temporary
buffers of single kernels are outside it (``docs/memory.md`` states a headroom for them), and
``tests/test_memory_model.py`` checks it against ``torch.cuda.max_memory_allocated`` on a GPU.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from orthros_train.errors import UserError
from orthros_train.model.config import OrthrosConfig
from orthros_train.ops.reference import REFERENCE_CHUNK
from orthros_train.parallel.setup import ParallelConfig

if TYPE_CHECKING:
    from orthros_train.train.config import RunConfig

DTYPE_BYTES = {"fp32": 4, "bf16": 2}
ATTENTION_BACKENDS = ("flash", "reference")
DEEPSPEED_REDUCE_BUCKET = 500_000_000  # elements: DeepSpeed's default reduce_bucket_size
GIB = 1024**3
# Share of device memory the estimate may use: the rest is for what the model leaves out
# (allocator fragmentation, CUDA/NCCL workspaces, kernels' temporary buffers).
HEADROOM_FRACTION = 0.9
# The KL of distillation is computed in blocks of rows of this many bytes per fp32 tensor (train/distill.py).
KL_BLOCK_BYTES = 256 << 20


@dataclass
class MemoryEstimate:
    """Bytes per GPU by category; ``total`` is their sum (the modelled peak)."""

    weights: int
    grads: int
    optimizer: int
    activations: int
    kv: int
    logits: int
    params_per_rank: int
    activations_per_layer: int
    teacher: int = 0  # a distillation run's frozen teacher: weights, no-grad activations, logits

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations + self.kv + self.logits + self.teacher

    def as_gib(self) -> dict[str, float]:
        """Rounded GiB per category and in total (for dry-run output and docs)."""
        keys = ("weights", "grads", "optimizer", "activations", "kv", "logits", "teacher")
        out = {k: round(getattr(self, k) / GIB, 2) for k in keys}
        out["total"] = round(self.total / GIB, 2)
        return out

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def expert_parameters(model: OrthrosConfig) -> int:
    """The routed experts' weights of every sparse layer (what expert parallelism splits)."""
    return len(model.sparse_layers) * model.num_experts * 3 * model.hidden_size * model.moe_intermediate_size


def params_per_rank(model: OrthrosConfig, tensor_parallel: int, expert_parallel: int = 1) -> int:
    """Parameters one rank holds: projections, dense MLPs, shared experts, gamma/beta and the
    (vocab-parallel) embeddings split by ``tp``; RMSNorm weights and routers replicated; the
    routed experts split by ``expert_parallel`` (whole experts on a rank: no tensor split)."""
    replicated = model.num_hidden_layers * 2 * model.hidden_size + model.hidden_size
    if model.qk_norm:
        replicated += model.num_hidden_layers * 2 * model.head_dim
    replicated += len(model.sparse_layers) * model.hidden_size * model.num_experts  # routers
    if model.shared_expert_intermediate_size:
        replicated += len(model.sparse_layers) * model.hidden_size  # the shared experts' gates
    experts = expert_parameters(model)
    total = model.num_parameters(include_embeddings=True)
    return (total - replicated - experts) // tensor_parallel + replicated + experts // expert_parallel


def mlp_activation_bytes(model: OrthrosConfig, parallel: ParallelConfig, layer_idx: int, n: int, a: int) -> int:
    """Bytes autograd keeps for layer ``layer_idx``'s MLP over ``n`` local tokens of both streams.

    Dense: gate, up, silu(gate) and their product, ``n x intermediate / tp`` each. Sparse: the
    router's fp32 logits, probabilities and mixing weights, then every (token, chosen expert) row —
    ``n * k`` of them, spread over the expert-parallel ranks (under SP a rank routes its ``n / tp``
    tokens; balanced routing hands it back as many rows as it sent) — holds its dispatched input
    and the same four expert-width tensors, plus each expert's output before the weighted sum; a
    shared expert adds its four tensors for every token.
    """
    tp = parallel.tensor_parallel
    if not model.is_sparse_layer(layer_idx):
        return 4 * n * model.intermediate_size * a // tp
    sp = tp if parallel.sequence_parallel else 1
    tokens = n // sp
    rows = tokens * model.num_experts_per_tok
    router = tokens * model.num_experts * 4 * 3
    experts = rows * (2 * model.hidden_size + 4 * model.moe_intermediate_size) * a
    shared = 4 * n * model.shared_expert_intermediate_size * a // tp
    return router + experts + shared


def _reference_attention_elements(
    n_windowed: int, n_unbounded: int, window: int, doc_len: int, chunk: int, sinks: int = 0
) -> int:
    """Score elements per head ops/reference.py keeps for the backward, summed over its chunks.

    Windowed (base) chunks score ``chunk + W - 1`` keys; unbounded (output) chunks span from the
    document start to their last query, i.e. about ``position + chunk`` keys, which sums to
    ``n * (n/2 + chunk)`` over one document: quadratic, which is why long context needs a
    flash-style kernel.
    """
    base = n_windowed * (min(chunk + window - 1, doc_len) + sinks)  # sinks: the sink partial's scores
    out = n_unbounded * min(doc_len // 2 + chunk, doc_len)
    return base + out


def layer_activation_bytes(
    model: OrthrosConfig,
    parallel: ParallelConfig,
    n_base: int,
    n_out: int,
    doc_len: int,
    act_bytes: int,
    attention_backend: str = "flash",
    drop_attention_intermediates: bool = False,
    layer_idx: int = 0,
) -> int:
    """Bytes autograd keeps for Orthros layer ``layer_idx`` over ``n_base + n_out`` local tokens.

    Token-wise tensors of width ``hidden_size`` are split by ``tp`` only under sequence
    parallelism; head- and MLP-width tensors always are (column/row-parallel projections).
    """
    tp = parallel.tensor_parallel
    sp = tp if parallel.sequence_parallel else 1
    d = model.hidden_size
    q_width = model.num_attention_heads * model.head_dim // tp
    kv_width = model.num_key_value_heads * model.head_dim // tp
    heads = model.num_attention_heads // tp
    n = n_base + n_out
    a = act_bytes
    norms = 2 * 2 * n * d * a // sp  # two RMSNorms: input and normalised output each
    qkv = (n * q_width + 2 * n_base * kv_width) * a  # projection outputs
    if model.qk_norm:
        qkv += (n * q_width + n_base * kv_width) * a  # q/k before their norm
    qkv += n_out * q_width * a  # the output stream's q before its gamma/beta affine
    roped = (n * q_width + n_base * kv_width) * a  # rotated q, k: the attention op's inputs
    rope_tables = 2 * (n + n_base) * model.head_dim * a  # cos/sin cast to the activation dtype
    attn_out = n * q_width * a + n * heads * 4  # output (o_proj input) + fp32 log-sum-exp
    mlp = mlp_activation_bytes(model, parallel, layer_idx, n, a)
    core = 0
    if attention_backend == "reference" and not drop_attention_intermediates:
        elements = _reference_attention_elements(
            n_base, n_out, model.sliding_window, doc_len, REFERENCE_CHUNK, model.base_sink_tokens
        )
        core = elements * heads * (4 + 4 + 1)  # fp32 scores and probabilities + the boolean mask
    if model.base_sink_tokens:
        core += n_base * (q_width * a + heads * 4)  # the sink partial's output and LSE, merged in the backward
    return norms + qkv + roped + rope_tables + attn_out + mlp + core


def _state_bytes(model: OrthrosConfig, parallel: ParallelConfig, precision: str, a: int) -> tuple[int, int, int, int]:
    """Per-rank parameters and the bytes of weights, gradients and optimizer state under ZeRO."""
    tp, cp = parallel.tensor_parallel, parallel.context_parallel
    # A layout not yet resolved against a world size (data_parallel None) plans for one DP rank.
    zero_group = (parallel.data_parallel or 1) * cp
    stage = parallel.zero_stage
    ep = parallel.expert_parallel
    p = params_per_rank(model, tp, ep)
    # Routed experts are whole on a rank and partitioned by ZeRO over the ranks that hold the same
    # experts (the expert-data-parallel group: world / expert_parallel); the rest over DP x CP.
    local_experts = expert_parameters(model) // ep
    groups = ((p - local_experts, zero_group), (local_experts, max(tp * zero_group // ep, 1)))

    def partitioned(from_stage: int) -> int:
        return sum(n // (g if stage >= from_stage else 1) for n, g in groups)

    weights = partitioned(3) * a
    grads = partitioned(2) * a
    if stage >= 2:
        grads += min(DEEPSPEED_REDUCE_BUCKET, p) * a
    shard = partitioned(1)
    master = 4 * shard if precision != "fp32" else 0
    if precision != "fp32" and stage >= 1:
        grads += 4 * shard  # fp32 gradient of the partition, made for the optimizer step
    optimizer = 0 if parallel.offload_optimizer else master + 8 * shard
    return p, weights, grads, optimizer


def _activation_bytes(
    model: OrthrosConfig, parallel: ParallelConfig, n_base: int, n_out: int, seq_len: int, a: int,
    attention_backend: str,
) -> tuple[int, int]:
    """Activations kept for the backward over all layers (after recompute), and the largest one
    layer keeps."""
    layers = model.num_hidden_layers
    tp = parallel.tensor_parallel

    def layer_bytes(i: int, drop: bool) -> int:
        return layer_activation_bytes(model, parallel, n_base, n_out, seq_len, a, attention_backend, drop, layer_idx=i)

    per_layer_all = [layer_bytes(i, parallel.recompute != "none") for i in range(layers)]
    per_layer = max(per_layer_all)  # a sparse layer's, in a model with both kinds
    sp = tp if parallel.sequence_parallel else 1
    if parallel.recompute == "full":
        # Only each layer's input survives; the backward rebuilds one layer at a time.
        full_layer = max(layer_bytes(i, False) for i in range(layers))
        activations = layers * (n_base + n_out) * model.hidden_size * a // sp + full_layer
    else:
        activations = sum(per_layer_all)
    activations += 2 * n_base * model.hidden_size * a // sp  # embeddings of both streams
    return activations, per_layer


def estimate_memory(
    model: OrthrosConfig,
    parallel: ParallelConfig,
    seq_len: int,
    micro_batch_size: int,
    precision: str = "bf16",
    attention_backend: str = "flash",
    output_fraction: float = 1.0,
    teacher: OrthrosConfig | None = None,
    teacher_align: bool = False,
) -> MemoryEstimate:
    """Per-GPU bytes of one training step (see the module docstring for what each term holds).

    ``teacher``: a distillation run's teacher (``teacher_align``: in its alignment stage).

    ``output_fraction``: output tokens per base token (1 in pretraining; the answer share in SFT).
    ``attention_backend``: ``flash`` (the Triton kernels: only the log-sum-exp is kept) or
    ``reference`` (the chunked plain-torch op: per-chunk fp32 scores and probabilities).
    """
    if precision not in DTYPE_BYTES:
        raise UserError(f"precision must be one of {sorted(DTYPE_BYTES)}, got {precision!r}")
    if attention_backend not in ATTENTION_BACKENDS:
        raise UserError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {attention_backend!r}")
    if seq_len % parallel.context_parallel:
        raise UserError(f"seq_len={seq_len} is not divisible by parallel.context_parallel={parallel.context_parallel}")
    a = DTYPE_BYTES[precision]
    tp, cp = parallel.tensor_parallel, parallel.context_parallel
    p, weights, grads, optimizer = _state_bytes(model, parallel, precision, a)

    n_base = micro_batch_size * seq_len // cp
    n_out = int(n_base * output_fraction)
    layers = model.num_hidden_layers

    activations, per_layer = _activation_bytes(model, parallel, n_base, n_out, seq_len, a, attention_backend)

    kv = 0
    if cp > 1:
        gathered = micro_batch_size * seq_len * 2 * model.num_key_value_heads * model.head_dim // tp * a
        kv = gathered * (layers if parallel.recompute == "none" else 1)

    vocab = model.vocab_size // tp
    # bf16/fp32 logits kept with the output, fp32 log-softmax saved by cross-entropy, and in the
    # backward the fp32 gradient of the logits plus its cast to the activation dtype.
    logits = n_out * vocab * (a + 4 + 4 + a)
    teacher_bytes = 0 if teacher is None else teacher_memory(
        teacher, parallel, n_base, n_out, seq_len, a, attention_backend, teacher_align
    )
    return MemoryEstimate(
        weights=weights,
        grads=grads,
        optimizer=optimizer,
        activations=activations,
        kv=kv,
        logits=logits,
        params_per_rank=p,
        activations_per_layer=per_layer,
        teacher=teacher_bytes,
    )


def teacher_memory(
    teacher: OrthrosConfig, parallel: ParallelConfig, n_base: int, n_out: int, doc_len: int, act_bytes: int,
    attention_backend: str, align: bool,
) -> int:
    """Bytes of distillation's frozen teacher on one rank: its weights (TP shard, replicated over
    ZeRO: outside DeepSpeed), the peak working set of one layer of its no-grad forward plus the
    residual stream, its logits (held through the student's forward), the KL's fp32 working set
    (4 fp32 tensors of one block of rows: ``train/distill.py`` computes it block by block and
    recomputes it in the backward), and in an alignment stage its base stream after every layer
    but the last."""
    tp = parallel.tensor_parallel
    sp = tp if parallel.sequence_parallel else 1
    a, d = act_bytes, teacher.hidden_size
    weights = params_per_rank(teacher, tp, parallel.expert_parallel) * a
    layer = max(
        layer_activation_bytes(teacher, parallel, n_base, 0, doc_len, a, attention_backend, layer_idx=i)
        for i in range(teacher.num_hidden_layers)
    )
    forward = layer + n_base * d * a // sp
    logits = n_out * (teacher.vocab_size // tp) * a + 4 * min(KL_BLOCK_BYTES, n_out * (teacher.vocab_size // tp) * 4)
    states = (teacher.num_hidden_layers - 1) * n_base * d * a // sp if align else 0
    return weights + forward + logits + states


def memory_summary(cfg: RunConfig) -> dict[str, Any]:
    """What a dry run prints: the estimate in GiB for every sequence-length stage of the recipe."""
    t = cfg.trainer
    stages = [(0, t.seq_len)] if not t.seq_len_schedule else [tuple(s) for s in t.seq_len_schedule]
    # The Triton kernels run on GPUs (attention_backend auto); only an explicit reference keeps scores.
    backend = "reference" if cfg.model.attention_backend == "reference" else "flash"
    teacher, align = None, False
    if cfg.distill.enabled:
        from orthros_train.train.teacher import planned_teacher_config

        teacher, _ = planned_teacher_config(cfg)
        align = cfg.distill.align != "none" and cfg.distill.align_steps > 0
    rows = []
    for start, length in stages:
        micro = t.seq_len * t.micro_batch_size // length
        est = estimate_memory(cfg.model, cfg.parallel, length, micro, t.precision, backend, teacher=teacher,
                              teacher_align=align)  # fmt: skip
        rows.append({"from_step": start, "seq_len": length, "micro_batch_size": micro, **est.as_gib()})
    peak = max(r["total"] for r in rows)
    summary: dict[str, Any] = {
        "unit": "GiB per GPU (docs/memory.md)",
        "phase": "pretrain (an output token at every position)",
        "attention_backend": backend,
        "recompute": cfg.parallel.recompute,
        "stages": rows,
        "peak_gib": peak,
    }
    if t.gpu_memory_gib:
        summary["device"] = {
            "gpu": t.gpu,
            "memory_gib": t.gpu_memory_gib,
            "fraction_used": round(peak / t.gpu_memory_gib, 3),
            "fits_with_headroom": peak <= HEADROOM_FRACTION * t.gpu_memory_gib,
        }
    return summary


def memory_fit_problem(peak_gib: float, device_gib: float, device_name: str | None = None) -> str | None:
    """Why the estimated peak does not fit the device, with the knobs that reduce it; None if it fits."""
    if peak_gib <= device_gib:
        return None
    return (
        f"the estimated peak of {peak_gib:.1f} GiB per GPU exceeds the {device_gib:.1f} GiB of "
        f"{device_name or 'the device'} (docs/memory.md): lower trainer.micro_batch_size (raise "
        "trainer.grad_accum_steps to keep the tokens per step), set parallel.recompute=full, a higher "
        "parallel.zero_stage or more tensor/context parallelism"
    )
