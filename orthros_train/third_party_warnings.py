"""Warnings of the libraries underneath that tell a user of this project nothing to act on,
filtered once, here, when the package is imported (every process, every rank).

Each entry says why it is noise for us; anything else still shows.
"""

from __future__ import annotations

import warnings

KNOWN: list[tuple[type[Warning], str]] = [
    # megatron-core, once per module that would use apex/TE kernels: we run torch's by design.
    (UserWarning, r"Transformer Engine and Apex are not installed"),
    # megatron-core's TransformerConfig default (cuda_graph_scope="full"); we capture no CUDA graphs.
    (UserWarning, r"full scope is deprecated\. Use empty cuda_graph_scope"),
    # megatron-core's tensor-parallel linear layers: advice for its comm/compute overlap, which the
    # layers we build do not enable.
    (UserWarning, r"When using async grad allreduce it is recommended to set the environment variable"),
    # torch deprecating the collectives megatron-core calls (its code, not ours).
    (FutureWarning, r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"),
    # transformers 5 on configs that spell RoPE scaling the Llama-3.1 / Qwen way (``rope_scaling``),
    # which the converters read and write on purpose so older transformers load the export too.
    (FutureWarning, r"`rope_scaling` is deprecated and will be removed"),
]


def filter_third_party_warnings() -> None:
    for category, message in KNOWN:
        warnings.filterwarnings("ignore", message=message, category=category)
