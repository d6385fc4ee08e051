"""Triton CUDA kernels registered as the "cuda" implementation of the kernel ops.

Each sibling module holds the kernels and launchers of one op group and registers them with
``torch.library.register_kernel`` on import; the plain-torch implementations in
:mod:`hybrid_compile.ops` stay the CPU path and the ground truth the kernels are tested against.

On import this package points Triton at the ``ptxas`` that Inductor uses (:func:`use_inductors_ptxas`),
so that our kernels compile with one assembler in every process and come from Triton's on-disk cache
in the next one.
"""

from __future__ import annotations

import os


def use_inductors_ptxas() -> str | None:
    """Set ``TRITON_PTXAS_PATH`` as Inductor does before it compiles (torch's bundled ``ptxas``,
    where its wheel ships one and the variable is unset) and return the variable's value.

    Why: Triton's cache key holds the assembler's version. Inductor sets the variable lazily, the
    first time it compiles or loads a kernel in a process; our kernels first compiled before that
    (a fresh machine: Inductor compiles in its workers) took Triton's own ``ptxas``, and every later
    process, in which Inductor loads its cached kernels first, took torch's, so each restart after
    the first compiled all of them again (an H200, torch 2.11: Triton's 12.8 against torch's 13.0,
    every one of our kernels a cache miss in the second process). A user's own setting is kept.
    """
    try:
        from torch._inductor.runtime.compile_tasks import _set_triton_ptxas_path
    except ImportError:  # a torch without it: Inductor sets nothing either
        return os.environ.get("TRITON_PTXAS_PATH")
    _set_triton_ptxas_path()
    return os.environ.get("TRITON_PTXAS_PATH")


use_inductors_ptxas()
