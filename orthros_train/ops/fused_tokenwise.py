"""Fused token-wise ops of an Orthros layer, on both streams at once (``model.fused_tokenwise``).

Each op runs its Triton kernel (``ops/fused_tokenwise_triton.py``) on CUDA tensors and on CPU
under ``TRITON_INTERPRET=1`` (the tests), and its plain-torch statement
(``ops/fused_tokenwise_reference.py``) on CPU otherwise, so a fused model runs anywhere and the
kernels are checked against the references:

* ``rms_norm`` / ``add_rms_norm``: a residual add and the RMSNorm after it in one pass;
* ``rope_qk``: the queries of both streams and the keys rotated in one launch by the angles the
  plan computed once per forward;
* ``silu_mul``: SwiGLU's activation read from the merged gate/up GEMM's one buffer;
* ``linear_cross_entropy``: the LM head and the weighted cross entropy over chunks of rows, never
  holding the ``[tokens, vocab]`` logits (plain torch: its work is GEMMs).

The kernels need the weight in the stream's dtype (what a model cast to bf16 has); another mix
runs the reference.
"""

from __future__ import annotations

import torch

from orthros_train.ops.fused_tokenwise_reference import (
    IGNORE_INDEX,
    add_rms_norm_reference,
    rms_norm_reference,
    rope_qk_reference,
    silu_mul_reference,
)


def kernels_apply(*tensors: torch.Tensor) -> bool:
    """Whether the Triton kernels run on these tensors: CUDA, or CPU under triton's interpreter."""
    if not tensors or len({t.dtype for t in tensors}) != 1:
        return False
    device = tensors[0].device
    if device.type == "cuda":
        return True
    if device.type != "cpu":
        return False
    from orthros_train.ops.triton_interpreter import interpreting

    return interpreting()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / rms(x)`` over the last dimension (fp32 statistics)."""
    if not kernels_apply(x, weight):
        return rms_norm_reference(x, weight, eps)
    from orthros_train.ops.fused_tokenwise_triton import AddRMSNorm

    return AddRMSNorm.apply(x, None, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)`` in one pass over the rows."""
    if not kernels_apply(x, residual, weight):
        return add_rms_norm_reference(x, residual, weight, eps)
    from orthros_train.ops.fused_tokenwise_triton import AddRMSNorm

    return AddRMSNorm.apply(x, residual, weight, eps)


def rope_qk(
    q: torch.Tensor, k: torch.Tensor, q_angles: tuple[torch.Tensor, torch.Tensor],
    k_angles: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of ``q [Nq, Hq, D]`` and ``k [Nk, Hk, D]`` by their rows' ``(cos, sin)`` in one launch."""
    if not kernels_apply(q, k):
        return rope_qk_reference(q, k, q_angles, k_angles)
    from orthros_train.ops.fused_tokenwise_triton import RopeQK

    return RopeQK.apply(q, k, *q_angles, *k_angles)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a merged ``[rows, 2 * inter]`` buffer."""
    if not kernels_apply(gate_up):
        return silu_mul_reference(gate_up)
    from orthros_train.ops.fused_tokenwise_triton import SiluMul

    return SiluMul.apply(gate_up)


_PROBLEMS: dict[tuple[str, str], str | None] = {}


def kernel_problem(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the fused kernels cannot serve ``dtype`` on ``device`` (None: they can), asked once per
    process and pair: each kernel's forward and backward on small tensors against its reference.
    A first call that fails to compile, or a result off by more than the dtype's rounding, is the
    answer, so ``model.fused_tokenwise=auto`` falls back to eager instead of failing a step."""
    key = (str(device), str(dtype))
    if key not in _PROBLEMS:
        # the check reads its results on the host once: not a sync of the step a detector watches
        sync_mode = torch.cuda.get_sync_debug_mode() if device.type == "cuda" else 0
        if sync_mode:
            torch.cuda.set_sync_debug_mode(0)
        try:
            _PROBLEMS[key] = _check_kernels(device, dtype)
        except Exception as exc:  # noqa: BLE001 - any failure of a first call is the answer
            _PROBLEMS[key] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        finally:
            if sync_mode:
                torch.cuda.set_sync_debug_mode(sync_mode)
    return _PROBLEMS[key]


def _check_kernels(device: torch.device, dtype: torch.dtype) -> str | None:
    if not kernels_apply(torch.empty(0, device=device, dtype=dtype)):
        return f"no Triton kernels on {device.type} (CUDA, or CPU under TRITON_INTERPRET=1)"
    from orthros_train.ops.fused_tokenwise_triton import AddRMSNorm, RopeQK, SiluMul

    g = torch.Generator(device="cpu").manual_seed(0)
    tol = 1e-5 if dtype == torch.float32 else 3e-2

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype).requires_grad_()

    def grads(out: torch.Tensor, *inputs: torch.Tensor) -> list[torch.Tensor]:
        return list(torch.autograd.grad(out.float().square().sum(), inputs))

    def far(name: str, got: list[torch.Tensor], want: list[torch.Tensor]) -> str | None:
        for a, b in zip(got, want):  # off by more than the dtype's rounding of the largest value
            a, b = a.detach().float(), b.detach().float()
            err = float((a - b).abs().max()) / max(float(b.abs().max()), 1e-6)
            if not err <= tol:
                return f"{name} differs from its reference by {err:.3g} of its largest value"
        return None

    x, r, w = leaf(5, 40), leaf(5, 40), leaf(40)
    y, s = AddRMSNorm.apply(x, r, w, 1e-6)
    y_ref, s_ref = add_rms_norm_reference(x, r, w, 1e-6)
    problem = far("add_rms_norm", [y, s, *grads(y + s, x, r, w)], [y_ref, s_ref, *grads(y_ref + s_ref, x, r, w)])
    q, k = leaf(6, 4, 16), leaf(3, 2, 16)
    angles = [torch.randn(n, 1, 16, generator=g).to(device) for n in (6, 6, 3, 3)]
    qo, ko = RopeQK.apply(q, k, *angles)
    qr, kr = rope_qk_reference(q, k, angles[:2], angles[2:])
    problem = problem or far("rope_qk", [qo, ko, *grads(torch.cat([qo.flatten(), ko.flatten()]), q, k)],
                             [qr, kr, *grads(torch.cat([qr.flatten(), kr.flatten()]), q, k)])
    gu = leaf(4, 48)
    o, o_ref = SiluMul.apply(gu), silu_mul_reference(gu)
    return problem or far("silu_mul", [o, *grads(o, gu)], [o_ref, *grads(o_ref, gu)])


