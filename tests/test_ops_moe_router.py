"""The MoE router ops (hybrid_compile/ops/moe_router.py: softmax top-k, sigmoid group-limited) and their Triton kernels
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


# --------------------------------------------------------------------------------------------
# moe_topk_sigmoid_grouped: the sigmoid group-limited router (Kimi-Linear, NemotronH)
# --------------------------------------------------------------------------------------------


def _grouped_oracle(logits, bias, top_k, groups, topk_groups, renormalize, scaling):
    """Per row in fp64: sigmoid by its definition, corrected scores, each group's two best summed,
    groups and then experts ordered by a Python sort on (-score, index), the first ones kept."""
    weights, indices = [], []
    per = logits.shape[1] // groups
    for row in logits.double().tolist():
        s = [1 / (1 + math.exp(-v)) for v in row]
        c = [a + b for a, b in zip(s, bias.double().tolist())]
        gs = [sum(sorted(c[g * per:(g + 1) * per], reverse=True)[:2]) for g in range(groups)]
        kept = sorted(range(groups), key=lambda g: (-gs[g], g))[:topk_groups] if groups > 1 else [0]
        allowed = [i for i in range(len(c)) if i // per in kept]
        order = sorted(allowed, key=lambda i: (-c[i], i))[:top_k]
        w = [s[i] for i in order]
        if renormalize:
            w = [v / (sum(w) + 1e-20) for v in w]
        weights.append([v * scaling for v in w])
        indices.append(order)
    return torch.tensor(weights, dtype=torch.float64), torch.tensor(indices, dtype=torch.int64)


GROUPED_IMPLS = {"op": ops.moe_topk_sigmoid_grouped, "triton": trouter.moe_topk_sigmoid_grouped_triton}
GROUPED_CASES = [(1, 8, 2, 1, 1), (5, 12, 3, 4, 2), (9, 64, 6, 8, 4), (70, 48, 8, 1, 1), (3, 16, 16, 2, 2)]


@pytest.mark.parametrize("impl", sorted(GROUPED_IMPLS))
@pytest.mark.parametrize("tokens,experts,top_k,groups,topk_groups", GROUPED_CASES)
@pytest.mark.parametrize("renormalize,scaling", [(True, 2.5), (False, 1.0)])
def test_sigmoid_grouped_matches_the_sorted_oracle(impl, tokens, experts, top_k, groups, topk_groups, renormalize,
                                                   scaling):
    """T = 1 and 70 (4 rows a program), E not a power of two, groups of 2-16 experts, top_k = E."""
    gen = torch.Generator().manual_seed(tokens * experts + groups)
    logits = torch.randn(tokens, experts, generator=gen) * 2
    bias = torch.randn(experts, generator=gen) * 0.3
    w, i = GROUPED_IMPLS[impl](logits, bias, top_k, groups, topk_groups, renormalize, scaling)
    ew, ei = _grouped_oracle(logits, bias, top_k, groups, topk_groups, renormalize, scaling)
    assert w.dtype == torch.float32 and i.dtype == torch.int64 and w.shape == i.shape == (tokens, top_k)
    assert torch.equal(i, ei)
    torch.testing.assert_close(w.double(), ew, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("groups,topk_groups,top_k", [(1, 1, 8), (8, 4, 6)])
def test_sigmoid_grouped_equals_transformers_router(groups, topk_groups, top_k):
    """transformers' NemotronH router (Kimi-Linear's is the same code): the same experts (its
    ``torch.topk(sorted=False)`` gives them in no promised order) and weights."""
    import types

    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHTopkRouter

    cfg = types.SimpleNamespace(num_experts_per_tok=top_k, num_local_experts=64, hidden_size=32, n_group=groups,
                                topk_group=topk_groups, routed_scaling_factor=2.5, norm_topk_prob=True)
    router = NemotronHTopkRouter(cfg)
    gen = torch.Generator().manual_seed(groups)
    with torch.no_grad():
        router.weight.copy_(torch.randn(64, 32, generator=gen))
        router.e_score_correction_bias.copy_(torch.randn(64, generator=gen) * 0.3)
        logits, hf_w, hf_i = router(torch.randn(40, 32, generator=gen))
    for impl in GROUPED_IMPLS.values():
        w, i = impl(logits, router.e_score_correction_bias, top_k, groups, topk_groups, True, 2.5)
        order, hf_order = i.argsort(-1), hf_i.argsort(-1)
        assert torch.equal(i.gather(1, order), hf_i.gather(1, hf_order))
        torch.testing.assert_close(w.gather(1, order), hf_w.gather(1, hf_order), atol=1e-6, rtol=1e-5)


def test_sigmoid_grouped_argument_errors_opcheck_and_compile():
    x, b = torch.randn(4, 16), torch.randn(16)
    for args, match in [((x, b, 3, 3, 1), "num_groups"), ((x, b, 3, 4, 5), "topk_groups"), ((x, b, 9, 4, 2), "top_k"),
                        ((x, b[:8], 3, 1, 1), "bias"), ((x.bfloat16(), b, 3, 1, 1), "dtype"),
                        ((torch.randn(4, 8), torch.randn(8), 1, 8, 1), "too small")]:
        with pytest.raises(ValueError, match=match):
            ops.moe_topk_sigmoid_grouped(*args, True, 1.0)
    for renormalize in (True, False):
        run_opcheck(ops.moe_topk_sigmoid_grouped.default, (x, b, 3, 4, 2, renormalize, 2.0))

    def fn(x):
        w, i = ops.moe_topk_sigmoid_grouped(x * 2, b, 3, 4, 2, True, 2.5)
        return w * 2, i + 1

    eager, compiled, _, _ = compile_and_compare(fn, torch.randn(7, 16))
    torch.testing.assert_close(compiled, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, pytest.param(64, marks=pytest.mark.smoke), 300])
@pytest.mark.parametrize("experts,top_k,groups,topk_groups", [(256, 8, 1, 1), (256, 8, 8, 4), (128, 6, 1, 1)])
def test_cuda_sigmoid_grouped_at_real_shapes(tokens, experts, top_k, groups, topk_groups):
    """Kimi-Linear-48B (256 experts, top-8), a DeepSeek-V3-style grouping (8 groups, 4 kept) and
    Nemotron-3 Nano's 128 / top-6 against the oracle; opcheck and a CUDA graph replay on the GPU."""
    gen = torch.Generator().manual_seed(tokens + experts + groups)
    logits, bias = torch.randn(tokens, experts, generator=gen) * 2, torch.randn(experts, generator=gen) * 0.3
    w, i = ops.moe_topk_sigmoid_grouped(logits.cuda(), bias.cuda(), top_k, groups, topk_groups, True, 2.5)
    ew, ei = _grouped_oracle(logits, bias, top_k, groups, topk_groups, True, 2.5)
    assert torch.equal(i.cpu(), ei)
    torch.testing.assert_close(w.cpu().double(), ew, atol=1e-6, rtol=1e-5)
    run_opcheck(ops.moe_topk_sigmoid_grouped.default, (logits[:5].cuda(), bias.cuda(), top_k, groups, topk_groups,
                                                       True, 2.5))
    x, b = logits.cuda(), bias.cuda()
    ops.moe_topk_sigmoid_grouped(x, b, top_k, groups, topk_groups, True, 2.5)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gw, gi = ops.moe_topk_sigmoid_grouped(x, b, top_k, groups, topk_groups, True, 2.5)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    ew, ei = _grouped_oracle(x.cpu(), bias, top_k, groups, topk_groups, True, 2.5)
    assert torch.equal(gi.cpu(), ei)


