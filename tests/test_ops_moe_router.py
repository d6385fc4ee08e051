"""The softmax top-k MoE router op (hybrid_compile/ops/moe_router.py) and its Triton kernel
(hybrid_compile/ops/triton/moe_router.py).

Oracle: a literal per-row computation in fp64 (softmax by its definition, the experts ordered by a
Python sort on (-probability, index): ties to the lower index), renormalised by the plain sum. On CPU
the kernel runs under Triton's interpreter at tiny shapes (T = 1, E not a power of two, equal logits);
the ``gpu`` tests run the registered CUDA op at E = 512 / top-10 and E = 256 / top-8, also in a CUDA graph.
"""

import math

import pytest
import torch

import hybrid_compile  # noqa: F401
from hybrid_compile.ops import moe_router
from hybrid_compile.ops.triton import moe_router as trouter
from op_testing import compile_and_compare, run_opcheck

INTERPRETER_ONLY = True

ops = torch.ops.hybrid_compile


def _oracle(logits, top_k, renormalize):
    """Per row: fp64 softmax of the (fp32-widened) logits, a sort on (-p, index), the first top_k."""
    weights, indices = [], []
    for row in logits.float().double().tolist():
        m = max(row)
        e = [math.exp(v - m) for v in row]
        s = sum(e)
        p = [v / s for v in e]
        order = sorted(range(len(p)), key=lambda i: (-p[i], i))[:top_k]
        w = [p[i] for i in order]
        if renormalize:
            w = [v / sum(w) for v in w]
        weights.append(w)
        indices.append(order)
    return torch.tensor(weights, dtype=torch.float64), torch.tensor(indices, dtype=torch.int64)


def _check(got, logits, top_k, renormalize, atol=1e-6):
    w, i = got
    ew, ei = _oracle(logits.cpu(), top_k, renormalize)
    assert w.dtype == torch.float32 and i.dtype == torch.int64 and w.shape == i.shape == (logits.shape[0], top_k)
    assert torch.equal(i.cpu(), ei)
    torch.testing.assert_close(w.cpu().double(), ew, atol=atol, rtol=1e-5)


def _ties(tokens, experts):
    """Logits with equal values: whole rows equal, and repeated maxima among others."""
    x = torch.randint(-2, 3, (tokens, experts)).float() / 4
    x[0] = 0.5  # one row of all-equal logits
    return x


IMPLS = {"op": ops.moe_topk_softmax, "triton": trouter.moe_topk_softmax_triton}


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (5, 7, 3), (9, 13, 13), (3, 60, 1), (17, 24, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_sorted_oracle(impl, renormalize, tokens, experts, top_k, dtype):
    """Random logits and logits with ties; T = 1, E not a power of two, top_k = E, bf16 logits."""
    gen = torch.Generator().manual_seed(tokens * experts)
    for logits in (torch.randn(tokens, experts, generator=gen) * 3, _ties(tokens, experts)):
        logits = logits.to(dtype)
        _check(IMPLS[impl](logits, top_k, renormalize), logits, top_k, renormalize)


def test_kernel_rows_per_program_and_strided_logits():
    """Several rows per program (the last program partly past T) and a transposed (non-contiguous) input."""
    logits = torch.randn(12, 11).t()  # [11, 12], stride (1, 11)
    for rows in (1, 4):
        _check(trouter.moe_topk_softmax_triton(logits, 5, True, rows_per_program=rows), logits, 5, True)
    w, i = trouter.moe_topk_softmax_triton(logits[:0], 2, True)
    assert w.shape == i.shape == (0, 2)


def test_kernel_at_real_expert_counts():
    """E = 512 / top-10 (BLOCK_E 512, one row a program) and E = 256 / top-8 at 70 tokens (4 rows a program)."""
    for tokens, experts, top_k in ((3, 512, 10), (70, 256, 8)):
        logits = (torch.randn(tokens, experts, generator=torch.Generator().manual_seed(experts)) * 2).bfloat16()
        _check(trouter.moe_topk_softmax_triton(logits, top_k, True), logits, top_k, True)


def test_hf_router_math_equivalence():
    """transformers' softmax router (softmax in fp32, torch.topk, sum + divide) on distinct probabilities."""
    logits = torch.randn(6, 32)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    v, i = torch.topk(probs, 4, dim=-1)
    w, idx = ops.moe_topk_softmax(logits, 4, True)
    assert torch.equal(idx, i)
    torch.testing.assert_close(w, v / v.sum(-1, keepdim=True), atol=0, rtol=0)


def test_argument_errors_opcheck_and_compile():
    with pytest.raises(ValueError, match="top_k"):
        ops.moe_topk_softmax(torch.randn(2, 4), 5, True)
    with pytest.raises(ValueError, match="top_k"):
        ops.moe_topk_softmax(torch.randn(2, 4), 0, False)
    with pytest.raises(ValueError, match="dtype"):
        ops.moe_topk_softmax(torch.randn(2, 4).double(), 2, True)
    with pytest.raises(ValueError, match="logits"):
        ops.moe_topk_softmax(torch.randn(2, 4, 1), 2, True)
    for renormalize in (True, False):
        run_opcheck(ops.moe_topk_softmax.default, (torch.randn(5, 10), 3, renormalize))
    run_opcheck(ops.moe_topk_softmax.default, (torch.randn(3, 6).bfloat16(), 2, True))

    def fn(x):
        w, i = ops.moe_topk_softmax(x * 2, 3, True)
        return w * 2, i + 1

    eager, compiled, _, _ = compile_and_compare(fn, torch.randn(7, 9))
    torch.testing.assert_close(compiled, eager)


# --------------------------------------------------------------------------------------------
# GPU: the registered CUDA op at real router shapes
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, pytest.param(16, marks=pytest.mark.smoke), 64, 300])
@pytest.mark.parametrize("experts,top_k", [(512, 10), (256, 8)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_router_at_real_shapes(tokens, experts, top_k, dtype):
    """Qwen3-Next / Qwen3.5 (512 experts, top-10) and Qwen3.5-35B (256, top-8) against the oracle."""
    gen = torch.Generator().manual_seed(tokens + experts)
    logits = (torch.randn(tokens, experts, generator=gen) * 2).to(dtype)
    for renormalize in (True, False):
        _check(ops.moe_topk_softmax(logits.cuda(), top_k, renormalize), logits, top_k, renormalize, atol=1e-6)
    ties = _ties(tokens, experts).to(dtype)
    _check(ops.moe_topk_softmax(ties.cuda(), top_k, True), ties, top_k, True)
    run_opcheck(ops.moe_topk_softmax.default, (logits[:5].cuda(), top_k, True))


@pytest.mark.gpu
@pytest.mark.smoke
def test_cuda_router_in_a_cuda_graph():
    logits = torch.randn(16, 512, device="cuda", dtype=torch.bfloat16)

    def step():
        return ops.moe_topk_softmax(logits, 10, True)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w, i = step()
    logits.copy_(torch.randn_like(logits))  # new logits between replays
    graph.replay()
    torch.cuda.synchronize()
    ew, ei = step()
    assert torch.equal(i, ei)
    torch.testing.assert_close(w, ew, rtol=0, atol=0)
    _check((w, i), logits, 10, True)
