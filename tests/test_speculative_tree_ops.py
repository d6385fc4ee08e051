"""The verify kernel ops over a speculative draft TREE (``parent_indices`` / ``tree_mask``):
``causal_conv1d_update``, ``fused_recurrent_gated_delta_rule_update``, ``selective_state_update``
and ``paged_attention_extend``, the plain-torch op and the Triton launcher (interpreter on CPU),
each against an oracle that knows nothing of trees: every node's root path run as a CHAIN through
the per-token reference (``ops/reference``), whose last step must equal the node's output and
stored state (attention also under sliding windows). opcheck for every changed op; the ``gpu`` tests run the CUDA ops at model shapes.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_compile.ops.reference import attention as ref_attn
from hybrid_compile.ops.reference import conv1d as ref_conv
from hybrid_compile.ops.reference import gdn as ref_gdn
from hybrid_compile.ops.reference import mamba2 as ref_m2
from hybrid_compile.ops.reference import tree as ref_tree
from hybrid_compile.ops.triton import attention as tattn
from hybrid_compile.ops.triton import conv1d as tconv
from hybrid_compile.ops.triton import gdn as tgdn
from hybrid_compile.ops.triton import mamba2 as tm2
from op_testing import assert_close, run_opcheck

INTERPRETER_ONLY = True  # the CPU tests call the Triton launchers under the interpreter (conftest)

ops = torch.ops.hybrid_compile
# two trees of 6 nodes (node 0 = the root, the request's pending token) and a chain
TREES = [[-1, 0, 0, 1, 2, 1], [-1, 0, 1, 0, 3, 3], [-1, 0, 1, 2, 3, 4]]


def _parents(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int32)


def _bits(parents: list[int]) -> list[int]:
    return ref_tree.ancestor_bits(parents)


# ---------------------------------------------------------------------------------------------
# conv1d
# ---------------------------------------------------------------------------------------------


def _conv_inputs(B=3, L=6, D=40, W=4, slots=(2, -1, 5)):
    x = torch.randn(B, L, D)
    states = torch.randn(8, W - 1, D)
    weight, bias = torch.randn(D, W) * 0.5, torch.randn(D)
    idx = torch.tensor(slots, dtype=torch.int32)
    inter = torch.full((B + 1, L, W - 1, D), 7.0)
    return x, states, weight, bias, idx, inter


def test_conv1d_update_tree_matches_chain_reference_per_path():
    x, states, weight, bias, idx, inter = _conv_inputs()
    parents = _parents(TREES)
    got_states, got_inter = states.clone(), inter.clone()
    out = ops.causal_conv1d_update(x, got_states, weight, bias, "silu", idx, True, got_inter, parents)
    t_states, t_inter = states.clone(), inter.clone()
    t_out = tconv.causal_conv1d_update_triton(x, t_states, weight, bias, "silu", idx, True, t_inter, parents)

    def chain(b, xs, n):
        o, _, win = ref_conv.causal_conv1d_update_ref(xs[0], states, weight, bias, "silu", idx[b:b + 1], True,
                                                      torch.zeros(1, n, *inter.shape[2:]))
        return o, win

    want_out, want_win = ref_tree.tree_by_paths(chain, [x], parents)
    real = [0, 2]
    assert_close(out[real], want_out[real])
    assert_close(t_out[real], want_out[real])
    assert_close(got_inter[real], want_win[real])
    assert_close(t_inter[real], want_win[real])
    assert torch.all(out[1] == 0) and torch.all(t_out[1] == 0)
    for buf in (got_inter, t_inter):  # padding row and spare row untouched
        assert torch.all(buf[1] == 7.0) and torch.all(buf[3] == 7.0)
    assert torch.equal(got_states, states) and torch.equal(t_states, states)


@pytest.mark.parametrize("inter_dtype,width", [(torch.bfloat16, 4), (torch.float16, 3), (torch.float32, 2)])
def test_conv1d_update_tree_windows_as_stored(inter_dtype, width):
    """A node continues its parent's window as the intermediate buffer stores it: with a bf16 / fp16
    buffer under fp32 inputs and state (a node's window then holds its ancestors' inputs and the
    slot's rows rounded to the buffer's dtype, except a root's, read from the slot), the Triton kernel
    equals the plain op exactly, windows and outputs, on trees of 9 nodes (two roots in one, depths
    0 to 5, past the window)."""
    B, L, D = 3, 9, 24
    x = torch.randn(B, L, D)
    states = torch.randn(6, width - 1, D)
    weight, bias = torch.randn(D, width) * 0.5, torch.randn(D)
    idx = torch.tensor([4, 0, 2], dtype=torch.int32)
    parents = _parents([[-1, 0, 0, 1, 1, 3, 2, 5, 7], [-1, -1, 0, 1, 2, 2, 5, 0, 6], [-1, 0, 1, 2, 3, 4, 0, 6, 6]])
    inter = torch.zeros(B, L, width - 1, D, dtype=inter_dtype)
    got_inter, t_inter = inter.clone(), inter.clone()
    out = ops.causal_conv1d_update(x, states.clone(), weight, bias, "silu", idx, True, got_inter, parents)
    t_out = tconv.causal_conv1d_update_triton(x, states.clone(), weight, bias, "silu", idx, True, t_inter, parents)
    assert torch.equal(t_inter, got_inter)
    torch.testing.assert_close(t_out, out, atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# Gated DeltaNet
# ---------------------------------------------------------------------------------------------


def _gdn_inputs(B=3, L=6, hk=1, hv=2, kd=16, vd=16):
    q = torch.randn(B, L, hk, kd)
    k = torch.randn(B, L, hk, kd) / kd ** 0.5
    v = torch.randn(B, L, hv, vd)
    g = -torch.rand(B, L, hv) * 0.4 - 0.01
    beta = torch.rand(B, L, hv)
    pool = torch.randn(8, hv, kd, vd) * 0.5
    idx = torch.tensor([4, 1, -1], dtype=torch.int32)
    inter = torch.full((B, L, hv, kd, vd), 7.0)
    return q, k, v, g, beta, pool, idx, inter


def test_gdn_verify_tree_matches_chain_reference_per_path():
    q, k, v, g, beta, pool, idx, inter = _gdn_inputs()
    parents = _parents(TREES)
    got_pool, got_inter = pool.clone(), inter.clone()
    out = ops.fused_recurrent_gated_delta_rule_update(q, k, v, g, beta, got_pool, idx, True, 0.0, True, got_inter,
                                                      None, None, parents)
    t_pool, t_inter = pool.clone(), inter.clone()
    t_out = tgdn.fused_recurrent_gated_delta_rule_update_triton(q, k, v, g, beta, t_pool, idx, True, 0.0, True,
                                                                t_inter, None, None, parents)

    def chain(b, xs, n):
        o, _, st = ref_gdn.fused_recurrent_gated_delta_rule_update_ref(
            *xs, pool, idx[b:b + 1], True, 0.0, True, torch.zeros(1, n, *inter.shape[2:]))
        return o, st

    want_out, want_state = ref_tree.tree_by_paths(chain, [q, k, v, g, beta], parents)
    real = [0, 1]
    for o, buf in ((out, got_inter), (t_out, t_inter)):
        assert_close(o[real], want_out[real])
        assert_close(buf[real], want_state[real])
        assert torch.all(o[2] == 0) and torch.all(buf[2] == 7.0)
    assert torch.equal(got_pool, pool) and torch.equal(t_pool, pool)


@pytest.mark.parametrize("per_k_gate,inter_dtype", [(False, torch.float32), (True, torch.float32),
                                                      (False, torch.bfloat16)])
def test_gdn_verify_random_trees_one_program_per_path(per_k_gate, inter_dtype):
    """The Triton verify walks each root-to-leaf path in its own programs (state in registers,
    every node stored once by the path that owns it): random trees of 11 nodes, a forest (several
    nodes starting from the slot's state) and a chain against the chain reference per root path,
    with a per-channel gate (KDA) and a bf16 intermediate buffer (children start from the state as
    stored) against the plain op."""
    gen = torch.Generator().manual_seed(5)
    B, L = 5, 11
    parents = ref_tree.trees_forest_and_chain(B, gen)  # random trees, a forest, a chain
    q, k, v, g, beta, pool, _, _ = _gdn_inputs(B, L)
    if per_k_gate:
        g = -torch.rand(*g.shape, q.shape[-1], generator=gen) * 0.4 - 0.01
    idx = torch.tensor([4, 1, -1, 6, 0], dtype=torch.int32)
    inter = torch.full((B, L, *pool.shape[1:]), 7.0, dtype=inter_dtype)
    got_inter, t_inter = inter.clone(), inter.clone()
    out = ops.fused_recurrent_gated_delta_rule_update(q, k, v, g, beta, pool.clone(), idx, True, 0.0, True, got_inter,
                                                      None, None, parents)
    t_out = tgdn.fused_recurrent_gated_delta_rule_update_triton(q, k, v, g, beta, pool.clone(), idx, True, 0.0, True,
                                                                t_inter, None, None, parents)
    # (bf16: the interpreter's fp32 -> bf16 cast truncates where torch rounds, in the stored states and so
    # in the children started from them: bf16 tolerances)
    assert_close(t_out, out, inter_dtype)
    assert_close(t_inter.float(), got_inter.float(), inter_dtype)
    assert torch.all(t_out[2] == 0) and torch.all(t_inter[2] == 7.0)  # the padding row: nothing written
    if inter_dtype == torch.float32:

        def chain(b, xs, n):
            o, _, st = ref_gdn.fused_recurrent_gated_delta_rule_update_ref(
                *xs, pool, idx[b:b + 1], True, 0.0, True, torch.zeros(1, n, *inter.shape[2:]))
            return o, st

        want_out, want_state = ref_tree.tree_by_paths(chain, [q, k, v, g, beta], parents)
        real = [0, 1, 3, 4]
        assert_close(t_out[real], want_out[real])
        assert_close(t_inter[real], want_state[real])


# the recurrent verify kernels built for sm_90 at model shapes, chain and tree (JSON lines)
_SM90_TREE_BUILDS = """
import json, sys
from benchmarks.kda_intra_build import build_kernel
from hybrid_compile.ops.triton import gdn, lightning, mamba1, mamba2

def sig(kern, consts, ints, floats, ptr_i32, ptr_bf16):
    out = {}
    for n in kern.arg_names:
        if n in consts: out[n] = "constexpr"
        elif n in ints: out[n] = "i32"
        elif n in floats: out[n] = "fp32"
        elif n in ptr_i32: out[n] = "*i32"
        elif n in ptr_bf16: out[n] = "*bf16"
        elif n.startswith("s") and not n.endswith("_ptr") and n not in ("slope", "scale", "softplus_beta",
                                                                          "softplus_threshold", "state_indices"):
            out[n] = "i64"
        else: out[n] = "*fp32"
    return out

cases = [
    ("gdn", gdn._gdn_recurrent_kernel, 2, dict(R=2, K=128, V=128, BK=128, BV=16, GATING=False, USE_L2=True,
     HAS_INTER=True, UPDATE_STATE=False, POOL_FP8=False, INTER_FP8=False, ROUND_STEPS=False, USE_PDL=False,
     PER_K_GATE=False), ("L",), ("scale", "softplus_beta", "softplus_threshold"), ("state_indices", "parents"),
     ("q", "k", "v", "o", "g", "beta")),
    ("mamba2", mamba2._ssu_kernel, 4, dict(HAS_D=True, HAS_Z=True, HAS_BIAS=True, DT_SOFTPLUS=True,
     UPDATE_STATE=False, HAS_INTER=True, A_IS_LOG=True, BLOCK_P=8, BLOCK_N=128, STATE_FP8=False, INTER_FP8=False,
     ROUND_STEPS=False, USE_PDL=False), ("L", "P", "N", "R"), ("dt_min", "dt_max"), ("idx_ptr", "parent_ptr"),
     ("x_ptr", "B_ptr", "C_ptr", "z_ptr", "out_ptr", "dt_ptr")),
    ("mamba1", mamba1._update_kernel, 4, dict(HAS_D=True, HAS_Z=True, HAS_BIAS=True, DT_SOFTPLUS=True,
     UPDATE_STATE=False, HAS_INTER=True, A_IS_LOG=True, BLOCK_D=64, BLOCK_N=16, STATE_FP8=False, INTER_FP8=False,
     ROUND_STEPS=False, USE_PDL=False), ("L", "D_inner", "N", "R"), (), ("idx_ptr", "parent_ptr"),
     ("x_ptr", "B_ptr", "C_ptr", "z_ptr", "out_ptr", "dt_ptr")),
    ("lightning", lightning._lightning_recurrent_kernel, 4, dict(K=128, V=128, BK=128, BV=32, HAS_INTER=True,
     UPDATE_STATE=False, USE_PDL=False, POOL_FP8=False, INTER_FP8=False), ("L",), (), ("state_indices", "parents"),
     ("q", "k", "v", "o")),
]
for name, kern, warps, base, ints, floats, p32, pbf in cases:
    for tree in (False, True):
        consts = dict(base, TREE=tree, BL=16 if tree else 1)
        st = build_kernel(kern, sig(kern, consts, ints, floats, p32, pbf), consts, warps)
        print(json.dumps(dict(kernel=name, tree=tree, regs=st["regs"], spill_stores=st["spill_stores"],
                              node_loop=st["loops"][0])))
"""


def test_tree_verify_kernels_build_for_sm90_without_spilling(tmp_path):
    """The GDN, Mamba2, Mamba1 and lightning verify kernels compiled for sm_90 at model shapes (the
    interpreter runs kernels but never compiles them), chain and tree: all build without spills, and
    a tree's node loop (one path per program, ``common.tree_path``) stays within 1.3x the chain's."""
    from sm90_builds import build_stats

    rows = build_stats(_SM90_TREE_BUILDS, tmp_path)
    assert [(r["kernel"], r["tree"]) for r in rows] == [
        (k, t) for k in ("gdn", "mamba2", "mamba1", "lightning") for t in (False, True)], rows
    assert all(r["spill_stores"] == 0 for r in rows), rows
    for chain, tree in zip(rows[::2], rows[1::2]):
        assert tree["node_loop"] <= 1.3 * chain["node_loop"], (chain, tree)


# ---------------------------------------------------------------------------------------------
# Mamba2
# ---------------------------------------------------------------------------------------------


def _m2_inputs(B=3, L=6, H=4, P=8, G=2, N=16):
    return dict(
        x=torch.randn(B, L, H, P), dt=torch.randn(B, L, H), A=-torch.rand(H) - 0.5, B=torch.randn(B, L, G, N),
        C=torch.randn(B, L, G, N), D=torch.randn(H), z=torch.randn(B, L, H, P), dt_bias=torch.randn(H) * 0.1,
        dt_softplus=True, dt_min=0.0, dt_max=float("inf"), ssm_states=torch.randn(8, H, P, N) * 0.5,
        state_indices=torch.tensor([-1, 3, 6], dtype=torch.int32), disable_state_update=True,
        intermediate_states=torch.full((B, L, H, P, N), 7.0),
    )


def test_mamba2_verify_tree_matches_chain_reference_per_path():
    a = _m2_inputs()
    parents = _parents(TREES)
    got = {**a, "ssm_states": a["ssm_states"].clone(), "intermediate_states": a["intermediate_states"].clone()}
    out = ops.selective_state_update(*got.values(), False, None, None, parents)
    tri = {**a, "ssm_states": a["ssm_states"].clone(), "intermediate_states": a["intermediate_states"].clone()}
    t_out = tm2.selective_state_update_triton(*tri.values(), False, None, None, parents)

    def chain(b, xs, n):
        x, dt, B_, C_, z = xs
        y, _, st = ref_m2.selective_state_update_reference(
            x, dt, a["A"], B_, C_, a["D"], None, a["dt_bias"], True, 0.0, float("inf"), a["ssm_states"],
            a["state_indices"][b:b + 1], True, torch.zeros(1, n, *a["intermediate_states"].shape[2:]))
        return y * torch.nn.functional.silu(z), st  # (the op gates y by silu(z) after the recurrence)

    want_out, want_state = ref_tree.tree_by_paths(chain, [a["x"], a["dt"], a["B"], a["C"], a["z"]], parents)
    real = [1, 2]
    for o, d in ((out, got), (t_out, tri)):
        assert_close(o[real], want_out[real])
        assert_close(d["intermediate_states"][real], want_state[real])
        assert torch.all(o[0] == 0) and torch.all(d["intermediate_states"][0] == 7.0)
        assert torch.equal(d["ssm_states"], a["ssm_states"])


@pytest.mark.parametrize("inter_dtype", [torch.float32, torch.bfloat16])
def test_mamba2_verify_random_trees_one_program_per_path(inter_dtype):
    """The Triton Mamba2 verify walks each root-to-leaf path in its own programs (as the GDN one):
    random trees of 11 nodes, a forest and a chain, two P blocks per head (P 8 over blocks of 4:
    BLOCK_P from N 256), against the plain op; fp32 also against the chain reference per root path."""
    gen = torch.Generator().manual_seed(6)
    B, L = 4, 11
    parents = ref_tree.trees_forest_and_chain(B, gen)  # random trees, a forest, a chain
    a = _m2_inputs(B=B, L=L, N=256)
    a["state_indices"] = torch.tensor([-1, 3, 6, 0], dtype=torch.int32)
    a["intermediate_states"] = a["intermediate_states"].to(inter_dtype)
    got = {**a, "ssm_states": a["ssm_states"].clone(), "intermediate_states": a["intermediate_states"].clone()}
    out = ops.selective_state_update(*got.values(), False, None, None, parents)
    tri = {**a, "ssm_states": a["ssm_states"].clone(), "intermediate_states": a["intermediate_states"].clone()}
    t_out = tm2.selective_state_update_triton(*tri.values(), False, None, None, parents)
    if inter_dtype == torch.float32:
        assert_close(t_out, out)
        assert_close(tri["intermediate_states"], got["intermediate_states"])
    else:  # the interpreter's fp32 -> bf16 cast truncates where torch rounds, and the children compound it
        for mine, theirs in ((t_out, out), (tri["intermediate_states"], got["intermediate_states"])):
            err = (mine.float() - theirs.float()).norm() / theirs.float().norm()
            assert err < 1e-2, err
    assert torch.all(t_out[0] == 0) and torch.all(tri["intermediate_states"][0] == 7.0)
    assert torch.equal(tri["ssm_states"], a["ssm_states"])
    if inter_dtype == torch.float32:

        def chain(b, xs, n):
            x, dt, B_, C_, z = xs
            y, _, st = ref_m2.selective_state_update_reference(
                x, dt, a["A"], B_, C_, a["D"], None, a["dt_bias"], True, 0.0, float("inf"), a["ssm_states"],
                a["state_indices"][b:b + 1], True, torch.zeros(1, n, *a["intermediate_states"].shape[2:]))
            return y * torch.nn.functional.silu(z), st

        want_out, want_state = ref_tree.tree_by_paths(chain, [a["x"], a["dt"], a["B"], a["C"], a["z"]], parents)
        real = [1, 2, 3]
        assert_close(t_out[real], want_out[real])
        assert_close(tri["intermediate_states"][real], want_state[real])


# ---------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------


# (trees, prefix lengths): the fixed trees; 20-node random trees over two query blocks of the
# interpreter's 16-token tiles, prefixes across key tiles
ATTENTION_TREES = {"fixed": (TREES, [5, 0, 19]),
                   "random": (ref_tree.random_parents(4, 20, torch.Generator().manual_seed(1)).tolist(), [37, 0, 70, 3])}


@pytest.mark.parametrize("window", [-1, 1, 3, 8, 37])
@pytest.mark.parametrize("trees", list(ATTENTION_TREES))
def test_attention_tree_mask_matches_reference_over_each_path(trees, window):
    """Node t of a tree sees the cached prefix and its ancestors: the reference attention of a
    request whose new tokens are exactly its root path (a chain) gives the same output; with a
    sliding window too (the chain puts the node at the prefix length + its depth, the window's
    reference point, and its ancestors at theirs)."""
    rows, prefix = ATTENTION_TREES[trees]
    gen = torch.Generator().manual_seed(0)
    hq, hkv, d, L, B = 4, 2, 16, len(rows[0]), len(rows)
    kv_lens = [p + L for p in prefix]
    k_cache, v_cache = torch.randn(256, hkv, d, generator=gen), torch.randn(256, hkv, d, generator=gen)
    kv_indices = torch.randperm(256, generator=gen)[: sum(kv_lens)].to(torch.int32)
    kv_indptr = torch.tensor([0, *torch.tensor(kv_lens).cumsum(0).tolist()], dtype=torch.int32)
    qo = torch.arange(0, B * L + 1, L, dtype=torch.int32)
    q = torch.randn(B * L, hq, d, generator=gen)
    mask = torch.tensor([b for tree in rows for b in _bits(tree)], dtype=torch.int64)
    out, lse = ops.paged_attention_extend(q, k_cache, v_cache, qo, kv_indptr, kv_indices, d ** -0.5, True, window,
                                          0.0, None, None, mask)
    t_out, t_lse = tattn.paged_attention_extend_triton(q, k_cache, v_cache, qo, kv_indptr, kv_indices, d ** -0.5,
                                                       True, window, 0.0, None, None, mask)
    for b, tree in enumerate(rows):
        slots = kv_indices[kv_indptr[b]: kv_indptr[b + 1]]
        for t in range(L):
            path = ref_tree.root_path(tree, t)
            keys = slots[list(range(prefix[b])) + [prefix[b] + a for a in path]]
            o, l = ref_attn.paged_attention_extend_ref(
                q[b * L + t: b * L + t + 1], k_cache, v_cache, torch.tensor([0, 1]),
                torch.tensor([0, len(keys)]), keys, d ** -0.5, True, window)
            for got, got_l in ((out, lse), (t_out, t_lse)):
                assert_close(got[b * L + t], o[0])
                assert_close(got_l[b * L + t], l[0])


def test_tree_arguments_are_validated():
    x, states, weight, bias, idx, inter = _conv_inputs()
    with pytest.raises(ValueError, match="parent precedes"):
        ops.causal_conv1d_update(x, states, weight, bias, "silu", idx, True, inter, _parents([[-1, 1, 0, 0, 0, 0]] * 3))
    with pytest.raises(ValueError, match="disable_state_update"):
        ops.causal_conv1d_update(x, states, weight, bias, "silu", idx, False, inter, _parents(TREES))
    with pytest.raises(ValueError, match="intermediate buffer"):
        ops.causal_conv1d_update(x, states, weight, bias, "silu", idx, True, None, _parents(TREES))
    q = torch.randn(4, 2, 16)
    with pytest.raises(ValueError, match=r"`tree_mask` \(a draft tree\) needs causal=True"):
        ops.paged_attention_extend(q, torch.randn(8, 2, 16), torch.randn(8, 2, 16), torch.tensor([0, 4]),
                                   torch.tensor([0, 6]), torch.arange(6), 0.25, False, 3, 0.0, None, None,
                                   torch.ones(4, dtype=torch.int64))


def test_opcheck_tree_arguments():
    parents = _parents(TREES)
    x, states, weight, bias, idx, inter = _conv_inputs()
    run_opcheck(ops.causal_conv1d_update.default, (x, states, weight, bias, "silu", idx, True, inter, parents))
    q, k, v, g, beta, pool, gidx, ginter = _gdn_inputs()
    run_opcheck(ops.fused_recurrent_gated_delta_rule_update.default,
                (q, k, v, g, beta, pool, gidx, True, 0.0, True, ginter, None, None, parents))
    a = _m2_inputs()
    run_opcheck(ops.selective_state_update.default, (*a.values(), False, None, None, parents))
    mask = torch.tensor([b for tree in TREES for b in _bits(tree)], dtype=torch.int64)
    for window in (-1, 4):
        run_opcheck(ops.paged_attention_extend.default,
                    (torch.randn(18, 4, 16), torch.randn(40, 2, 16), torch.randn(40, 2, 16),
                     torch.tensor([0, 6, 12, 18], dtype=torch.int32), torch.tensor([0, 8, 14, 30], dtype=torch.int32),
                     torch.randperm(40)[:30].to(torch.int32), 0.25, True, window, 0.0, None, None, mask))


# ---------------------------------------------------------------------------------------------
# GPU: the registered CUDA ops against the plain-torch ops at model shapes
# ---------------------------------------------------------------------------------------------

DEV = "cuda"


def _both(op, args: list, mutated: list[int]):
    """The op on CPU and on CUDA from the same inputs -> (cpu out, cuda out, [(cpu, cuda) mutated])."""
    cpu = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    gpu = [a.to(DEV) if isinstance(a, torch.Tensor) else a for a in args]
    o_cpu, o_gpu = op(*cpu), op(*gpu)
    torch.cuda.synchronize()
    return o_cpu, o_gpu.cpu(), [(cpu[i], gpu[i].cpu()) for i in mutated]


@pytest.mark.gpu
def test_gpu_tree_verify_ops_match_torch_ops():
    gen = torch.Generator().manual_seed(0)
    B, L = 8, 16
    parents = ref_tree.random_parents(B, L, gen)
    idx = torch.randperm(32, generator=gen)[:B].to(torch.int32)
    idx[3] = -1
    # Qwen3-Next GDN: conv over 8192 channels (width 4), 32 value heads of 128 x 128
    x, w, bias = torch.randn(B, L, 8192), torch.randn(8192, 4) * 0.3, torch.randn(8192)
    o, og, muts = _both(ops.causal_conv1d_update, [x, torch.randn(32, 3, 8192), w, bias, "silu", idx, True,
                                                   torch.zeros(B, L, 3, 8192), parents], [7])
    assert_close(og, o)
    assert_close(muts[0][1], muts[0][0])
    q, k = torch.randn(B, L, 16, 128), torch.randn(B, L, 16, 128)
    v, g, beta = torch.randn(B, L, 32, 128), -torch.rand(B, L, 32) * 0.4, torch.rand(B, L, 32)
    o, og, muts = _both(ops.fused_recurrent_gated_delta_rule_update,
                        [q, k, v, g, beta, torch.randn(32, 32, 128, 128) * 0.3, idx, True, 0.0, True,
                         torch.zeros(B, L, 32, 128, 128), None, None, parents], [10])
    assert_close(og, o)
    assert_close(muts[0][1], muts[0][0])
    # NemotronH-like Mamba2: 128 heads of 64, 8 groups, state 128
    H, P, G, N = 128, 64, 8, 128
    o, og, muts = _both(ops.selective_state_update,
                        [torch.randn(B, L, H, P), torch.randn(B, L, H), -torch.rand(H) - 0.5, torch.randn(B, L, G, N),
                         torch.randn(B, L, G, N), torch.randn(H), torch.randn(B, L, H, P), torch.randn(H) * 0.1, True,
                         0.0, float("inf"), torch.randn(32, H, P, N) * 0.3, idx, True, torch.zeros(B, L, H, P, N),
                         False, None, None, parents], [14])
    assert_close(og, o)
    assert_close(muts[0][1], muts[0][0])
    # attention: 16 query / 2 kv heads of 256 (Qwen3-Next), prefixes of up to 3000 tokens
    prefix = torch.randint(0, 3000, (B,), generator=gen).tolist()
    kv_lens = [p + L for p in prefix]
    slots = torch.randperm(sum(kv_lens) + 100, generator=gen)[: sum(kv_lens)].to(torch.int32)
    kv_indptr = torch.tensor([0, *torch.tensor(kv_lens).cumsum(0).tolist()], dtype=torch.int32)
    mask = torch.tensor([b for row in parents.tolist() for b in _bits(row)], dtype=torch.int64)
    # (and under a sliding window: 512, each node's counted from its depth's position; 7: into the tree)
    for dtype, window in ((torch.float32, -1), (torch.bfloat16, -1), (torch.bfloat16, 512), (torch.float32, 7)):
        args = [torch.randn(B * L, 16, 256).to(dtype), torch.randn(sum(kv_lens) + 100, 2, 256).to(dtype),
                torch.randn(sum(kv_lens) + 100, 2, 256).to(dtype), torch.arange(0, B * L + 1, L, dtype=torch.int32),
                kv_indptr, slots, 256 ** -0.5, True, window, 0.0, None, None, mask]
        (o, lse), (og, lg) = ops.paged_attention_extend(*args), [
            t.cpu() for t in ops.paged_attention_extend(*[a.to(DEV) if isinstance(a, torch.Tensor) else a
                                                          for a in args])]
        assert_close(og, o, dtype)
        assert_close(lg, lse, dtype)