_SM90_BUILD = r'''
import json
from benchmarks.kda_intra_build import build_kernel
from hybrid_compile.ops.triton import moe_router as r

# Kimi-Linear-48B's router (256 experts, top-8, one group) and a DeepSeek-V3-style grouping (8 groups, 4 kept),
# one token a program (decode), as the launcher sets them
for groups, kept in ((1, 1), (8, 4)):
    consts = dict(TOP_K=8, NUM_GROUPS=groups, TOPK_GROUPS=kept, PER_GROUP=256 // groups, RENORMALIZE=True, ROWS=1,
                  BLOCK_E=256, BLOCK_K=8, BLOCK_G=groups, USE_PDL=False)
    kern = r._topk_sigmoid_grouped_kernel
    sig = {n: "constexpr" if n in consts else {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "w_ptr": "*fp32",
           "idx_ptr": "*i64", "scaling": "fp32"}.get(n, "i32") for n in kern.arg_names}
    stats = build_kernel(kern, sig, consts, 1)
    print(json.dumps(dict(groups=groups, regs=stats["regs"], spill_stores=stats["spill_stores"])))
'''


def test_sigmoid_grouped_kernel_builds_for_sm90_without_spilling(tmp_path):
    """The grouped router kernel compiled for sm_90 on this machine (the interpreter never compiles it):
    both groupings build, without spills."""
    from sm90_builds import build_stats

    rows = build_stats(_SM90_BUILD, tmp_path)
    assert [r["groups"] for r in rows] == [1, 8], rows
    assert all(r["spill_stores"] == 0 and r["regs"] <= 255 for r in rows), rows
