"""Float MoE experts (hybrid_compile/ops/moe.py) and their Triton grouped GEMM (hybrid_compile/ops/triton/moe.py).

Oracle: the literal loop over (token, k) pairs in fp64, ``out[t] += w[t, k] * down[e] @ act(up[e] @ x[t])``
(transformers' experts math). On CPU the kernel runs under Triton's interpreter at tiny shapes; the ``gpu``
tests run the registered CUDA op at Qwen3.5-35B-A3B's expert shapes (256 experts, top-8, hidden 2048,
expert width 512), also inside a CUDA graph whose routing changes between replays.
"""

import pytest
import torch
import torch.nn.functional as F

import hybrid_compile  # noqa: F401
from hybrid_compile.ops import moe
from hybrid_compile.ops.triton import moe as tmoe
from op_testing import compile_and_compare, run_opcheck

INTERPRETER_ONLY = True

ops = torch.ops.hybrid_compile


def relu2(v):
    return F.relu(v) ** 2


def _oracle(x, top_k_index, top_k_weights, up, down, act, has_gate):
    """The literal per-(token, k) loop in fp64."""
    out = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float64, device=x.device)
    for t in range(x.shape[0]):
        for j in range(top_k_index.shape[1]):
            e = int(top_k_index[t, j])
            h = up[e].double() @ x[t].double()
            if has_gate:
                g, u = h.chunk(2)
                h = act(g) * u
            else:
                h = act(h)
            out[t] += float(top_k_weights[t, j]) * (down[e].double() @ h)
    return out


def _routing(tokens, experts, top_k, skew=False, generator=None):
    """Distinct experts per token; ``skew``: most pairs on expert 0 and 1, the last experts empty."""
    if skew:
        probs = torch.tensor([50.0, 20.0] + [1.0] * (experts - 4) + [0.0, 0.0])
        idx = torch.stack([torch.multinomial(probs, top_k, generator=generator) for _ in range(tokens)])
    else:
        idx = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
    w = torch.softmax(torch.randn(tokens, top_k, generator=generator), -1)
    return idx, w


def _weights(experts, hidden, inter, has_gate, dtype):
    up = torch.randn(experts, (2 if has_gate else 1) * inter, hidden) / hidden ** 0.5
    down = torch.randn(experts, hidden, inter) / inter ** 0.5
    return up.to(dtype), down.to(dtype)


TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (3e-2, 3e-2), torch.float16: (5e-3, 5e-3)}
CASES = [(1, 2, False), (5, 2, True), (37, 3, True), (12, 1, False)]  # (tokens, top_k, skewed routing)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("has_gate", [True, False])
@pytest.mark.parametrize("tokens,top_k,skew", CASES)
def test_experts_forward_matches_the_pair_loop(tokens, top_k, skew, has_gate, dtype):
    """The CPU op and the Triton kernel (interpreter) through the whole experts forward: T=1, uneven
    loads, experts with no tokens, silu-gate and relu2 experts."""
    experts, hidden, inter = 6, 32, 24
    act = F.silu if has_gate else relu2
    idx, w = _routing(tokens, experts, top_k, skew)
    up, down = _weights(experts, hidden, inter, has_gate, dtype)
    x = torch.randn(tokens, hidden).to(dtype)
    expected = _oracle(x, idx, w, up, down, act, has_gate)
    atol, rtol = TOL[dtype]
    for linear in (None, tmoe.moe_grouped_linear_triton):
        out = moe.fused_moe_experts(x, idx, w, up, down, act, has_gate, grouped_linear=linear)
        assert out.dtype == dtype and out.shape == (tokens, hidden)
        torch.testing.assert_close(out.double(), expected, atol=atol, rtol=rtol, msg=f"linear={linear}")


