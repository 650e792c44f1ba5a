"""What the Triton interpreter (``TRITON_INTERPRET=1``, the CPU test path) needs on some releases.

Shared by the attention and decode kernels, which both apply it when they are imported under the
interpreter, and ask ``interpreting()`` whether they are.
"""

from __future__ import annotations

import triton


@triton.jit
def _probe() -> None:
    pass


def interpreting() -> bool:
    """Whether triton runs kernels in its interpreter (``TRITON_INTERPRET=1`` when triton was
    imported): asked of triton itself, which read the variable once when the kernels were
    decorated, instead of reading the environment again here."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_probe, InterpretedFunction)


def interpreter_index_fix() -> bool:
    """Let triton 3.6's interpreter take tensor loop bounds again under numpy >= 2.4.

    The interpreter holds every scalar as a one-element array and gives tensors ``__index__`` as
    ``int(data)``; numpy 2.4 refuses ``int()`` of a 1-d array, so every ``range(lo, hi, step)``
    with a tensor bound (all of the kernels' loops: their bounds are loaded or reduced values)
    raised "only 0-dimensional arrays can be converted to Python scalars". Newer triton reads
    ``int(data.squeeze())`` (triton-lang/triton#9171); this applies that same definition on the
    releases that lack it. The compiled (GPU) path is untouched: only the interpreter's patch
    hook is wrapped, and only when its ``int(data)`` is what fails.
    """
    import numpy as np
    from triton.runtime import interpreter

    try:
        int(np.ones(1, dtype=np.int32))
        return False  # numpy still converts one-element arrays: nothing to fix
    except TypeError:
        pass
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_orthros_index_fix", False):
        return False

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_lang_tensor._orthros_index_fix = True
    interpreter._patch_lang_tensor = patch_lang_tensor
    return True
