"""Helpers shared by the kernel-op tests: varlen batches, tolerances, opcheck, compile checks."""

from __future__ import annotations

import torch

# Request lengths covering the edge cases every varlen op must handle:
# zero-length and one-token requests, lengths below/at/above the 64-token chunk, not divisible by 64.
VARLEN_CASES = [
    [5],
    [1, 1, 1],
    [0, 7, 1],
    [64],
    [65, 0, 3],
    [130, 17, 64, 1],
]

# (atol, rtol) of an op's output against the per-token reference, by input dtype.
TOLERANCE = {
    torch.float32: (2e-4, 2e-4),
    torch.bfloat16: (3e-2, 3e-2),
    torch.float16: (5e-3, 5e-3),
}


def cu_seqlens_of(lens: list[int], device="cpu", dtype=torch.int32) -> torch.Tensor:
    out = torch.zeros(len(lens) + 1, dtype=dtype, device=device)
    if lens:
        out[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0).to(dtype)
    return out


def distinct_slots(batch: int, num_slots: int, *, pad_rows=(), generator=None) -> torch.Tensor:
    """Random distinct slot indices in [0, num_slots), with -1 at the given rows."""
    perm = torch.randperm(num_slots, generator=generator)[:batch].to(torch.int32)
    for r in pad_rows:
        perm[r] = -1
    return perm


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype = torch.float32, msg: str = ""):
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol, msg=msg or None)


def with_omitted_optionals(op, args: tuple, kwargs: dict | None = None) -> dict:
    """``kwargs`` plus None for each optional argument of ``op`` the call leaves out: the ops give their
    mutated optional arguments (FP8 scales, intermediate states) no default (tests/test_project.py says why)."""
    kwargs = dict(kwargs or {})
    if isinstance(op, torch._ops.OpOverload):
        schema = op._schema
    elif isinstance(op, torch._ops.OpOverloadPacket):
        schema = op.default._schema
    else:  # a torch.library.custom_op definition
        schema = op._opoverload._schema
    for arg in schema.arguments[len(args):]:
        if arg.name not in kwargs and not arg.has_default_value() and isinstance(arg.type, torch.OptionalType):
            kwargs[arg.name] = None
    return kwargs


def run_opcheck(op, args: tuple, kwargs: dict | None = None):
    """torch.library.opcheck with every test utility; mutated inputs are cloned by opcheck itself."""
    torch.library.opcheck(op, args, with_omitted_optionals(op, args, kwargs))


def compile_and_compare(fn, *args, clone_args=True):
    """Run ``fn`` eagerly and under torch.compile(fullgraph=True, dynamic=True) on clones of
    ``args``; return (eager_result, compiled_result, eager_args, compiled_args).

    fullgraph=True makes any graph break an error, so a passing call proves there is none.
    """
    import torch._dynamo

    torch._dynamo.reset()

    def clone(a):
        if isinstance(a, torch.Tensor):
            return a.clone()
        if isinstance(a, (list, tuple)):
            return type(a)(clone(x) for x in a)
        return a

    eager_args = [clone(a) for a in args] if clone_args else list(args)
    compiled_args = [clone(a) for a in args] if clone_args else list(args)
    eager = fn(*eager_args)
    compiled_fn = torch.compile(fn, fullgraph=True, dynamic=True, backend="inductor")
    compiled = compiled_fn(*compiled_args)
    return eager, compiled, eager_args, compiled_args


# opcheck's schema test compares inputs before and after the call with torch.allclose, which has no
# float8 kernel; for ops with e4m3 inputs it is replaced by a bitwise no-mutation check.
OPCHECK_WITHOUT_SCHEMA = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def opcheck_fp8_inputs(op, args, kwargs=None):
    """opcheck of an op with ``float8_e4m3fn`` inputs, plus a bitwise check that none was mutated."""
    kwargs = kwargs or {}
    before = [a.view(torch.uint8).clone() if isinstance(a, torch.Tensor) and a.dtype == torch.float8_e4m3fn
              else a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    torch.library.opcheck(op, args, kwargs, test_utils=OPCHECK_WITHOUT_SCHEMA)
    op(*args, **kwargs)
    for a, b in zip(args, before):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a, b), "an input was mutated"


def fp8_linear_then_experts_graph(rows: int, offsets: list[int], new_offsets: list[int], step):
    """``step(x, q, s, qe, se, offsets)`` (the caller's ``fp8_block_linear`` of ``rows`` bf16 rows then
    ``fp8_grouped_linear`` over 8 experts) captured in a CUDA graph and replayed after the activation
    and the routing (``offsets`` -> ``new_offsets``) changed. Returns (the replay's output, an eager
    call on the same inputs, the inputs ``(x, q, s, qe, se, offsets)``)."""
    from hybrid_compile.ops import fp8

    torch.manual_seed(0)
    q, s = fp8.quantize_weight_blocks(torch.randn(2048, 2048, device="cuda") / 45)
    qe, se = fp8.quantize_weight_blocks(torch.randn(8, 256, 2048, device="cuda") / 45)
    x = torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16)
    off = torch.tensor(offsets, device="cuda")
    inputs = (x, q, s, qe, se, off)
    step(*inputs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(*inputs)
    x.copy_(torch.randn_like(x))
    off.copy_(torch.tensor(new_offsets, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    return out, step(*inputs), inputs
