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


__all__ = ["REGIONS", "apply_regional_compile"]
