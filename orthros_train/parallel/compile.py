"""Regional ``torch.compile``: the token-wise parts of every layer, applied from outside the model.

``parallel.compile=true`` compiles each RMSNorm, each RoPE rotation (``RotaryEmbedding.forward``)
and each SwiGLU activation (``SiluAndMul``) in place with ``nn.Module.compile``: the elementwise
passes of each fuse into one kernel (in fp32 statistics and bf16 storage, the norm alone is four
passes eager). torchtitan compiles whole blocks instead; here a block holds the attention op,
whose host-side planning and custom kernels would break the graph, and whose kernels are fused
already, so only the regions between them are compiled. The parameters and their names do not
change (``nn.Module.compile`` keeps the module), so checkpoints are the same with or without it.
"""

from __future__ import annotations

from torch import nn

from orthros_train.errors import UserError
from orthros_train.model.layers import RMSNorm, RotaryEmbedding, SiluAndMul

REGIONS: tuple[type[nn.Module], ...] = (RMSNorm, RotaryEmbedding, SiluAndMul)


def apply_regional_compile(model: nn.Module) -> int:
    """Compile every region of ``model`` in place; returns how many modules were compiled.

    ``dynamic=True``: the token count changes with every packing (SFT, RL, the last micro batch),
    and a graph per count would recompile all run long."""
    compiled = 0
    for module in model.modules():
        if isinstance(module, REGIONS):
            module.compile(dynamic=True)
            compiled += 1
    return compiled


def compile_toolchain_problem(device_type: str) -> str | None:
    """Why inductor cannot build kernels for ``device_type`` on this machine (None: it can).

    ``torch.compile`` is lazy: without a C++ compiler (CPU) or triton (GPU) it fails inside the
    first training step, as an ``InductorError`` after the data and model are built. Asked before
    the run starts, the refusal is one line naming the fix."""
    if device_type == "cuda":
        import importlib.util

        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (inductor writes GPU kernels in it)"
        return None
    if device_type != "cpu":
        return None
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
    except ImportError:  # another torch layout: let the compile itself speak
        return None
    try:
        get_cpp_compiler()
    except RuntimeError as exc:  # InvalidCxxCompiler
        return f"no working C++ compiler on this machine, which inductor needs for CPU kernels ({exc})"
    return None


def check_compile_toolchain(device_type: str) -> None:
    """``parallel.compile=true`` on a machine that cannot build its kernels: one ``UserError``."""
    problem = compile_toolchain_problem(device_type)
    if problem:
        raise UserError(
            f"parallel.compile=true: {problem}; install it (a CPU needs g++ or clang++ on PATH, or CXX set) "
            "or set parallel.compile=false"
        )


__all__ = ["REGIONS", "apply_regional_compile", "check_compile_toolchain", "compile_toolchain_problem"]