def cross_entropy_chunk_rows(num_rows: int, hidden: int, vocab: int) -> int:
    """Rows per chunk of ``linear_cross_entropy``: Liger-Kernel's rule, a chunk's logits about as
    large as the hidden states (``rows * vocab ~ num_rows * hidden``), a power of two."""
    chunks = max(1, -(-vocab // max(hidden, 1)))
    return 1 << max(0, (-(-num_rows // chunks) - 1).bit_length())


class _LinearCrossEntropy(torch.autograd.Function):
    """The loss and both gradients in one pass over row chunks; the backward only scales them.

    Our own rather than Liger-Kernel's ``LigerFusedLinearCrossEntropyFunction``: a loss here weighs
    every token (SFT answer masks, RL advantages) and is divided by a step-wide normaliser; Liger
    takes per-token weights only with ``reduction="none"``, where it recomputes every chunk's logits
    in the backward (a fourth GEMM over the vocabulary). Folding ``w / normaliser`` into each
    chunk's logit gradient keeps the three GEMMs of the unfused head.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, scale, chunk_rows):  # noqa: ANN001, ANN205
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None
        # Accumulated over the chunks in the weight's dtype, as Liger does (fp32 for an fp32 model).
        grad_w = torch.zeros_like(weight) if need_w else None
        for start in range(0, hidden.shape[0], chunk_rows):
            h = hidden[start : start + chunk_rows]
            logits = (h @ weight.t()).float()
            lse = torch.logsumexp(logits, dim=-1)
            lab = labels[start : start + chunk_rows]
            valid = lab != IGNORE_INDEX
            safe = torch.where(valid, lab, 0)[:, None]
            sc = scale[start : start + chunk_rows]
            loss += ((lse - logits.gather(1, safe)[:, 0]) * sc).sum()
            if need_h or need_w:
                grad = torch.exp(logits.sub_(lse[:, None]))  # softmax, in place of the logits
                grad.scatter_add_(1, safe, -valid.to(grad.dtype)[:, None])
                grad = (grad * sc[:, None]).to(hidden.dtype)
                if need_h:
                    torch.mm(grad, weight, out=grad_h[start : start + chunk_rows])
                if need_w:
                    grad_w.addmm_(grad.t(), h)
        ctx.save_for_backward(grad_h, grad_w)
        return loss

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205
        grad_h, grad_w = ctx.saved_tensors
        dh = None if grad_h is None else grad_h * grad_out.to(grad_h.dtype)
        dw = None if grad_w is None else grad_w * grad_out.to(grad_w.dtype)
        return dh, dw, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
    normalizer: float | torch.Tensor, chunk_rows: int | None = None,
) -> torch.Tensor:
    """``sum(w * CE(hidden @ weight.T, labels)) / normalizer`` in fp32, over chunks of rows so the
    full ``[rows, vocab]`` logits never exist (``IGNORE_INDEX`` labels count 0)."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"linear_cross_entropy: hidden {tuple(hidden.shape)} does not match weight {tuple(weight.shape)}"
        )
    if chunk_rows is None:
        chunk_rows = cross_entropy_chunk_rows(hidden.shape[0], weight.shape[1], weight.shape[0])
    scale = weights.float() * (labels != IGNORE_INDEX) / normalizer
    if scale.dim() == 0:  # a scalar weight for every token
        scale = scale.expand(labels.shape)
    return _LinearCrossEntropy.apply(hidden, weight, labels, scale, max(1, chunk_rows))


__all__ = [
    "add_rms_norm",
    "cross_entropy_chunk_rows",
    "kernel_problem",
    "kernels_apply",
    "linear_cross_entropy",
    "rms_norm",
    "rope_qk",
    "silu_mul",
]