@pytest.mark.parametrize("counts", [[1, 0, 2, 1], [20, 0, 40, 9], [0, 0, 0, 5]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_grouped_kernel_matches_op_with_gather_and_scatter(counts, dtype):
    """Experts spanning several row tiles (forced 16-row tiles), non-contiguous x and weight."""
    n, k = 40, 48
    weight = (torch.randn(4, k, n) / k ** 0.5).to(dtype).transpose(1, 2)  # [E, N, K], K not innermost
    rows = sum(counts)
    x = torch.randn(k, rows + 3).to(dtype).t()  # [rows + 3, K], strided
    off = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    gather = torch.randint(0, rows + 3, (rows,))
    scatter = torch.randperm(rows)
    atol, rtol = TOL[dtype]
    for g, s in ((None, None), (gather, None), (gather, scatter), (None, scatter)):
        xs = x if g is not None else x[:rows]
        expected = ops.moe_grouped_linear(xs, weight, off, g, s)
        for config in (None, (16, 16, 16, 4, 1), (32, 64, 32, 4, 2)):
            got = tmoe.moe_grouped_linear_triton(xs, weight, off.to(torch.int32), g, s, config=config)
            torch.testing.assert_close(got, expected, atol=atol, rtol=rtol, msg=f"{config} gather={g is not None}")


def test_routing_sort_and_op_argument_errors():
    idx = torch.tensor([[2, 0], [2, 1], [0, 2]])
    r = moe.sort_pairs_by_expert(idx, 4)
    assert r.order.tolist() == [1, 4, 3, 0, 2, 5]  # stable: pairs of one expert keep (token, k) order
    assert r.expert_offsets.tolist() == [0, 2, 3, 6, 6] and r.token_of_row.tolist() == [0, 2, 1, 0, 1, 2]
    x, w = torch.randn(3, 8), torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match="expert_offsets"):
        ops.moe_grouped_linear(x, w, torch.tensor([0, 2, 2]))
    with pytest.raises(ValueError, match="dtype"):
        ops.moe_grouped_linear(x, w.double(), torch.tensor([0, 1, 3]))
    with pytest.raises(ValueError, match="input channels"):
        ops.moe_grouped_linear(x, torch.randn(2, 5, 7), torch.tensor([0, 1, 3]))
    with pytest.raises(ValueError, match="gather_index"):
        ops.moe_grouped_linear(x, w, torch.tensor([0, 1, 2]), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="scatter_index"):
        ops.moe_grouped_linear(x, w, torch.tensor([0, 1, 3]), None, torch.tensor([0, 1]))


def test_op_opcheck_and_compile_without_graph_breaks():
    x, w = torch.randn(5, 16), torch.randn(3, 12, 16)
    off = torch.tensor([0, 2, 2, 5])
    run_opcheck(ops.moe_grouped_linear.default, (x, w, off))
    run_opcheck(ops.moe_grouped_linear.default, (x, w, off, torch.tensor([4, 0, 0, 1, 3]), torch.tensor([1, 0, 4, 2, 3])))
    up, down = _weights(3, 16, 8, True, torch.float32)
    idx, rw = _routing(4, 3, 2)

    def fn(h, i, weights):
        return moe.fused_moe_experts(h * 2, i, weights, up, down, F.silu, True) + 1

    eager, compiled, _, _ = compile_and_compare(fn, x[:4], idx, rw)
    torch.testing.assert_close(compiled, eager)


# --------------------------------------------------------------------------------------------
# GPU: the registered CUDA op at Qwen3.5-35B-A3B's expert shapes
# --------------------------------------------------------------------------------------------

EXPERTS, TOP_K, HIDDEN, INTER = 256, 8, 2048, 512


def _cuda_case(tokens, has_gate, dtype=torch.bfloat16):
    """Routing drawn on the CPU; weights and activations drawn on the GPU (3 GiB of fp32 at this shape)."""
    gen = torch.Generator().manual_seed(tokens)
    idx, w = _routing(tokens, EXPERTS, TOP_K, generator=gen)
    torch.manual_seed(tokens)
    up = torch.randn(EXPERTS, (2 if has_gate else 1) * INTER, HIDDEN, device="cuda").mul_(HIDDEN ** -0.5).to(dtype)
    down = torch.randn(EXPERTS, HIDDEN, INTER, device="cuda").mul_(INTER ** -0.5).to(dtype)
    x = torch.randn(tokens, HIDDEN, device="cuda").to(dtype)
    return x, idx.cuda(), w.cuda(), up, down


@pytest.mark.gpu
@pytest.mark.parametrize("has_gate", [True, False])
@pytest.mark.parametrize("tokens", [1, pytest.param(16, marks=pytest.mark.smoke), 64])
def test_cuda_experts_at_qwen35_moe_shapes(tokens, has_gate):
    """bf16 experts forward on CUDA vs the pair loop in fp64 on the CPU (the same bf16 weights)."""
    act = F.silu if has_gate else relu2
    x, idx, w, up, down = _cuda_case(tokens, has_gate)
    out = moe.fused_moe_experts(x, idx, w, up, down, act, has_gate)
    expected = _oracle(x, idx.cpu(), w.cpu(), up, down, act, has_gate)  # fp64 on the GPU, pair by pair
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=3e-2)
    h = torch.randn(5, HIDDEN, device="cuda", dtype=torch.bfloat16)
    run_opcheck(ops.moe_grouped_linear.default, (h, up[:3], torch.tensor([0, 2, 2, 5], device="cuda"),
                                                 torch.tensor([4, 0, 0, 1, 3], device="cuda"), None))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cuda_grouped_op_other_dtypes_and_prefill_tiles(dtype):
    """fp32 (IEEE dot) and fp16, 2048 tokens (the prefill tiles), against the CPU op."""
    x, idx, w, up, down = _cuda_case(2048 if dtype == torch.float16 else 300, True, dtype)
    r = moe.sort_pairs_by_expert(idx, EXPERTS)
    got = ops.moe_grouped_linear(x, up, r.expert_offsets, r.token_of_row, r.order)
    # the plain-torch op on the GPU in fp32 (torch's CUDA matmuls default to exact fp32, no TF32)
    expected = moe.reference_moe_grouped_linear(x.float(), up.float(), r.expert_offsets, r.token_of_row, r.order)
    torch.testing.assert_close(got.float(), expected, atol=TOL[dtype][0] * 10, rtol=TOL[dtype][1] * 10)


@pytest.mark.gpu
@pytest.mark.smoke
def test_cuda_experts_in_a_cuda_graph():
    x, idx, w, up, down = _cuda_case(16, True)

    def step():
        return moe.fused_moe_experts(x, idx, w, up, down, F.silu, True)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    idx2, w2 = _routing(16, EXPERTS, TOP_K, generator=torch.Generator().manual_seed(1))
    idx2[:, 0] = 3  # routing changes between replays (one expert gets every token)
    for dst, src in ((x, torch.randn_like(x)), (idx, idx2), (w, w2)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, step(), rtol=0, atol=0)
