"""How every ``hybrid_compile::`` op is registered: :func:`kernel_op`.

``kernel_op(qualname, mutates_args=...)`` is used like ``torch.library.custom_op``: the decorated
function is the op's implementation on every device without a kernel of its own (the plain-torch
CPU path), the schema is inferred from its annotations (``torch.library.infer_schema``), and the
returned :class:`KernelOp` calls the op and takes ``register_fake``; a Triton kernel joins through
``torch.library.register_kernel(qualname, "cuda", fn)`` as before.

Why not ``custom_op`` itself: its ops dispatch through Python kernels at the autograd and
ADInplaceOrView keys (version bumps argument by argument, default filling, aliasing checks) before
the implementation runs. Measured on the 2-core CPU machine (torch 2.13, inference mode, tiny
tensors, 2026-11-27, ``benchmarks/host_overhead.py --op-dispatch``): a call of an op mutating one
argument costs 17.6 us through ``custom_op`` against 4.3 us defined here, one mutating 13 arguments
(``uniform_step_metadata``'s count) 198 us against 7.3 us. Eager op calls are every extend step's
layers (the ops between the piecewise graphs), the decode step's metadata op and the speculative
cycle's host work. The
schema, the fake implementation, ``opcheck``, ``torch.compile`` (mutations are functionalized from
the schema's alias annotations) and the CUDA kernels are the same either way. These ops have no
autograd formula under either registration (inference kernels).
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable

import torch

__all__ = ["KernelOp", "kernel_op"]

NAMESPACE = "hybrid_compile"
# (one fragment of the namespace for all of this package's ops; kept alive with the module)
_LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")


class KernelOp:
    """A registered op (see the module docstring): calling it calls the operator
    ``torch.ops.hybrid_compile.<name>.default``; it carries the implementation's name and docstring."""

    def __init__(self, qualname: str, fn: Callable, mutates_args: Iterable[str] | str) -> None:
        namespace, _, name = qualname.partition("::")
        if namespace != NAMESPACE or not name:
            raise ValueError(f"kernel_op: {qualname!r} is not a {NAMESPACE}:: op name")
        schema = torch.library.infer_schema(fn, mutates_args=mutates_args)
        _LIBRARY.define(name + schema)
        _LIBRARY.impl(name, fn, "CompositeExplicitAutograd")
        functools.update_wrapper(self, fn)
        self.qualname = qualname
        self._opoverload = getattr(getattr(torch.ops, NAMESPACE), name).default

    def __call__(self, *args, **kwargs):
        return self._opoverload(*args, **kwargs)

    def register_fake(self, fn: Callable) -> Callable:
        """The op's fake (meta) implementation, for tracing: a decorator, as ``custom_op``'s."""
        torch.library.register_fake(self.qualname, fn, lib=_LIBRARY)
        return fn


def kernel_op(qualname: str, *, mutates_args: Iterable[str] | str) -> Callable[[Callable], KernelOp]:
    """Define the op ``qualname`` (``"hybrid_compile::name"``) from the decorated function (module docstring)."""

    def register(fn: Callable) -> KernelOp:
        return KernelOp(qualname, fn, mutates_args)

    return register
