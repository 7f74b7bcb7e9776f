"""Triton for the kernels: `from nano_v1.triton_utils import tl, triton`, with its interpreter made to work.

Mirrors vllm/triton_utils/__init__.py (chapter 06).

Why it exists: every Triton kernel imports Triton from here, so what Triton needs before
a kernel runs is done once, on import, for every caller: pytest, the GPU suite, a
notebook, a plain script. Today that is one repair of the interpreter (`TRITON_INTERPRET=1`,
how the kernels run on a CPU), `_let_triton_36_interpret_with_numpy_24`.

What differs from v0.11.0: vLLM's module puts placeholders in Triton's place when it is
not installed (its CPU builds); nano_v1 imports Triton only where a kernel is used, and
instead repairs the interpreter of the Triton version the GPU image has.
"""

from __future__ import annotations

import inspect
import os

import triton
import triton.language as tl

__all__ = ["tl", "triton"]


def _interpreting() -> bool:
    """Whether kernels run in Triton's interpreter: its `knobs` from Triton 3.4, the variable itself before."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes", "y")


def _let_triton_36_interpret_with_numpy_24() -> None:
    """Triton 3.6's interpreter (the GPU image's Triton) indexes with `int(tensor.handle.data)`, which
    numpy >= 2.4 refuses for the 1-element arrays it holds scalars in ("only 0-dimensional
    arrays can be converted to Python scalars"), so every kernel whose loop bound is a loaded
    value fails in it. Later Triton squeezes the array first: do the same where it does not.

    Only when the interpreter is on (compiled kernels never take this path) and only in a
    Triton whose interpreter has that line; a second call finds the line gone and does nothing.
    """
    if not _interpreting():
        return
    from triton.runtime import interpreter

    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None or "int(self.handle.data))" not in inspect.getsource(patch_tensor):
        return

    def patch_lang_tensor(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patch_lang_tensor


_let_triton_36_interpret_with_numpy_24()
