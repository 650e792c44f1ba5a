"""Distillation from the dense twin: an objective beside cross entropy, in the one trainer.

A pretrained dense model converted to Orthros keeps its weights; run with
``attention_type="dense"`` (full causal attention, no output stream, read out at the output
positions) and ``gamma = 1, beta = 0`` those weights *are* the original model. That teacher is
free: no second checkpoint, no second tokenizer. At every output token the student's loss is

    (1 - alpha) * CE + alpha * T^2 * KL(teacher_T || student_T)

with both distributions softened by the temperature ``T`` (the ``T^2`` keeps the soft term's
gradient scale independent of ``T``, Hinton et al.), weighted like the cross entropy: the
token's loss weight (SFT masks, sequence averaging), its label mask, and the step's normaliser
(``train/global_loss.py``), so ``ce_loss`` and ``kd_loss`` are on one scale and
``loss = (1 - alpha) * ce_loss + alpha * T^2 * kd_loss``. ``beyond_window_only`` restricts the
KD term to output positions ``>= sliding_window`` in their document (where the base stream no
longer sees the document start and the student differs from the teacher).

An optional first stage (``align``, ``align_steps`` steps) adds ``align_weight`` x the distance
(mse or cosine) between the student's base-stream hidden states after each layer but the last
and the teacher's, at positions ``>= sliding_window``: the base stream is what the window
changed, and every later layer reads it.

How it runs, without a second loop and without touching the model:

* the teacher is the same ``OrthrosForCausalLM`` built through the run's module factory (so under
  TP/SP it is sharded like the student and under CP it runs the same ``ContextPlan``
  specialisation), loaded from the checkpoint, frozen, in eval mode, outside DeepSpeed: no
  gradient, no optimizer state, never saved (a checkpoint records its identity, see
  ``teacher_identity``). Under ZeRO-3 it is replicated, not partitioned: its shard is at most
  the student's bf16 weights, while partitioning it would all-gather every teacher weight
  every micro batch (``docs/memory.md``);
* per micro batch the step (``train/step.py``) calls ``Distillation.forward``: the teacher's
  forward under ``no_grad``, then the engine's usual forward of the student with hooks that keep
  the student's plan, its (vocab-split, CP-local) logits and, in the alignment stage, its
  base-stream hidden states; the KD term is computed from those and added to the engine's loss
  through the plan's ``whole_loss`` (the CP rule the cross entropy follows);
* vocab-parallel logits: the log-softmax over the whole vocabulary is the local one shifted by
  the TP-wide max (detached) and log-sum-exp (a differentiable sum, megatron-core's
  ``reduce_from_tensor_model_parallel_region``), and the KL's sum over the vocabulary is the same
  differentiable sum of the per-rank partial sums (``token_kl`` says why the log-sum-exp's
  gradient is all-reduced); the CE keeps the LM head's own ``token_losses``;
* the KL is computed in blocks of rows, each recomputed in the backward (``chunked_token_kl``):
  several fp32 copies of an 8B model's logits at 32K tokens would not fit beside the training step.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region
from torch.utils.checkpoint import checkpoint

from orthros_train.errors import UserError
from orthros_train.logging_setup import RANK_ZERO
from orthros_train.model.orthros import AttentionPlan, OrthrosForCausalLM, OrthrosOutput
from orthros_train.options import DistillAlign, Recompute
from orthros_train.parallel import collectives
from orthros_train.parallel.streams import StreamShards
from orthros_train.phase.layout import IGNORE_INDEX, OrthrosLayout
from orthros_train.train.memory import KL_BLOCK_BYTES
from orthros_train.train.metrics import layout_flops
from orthros_train.train.teacher import check_teacher_tokenizer, teacher_config, teacher_identity

log = logging.getLogger(__name__)


# -- capturing what a forward computed --------------------------------------------------------------


class Capture:
    """Hooks on a model that keep, while active (``with capture:``), the pass's attention plan, its
    LM-head logits and, when ``hidden`` is set, the base stream after every layer but the last.
    Inactive (evaluation, the other phases) they cost a flag test."""

    def __init__(self, model: OrthrosForCausalLM) -> None:
        self.active, self.hidden = False, False
        self.plan: AttentionPlan | None = None
        self.logits: torch.Tensor | None = None
        self.states: list[torch.Tensor] = []
        self._handles = [
            model.layers[0].register_forward_pre_hook(self._keep_plan),
            model.lm_head.register_forward_hook(self._keep_logits),
            *(layer.register_forward_hook(self._keep_state) for layer in list(model.layers)[:-1]),
        ]

    def __call__(self, hidden: bool) -> "Capture":
        self.hidden = hidden
        return self

    def __enter__(self) -> "Capture":
        self.active, self.plan, self.logits, self.states = True, None, None, []
        return self

    def __exit__(self, *exc: object) -> None:
        self.active = False

    def clear(self) -> None:
        self.plan, self.logits, self.states = None, None, []

    def _keep_plan(self, module: torch.nn.Module, args: tuple) -> None:
        if self.active:
            self.plan = args[2]  # OrthrosBlock.forward(x, y, plan, ...)

    def _keep_logits(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        if self.active:
            self.logits = output

    def _keep_state(self, module: torch.nn.Module, args: tuple, output: tuple) -> None:
        if self.active and self.hidden:
            self.states.append(output[0])  # (x, y): the base stream after this layer

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


# -- vocab-parallel KL ----------------------------------------------------------------------------


def _tp_split() -> bool:
    return parallel_state.model_parallel_is_initialized() and parallel_state.get_tensor_model_parallel_world_size() > 1


def vocab_log_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log_softmax(logits / T)`` over the whole vocabulary in fp32, of logits that may be split
    over the vocabulary (TP): shifted by the TP-wide max and log-sum-exp. For the teacher, without
    gradient (a loss of this rank's shard of it would weigh the log-sum-exp's gradient by the
    shard's share; ``token_kl`` takes the student's log-sum-exp once)."""
    z = logits.float() / temperature
    shift = z.detach().max(dim=-1, keepdim=True).values
    if _tp_split():
        shift = collectives.all_reduce(shift, "max", group=parallel_state.get_tensor_model_parallel_group())
    sum_exp = (z - shift).exp().sum(dim=-1, keepdim=True)
    if _tp_split():
        sum_exp = reduce_from_tensor_model_parallel_region(sum_exp)
    return z - shift - sum_exp.log()


