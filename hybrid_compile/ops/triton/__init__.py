"""Triton CUDA kernels registered as the "cuda" implementation of the kernel ops.

Each sibling module holds the kernels and launchers of one op group and registers them with
``torch.library.register_kernel`` on import; the plain-torch implementations in
:mod:`hybrid_compile.ops` stay the CPU path and the ground truth the kernels are tested against.
"""