def token_kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Per output token ``KL(softmax(t / T) || softmax(s / T))`` ``[N]`` in fp32, of logits that may
    be split over the vocabulary (TP: every rank gets the whole-vocabulary KL).

    Each rank sums ``p (log p - log q)`` over its vocabulary shard and the partial sums are added
    by megatron-core's differentiable reduction (forward all-reduce, backward identity). The
    student's log-sum-exp is one TP-wide value that every shard's partial uses, weighted by that
    shard's share of the teacher's mass; its gradient must be the sum of those shares' (1), hence
    ``copy_to_tensor_model_parallel_region`` (forward identity, backward all-reduce) on it."""
    log_p = vocab_log_softmax(teacher_logits, temperature)
    z = student_logits.float() / temperature
    shift = z.detach().max(dim=-1, keepdim=True).values
    if _tp_split():
        shift = collectives.all_reduce(shift, "max", group=parallel_state.get_tensor_model_parallel_group())
    sum_exp = (z - shift).exp().sum(dim=-1, keepdim=True)
    if _tp_split():
        sum_exp = reduce_from_tensor_model_parallel_region(sum_exp)
    lse = shift + sum_exp.log()
    if _tp_split():
        lse = copy_to_tensor_model_parallel_region(lse)
    partial = (log_p.exp() * (log_p - (z - lse))).sum(dim=-1)
    return reduce_from_tensor_model_parallel_region(partial) if _tp_split() else partial


def chunked_token_kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``token_kl`` over blocks of rows, each checkpointed: autograd keeps only the logits (which
    exist anyway) and recomputes one block's fp32 log-softmaxes in the backward, so the KL's working
    set is one block (``KL_BLOCK_BYTES`` per fp32 tensor) instead of several fp32 copies of the logits
    (an 8B model at 32K tokens: ~7 GiB per rank at TP 8). Every TP rank has the same rows, so the
    recomputed blocks' collectives run in the same order on all of them."""
    rows = max(1, KL_BLOCK_BYTES // (4 * max(student_logits.shape[-1], 1)))
    if student_logits.shape[0] <= rows or not torch.is_grad_enabled():
        return token_kl(teacher_logits, student_logits, temperature)
    return torch.cat([
        checkpoint(token_kl, teacher_logits[i : i + rows], student_logits[i : i + rows], temperature,
                   use_reentrant=False)
        for i in range(0, student_logits.shape[0], rows)
    ])  # fmt: skip


def hidden_distance(student: torch.Tensor, teacher: torch.Tensor, kind: DistillAlign) -> torch.Tensor:
    """Per row distance of two hidden states ``[rows]`` in fp32: mean squared difference or
    ``1 - cosine``."""
    s, t = student.float(), teacher.float()
    if kind == DistillAlign.mse:
        return (s - t).pow(2).mean(dim=-1)
    return 1 - F.cosine_similarity(s, t, dim=-1)


# -- the teacher ------------------------------------------------------------------------------------


class Teacher:
    """The frozen dense twin: this rank's shard, in eval mode, without gradients."""

    def __init__(self, model: OrthrosForCausalLM, identity: dict[str, Any]) -> None:
        self.model = model.eval().requires_grad_(False)
        self.config = model.config
        self.identity = identity
        self.capture = Capture(model)

    @torch.no_grad()
    def __call__(self, layout: OrthrosLayout, hidden: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(logits of this rank's output tokens, vocab-split like the student's; its base stream
        after every layer but the last when ``hidden``)."""
        with self.capture(hidden) as cap:
            logits = self.model.lm_head(self.model.hidden_states(layout))
            states = cap.states
        cap.clear()
        return logits, states


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Parameters to ``dtype``, buffers untouched: ``module.to(bf16)`` would cast RoPE's
    ``inv_freq`` too (DeepSpeed's bf16 keeps buffers fp32, and so does the teacher)."""
    for p in model.parameters():
        p.data = p.data.to(dtype)


# -- the objective ------------------------------------------------------------------------------------


@dataclass
class _Sums:
    """What the step's micro batches add up on this rank (detached, on the device)."""

    ce: torch.Tensor
    kd: torch.Tensor
    align: torch.Tensor
    kl_beyond: torch.Tensor
    beyond: torch.Tensor


class Distillation:
    """Cross entropy mixed with KL to the dense teacher (and, for ``align_steps`` steps, the
    base-stream alignment). ``prepare`` keeps the batches as they are; ``forward`` runs one micro
    batch; ``step_stats`` gives the step's ``ce_loss``, ``kd_loss``, ``kl_beyond_w``, ``align_loss``."""

    def __init__(self, cfg: Any, student: OrthrosForCausalLM, teacher: Teacher, device: torch.device) -> None:
        self.cfg = cfg.distill  # DistillConfig
        # With alpha = 1 the loss is the KL alone, near 0 for a converted model: a step 3x its running
        # mean is noise, not a spike (measured: warnings every few steps on the tiny conversion).
        self.watch_loss_spikes = self.cfg.alpha < 1
        self.window = cfg.model.sliding_window
        self.loss_average = cfg.data.loss_average
        self.teacher = teacher
        self.device = device
        self.capture = Capture(student)
        factory = student.factory
        self.stream_shards = getattr(factory, "stream_shards", 1)  # TP size under SP, else 1
        self.tp_rank = getattr(factory, "tp_rank", 0)
        self.step = 0
        self.accum = 1
        self.align_normalizer = 1.0
        self._sums: _Sums | None = None

    def extra_flops(self, layout: OrthrosLayout) -> float:
        """The teacher's forward of ``layout`` (counted in the step's FLOPs and MFU)."""
        return layout_flops(self.teacher.config, layout, training=False)

    @property
    def aligning(self) -> bool:
        return self.cfg.align != DistillAlign.none and self.step < self.cfg.align_steps

    def begin_step(self, step: int, batches: list[OrthrosLayout]) -> None:
        """Before the batches move to the device: the step's index (the alignment stage) and, in
        that stage, its normaliser: base positions ``>= W`` over the step (one collective)."""
        self.step, self.accum = step, len(batches)
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        self._sums = _Sums(zero.clone(), zero.clone(), zero.clone(), zero.clone(), zero.clone())
        if self.aligning:
            dp = parallel_state.get_data_parallel_world_size()
            local = float(sum(int((b.positions >= self.window).sum()) for b in batches))
            units = collectives.reduce_floats([local], group=parallel_state.get_data_parallel_group())[0]
            self.align_normalizer = max(units, 1.0) / (self.accum * dp)

    def prepare(self, batches: list[OrthrosLayout], units: int) -> Any:
        from orthros_train.train.objective import PreparedStep

        return PreparedStep(list(batches))

    def forward(self, engine: Any, layout: OrthrosLayout, normalizer: float) -> OrthrosOutput:
        """One micro batch: the teacher's forward, the student's (the engine's), and the loss."""
        cfg, sums = self.cfg, self._sums
        aligning = self.aligning
        teacher_logits, teacher_states = self.teacher(layout, hidden=aligning)
        with self.capture(aligning) as cap:
            out = engine(layout, loss_normalizer=normalizer)
        plan, logits, states = cap.plan, cap.logits, cap.states
        cap.clear()
        loss = out.loss
        if loss is None:  # no labelled token: no CE and no KD either (the step adds a zero loss)
            return out
        labels, weights = plan.output_targets(layout)
        valid = (labels != IGNORE_INDEX).to(torch.float32)
        # the same layout with the beyond-W mask as its weights: the plan picks this rank's entries
        shadow = copy.copy(layout)
        shadow.loss_weights = (layout.positions[layout.output_index] >= self.window).to(torch.float32)
        _, beyond = plan.output_targets(shadow)
        weight = weights.float() * valid
        kd_weight = weight * beyond if cfg.beyond_window_only else weight
        router = out.router_loss if out.router_loss is not None else 0.0
        sums.ce += (loss.detach() - router).double()
        t = cfg.temperature
        if cfg.alpha > 0:
            kl = chunked_token_kl(teacher_logits, logits, t)
            kd = plan.whole_loss((kl * kd_weight).sum() / normalizer)
            loss = (1 - cfg.alpha) * loss + cfg.alpha * t * t * kd
            kl_t = kl.detach()
        else:  # alpha = 0: the loss stays the engine's, bit for bit; the KL is only logged
            with torch.no_grad():
                kl_t = token_kl(teacher_logits, logits, t)
                kd = plan.whole_loss((kl_t * kd_weight).sum() / normalizer)
        sums.kd += kd.detach().double()
        with torch.no_grad():
            kl_1 = kl_t if t == 1 else token_kl(teacher_logits, logits.detach(), 1.0)
            sums.kl_beyond += (kl_1 * weight * beyond).sum().double()
            sums.beyond += (weight * beyond).sum().double()
        if aligning:
            align = plan.whole_loss(self._align(plan, states, teacher_states))
            loss = loss + cfg.align_weight * align
            sums.align += align.detach().double()
        return OrthrosOutput(logits=None, loss=loss, router_loss=out.router_loss)

    def _align(self, plan: AttentionPlan, student: list[torch.Tensor], teacher: list[torch.Tensor]) -> torch.Tensor:
        """This rank's share of the alignment loss: the mean over layers of the distance summed
        over its base rows at positions ``>= W``, over the step's normaliser. Under SP a rank holds
        a slice of the rows, so its share is a partial sum (the gradient of the TP-wide sum)."""
        mask = (plan.base_positions >= self.window).to(torch.float32)
        if self.stream_shards > 1:
            shards = StreamShards(plan, self.stream_shards)
            mask = shards.pad(mask, shards.base_local).view(self.stream_shards, -1)[self.tp_rank]
        total = sum((hidden_distance(s, t, self.cfg.align) * mask).sum() for s, t in zip(student, teacher))
        return total / max(len(student), 1) / self.align_normalizer

    def step_stats(self) -> dict[str, float]:
        """The step's terms, global over the data- and context-parallel ranks."""
        sums = self._sums
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        ranks = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
        align = sums.align
        if self.aligning and self.stream_shards > 1:  # each TP rank holds a partial sum of its rows
            align = collectives.all_reduce(align.clone(), group=parallel_state.get_tensor_model_parallel_group())
        ce, kd, align, kl_beyond, beyond = collectives.reduce_floats(
            [sums.ce, sums.kd, align, sums.kl_beyond, sums.beyond], group=group
        )
        share = self.accum * ranks  # ce/kd/align: every micro batch of every rank holds its share of the mean
        stats = {"ce_loss": ce / share, "kd_loss": kd / share}
        if beyond > 0:
            stats["kl_beyond_w"] = kl_beyond / beyond
        if self.aligning:
            stats["align_loss"] = align / share
        return stats


def build_teacher(cfg: Any, device: torch.device, tokenizer: Any, tokenizer_key: str) -> Teacher:
    """The run's teacher: ``distill.teacher`` as the dense model, this rank's shard through the
    run's parallel factory (recompute off: nothing is kept for a backward), frozen, in the
    training dtype. Refuses a missing checkpoint, another vocabulary or another tokenizer."""
    from orthros_train.common.safetensors_io import SafetensorsFileError, SafetensorsReader
    from orthros_train.options import Precision
    from orthros_train.parallel.model import build_parallel_model
    from orthros_train.parallel.state_dict import load_reference_shards

    path = cfg.distill.teacher
    tcfg = teacher_config(path, cfg.model)
    check_teacher_tokenizer(path, tokenizer, tokenizer_key)
    try:
        weights = SafetensorsReader(path)
    except SafetensorsFileError as exc:  # a missing or corrupt weights file
        raise UserError(f"distill.teacher={path}: {exc}") from exc
    identity = teacher_identity(path)
    model = build_parallel_model(tcfg, replace(cfg.parallel, recompute=Recompute.none), seed=None)
    load_reference_shards(model, weights, tcfg)
    if cfg.trainer.precision == Precision.bf16:
        cast_parameters(model, torch.bfloat16)
    log.info("distillation teacher: %s as the dense model (%s, sha256 %s), alpha %g, temperature %g%s",
             path, f"{identity['bytes'] / 2**20:.0f} MiB", identity["sha256"][:12], cfg.distill.alpha,
             cfg.distill.temperature, f", {cfg.distill.align} alignment for {cfg.distill.align_steps} steps"
             if cfg.distill.align != DistillAlign.none else "", extra=RANK_ZERO)  # fmt: skip
    return Teacher(model.to(device), identity)


__all__ = [
    "Capture",
    "Distillation",
    "Teacher",
    "build_teacher",
    "cast_parameters",
    "chunked_token_kl",
    "hidden_distance",
    "token_kl",
    "vocab_log_softmax",
]
