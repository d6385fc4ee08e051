"""Triton paged-attention kernels against the plain-torch ops and the per-query reference.

CPU: the launchers run in Triton's interpreter (conftest sets TRITON_INTERPRET=1) on tiny shapes.
GPU (``@pytest.mark.gpu``): the registered CUDA ops at realistic shapes against the plain-torch
ops on CPU copies, opcheck on CUDA, and CUDA-graph capture/replay of decode (and extend).
"""

import pytest
import torch

import hybrid_compile  # noqa: F401
import hybrid_compile.ops.attention as attn
from hybrid_compile.ops.reference.attention import (
    merge_attention_states_ref,
    paged_attention_decode_ref,
    paged_attention_extend_ref,
    store_kv_cache_ref,
)
from hybrid_compile.ops.triton import attention as tri
from op_testing import assert_close, cu_seqlens_of

# CPU tests here call the launchers on CPU tensors under Triton's interpreter (see conftest).
INTERPRETER_ONLY = True

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
NEG_INF = float("-inf")
D = 16


# ------------------------------------------------------------------------------------------
# batch builders (token-level pool, random non-contiguous slots)
# ------------------------------------------------------------------------------------------


def _pool(num_slots, hkv, d, dv, dtype, device="cpu"):
    return (
        torch.randn(num_slots, hkv, d, device=device).to(dtype),
        torch.randn(num_slots, hkv, dv, device=device).to(dtype),
    )


def extend_batch(q_lens, prefix_lens=None, hq=4, hkv=2, d=D, dv=D, q_dtype=F32, cache_dtype=F32, pad_rows=0,
                 index_dtype=torch.int32, device="cpu"):
    if prefix_lens is None:
        prefix_lens = [(5 * i + 2) % 11 for i in range(len(q_lens))]
    kv_lens = [p + n for p, n in zip(prefix_lens, q_lens)]
    nnz = sum(kv_lens)
    num_slots = nnz + 7
    k_cache, v_cache = _pool(num_slots, hkv, d, dv, cache_dtype, device)
    return dict(
        q=torch.randn(sum(q_lens) + pad_rows, hq, d, device=device).to(q_dtype),
        k_cache=k_cache,
        v_cache=v_cache,
        qo_indptr=cu_seqlens_of(q_lens, device=device, dtype=index_dtype),
        kv_indptr=cu_seqlens_of(kv_lens, device=device, dtype=index_dtype),
        # spare entries past kv_indptr[-1] must be ignored
        kv_indices=torch.cat([torch.randperm(num_slots)[:nnz], torch.tensor([num_slots + 100])]).to(index_dtype).to(device),
    )


def decode_batch(kv_lens, hq=4, hkv=2, d=D, dv=D, q_dtype=F32, cache_dtype=F32, index_dtype=torch.int32, device="cpu"):
    nnz = sum(kv_lens)
    num_slots = nnz + 5
    k_cache, v_cache = _pool(num_slots, hkv, d, dv, cache_dtype, device)
    return dict(
        q=torch.randn(len(kv_lens), hq, d, device=device).to(q_dtype),
        k_cache=k_cache,
        v_cache=v_cache,
        kv_indptr=cu_seqlens_of(kv_lens, device=device, dtype=index_dtype),
        kv_indices=torch.randperm(num_slots)[:nnz].to(index_dtype).to(device),
    )


def ext_args(b, causal=True, window=-1, softcap=0.0, scale=None):
    scale = b["q"].shape[-1] ** -0.5 if scale is None else scale
    return (b["q"], b["k_cache"], b["v_cache"], b["qo_indptr"], b["kv_indptr"], b["kv_indices"], scale, causal, window,
            softcap)


def dec_args(b, window=-1, softcap=0.0, scale=None):
    scale = b["q"].shape[-1] ** -0.5 if scale is None else scale
    return (b["q"], b["k_cache"], b["v_cache"], b["kv_indptr"], b["kv_indices"], scale, window, softcap)


def _tol_dtype(*dtypes):
    return BF16 if BF16 in dtypes else (F16 if F16 in dtypes else F32)


def _check_extend_result(o, lse, args, n_rows, tol):
    """Against the plain-torch op and the float64 reference; rows >= n_rows are padding."""
    q = args[0]
    t, hq = q.shape[:2]
    dv = args[2].shape[2]
    assert o.dtype == q.dtype and o.shape == (t, hq, dv) and lse.dtype == F32 and lse.shape == (t, hq)
    op_o, op_lse = attn.paged_attention_extend(*args)
    ref_o, ref_lse = paged_attention_extend_ref(*args)
    assert_close(o, op_o, tol)
    assert_close(o, ref_o, tol)
    assert_close(lse, op_lse)
    assert_close(lse, ref_lse)
    assert torch.equal(o[n_rows:].float(), torch.zeros(t - n_rows, hq, dv))
    assert bool((lse[n_rows:] == NEG_INF).all())
    assert bool(torch.isfinite(lse[:n_rows]).all()) and bool(torch.isfinite(o).all())


# ------------------------------------------------------------------------------------------
# store_kv_cache
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cache_dtype,kv_dtype", [(F32, F32), (F32, BF16), (BF16, F32), (BF16, BF16), (F16, BF16)])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_store_matches_ref(cache_dtype, kv_dtype, index_dtype):
    hkv, t, num_slots = 3, 7, 15
    k_cache, v_cache = _pool(num_slots, hkv, 24, 8, cache_dtype)  # D=24, Dv=8: padded blocks
    k = torch.randn(1, hkv, t, 24).to(kv_dtype)[0].transpose(0, 1)  # HF layout view [T, Hkv, D]
    v = torch.randn(t, hkv, 8).to(kv_dtype)
    assert not k.is_contiguous()
    slots = torch.tensor([7, -1, 0, 14, -1, 3, 9], dtype=index_dtype)
    want_k, want_v = store_kv_cache_ref(k_cache, v_cache, slots, k, v)
    op_k, op_v = k_cache.clone(), v_cache.clone()
    attn.store_kv_cache(op_k, op_v, slots, k, v, k_scale=None, v_scale=None)
    before = k_cache.clone(), v_cache.clone()
    tri.store_kv_cache_triton(k_cache, v_cache, slots, k, v)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert torch.equal(k_cache, op_k) and torch.equal(v_cache, op_v)
    untouched = [s for s in range(num_slots) if s not in (7, 0, 14, 3, 9)]
    assert torch.equal(k_cache[untouched], before[0][untouched])
    assert torch.equal(v_cache[untouched], before[1][untouched])
    assert not torch.equal(k_cache[7], before[0][7])


@pytest.mark.parametrize("src_dtype", [F32, F16])
def test_store_rounds_to_bf16_like_torch(src_dtype):
    """Ties (round half to even), the mantissa carry, overflow to inf, inf, nan, subnormals."""
    eps = 2.0**-8  # half a bf16 ulp at 1.0
    vals = [1 + eps, 1 + 3 * eps, -(1 + eps), 2 - eps, 1.5 + eps / 2, 3.0e38, float("inf"), float("nan"),
            1.0e-39, -2.5e-40, 0.0, -0.0, 65504.0, 0.1]
    if src_dtype == F16:
        vals = [v for v in vals if abs(v) <= 65504.0 or v != v]
    src = torch.tensor(vals + [0.0] * (16 - len(vals)), dtype=F32).to(src_dtype).view(1, 1, 16).expand(2, 1, 16)
    k_cache, v_cache = torch.zeros(3, 1, 16, dtype=BF16), torch.zeros(3, 1, 16, dtype=BF16)
    tri.store_kv_cache_triton(k_cache, v_cache, torch.tensor([2, 0]), src, src)
    want = src[0, 0].to(BF16)
    nan = torch.isnan(want)  # NaN bit patterns differ between torch paths: compare NaN-ness only
    for got in (k_cache[2, 0], v_cache[0, 0]):
        assert torch.equal(torch.isnan(got), nan)
        assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))
    assert torch.equal(k_cache[1], torch.zeros(1, 16, dtype=BF16))


def test_store_empty_and_all_padding():
    k_cache, v_cache = _pool(4, 2, D, D, F32)
    before = k_cache.clone(), v_cache.clone()
    tri.store_kv_cache_triton(k_cache, v_cache, torch.zeros(0, dtype=torch.int32), torch.zeros(0, 2, D), torch.zeros(0, 2, D))
    tri.store_kv_cache_triton(k_cache, v_cache, torch.tensor([-1, -1]), torch.randn(2, 2, D), torch.randn(2, 2, D))
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


# ------------------------------------------------------------------------------------------
# paged_attention_extend
# ------------------------------------------------------------------------------------------

# (q_lens, hq, hkv, dv, causal, window, softcap, q_dtype, cache_dtype)
EXTEND_CASES = [
    ([5], 4, 2, D, True, -1, 0.0, F32, F32),
    ([1, 1, 1], 4, 1, 8, True, 5, 0.0, BF16, F32),
    ([0, 7, 1], 2, 2, D, True, -1, 2.0, F32, BF16),
    ([64], 4, 2, D, False, -1, 0.0, F32, F32),
    ([65, 0, 3], 2, 1, D, False, 7, 0.0, BF16, BF16),
    ([65, 0, 3], 4, 2, D, True, -1, 0.0, F32, BF16),
    ([130, 17, 64, 1], 4, 2, D, True, 9, 1.0, F32, F32),
    ([130, 17, 64, 1], 2, 1, 8, True, -1, 0.0, BF16, BF16),
    ([0, 7, 1], 4, 2, D, True, 4, 0.0, F16, F16),  # 16-bit tensor-core dots (fp16: bf16 dots are
    ([65, 0, 3], 4, 1, D, False, -1, 2.0, F16, F16),  # broken in the interpreter)
]


@pytest.mark.parametrize("case", EXTEND_CASES, ids=lambda c: "{}-hq{}-hkv{}-dv{}-c{}-w{}-cap{}-{}-{}".format(
    *c[:7], str(c[7])[6:], str(c[8])[6:]))
def test_extend_matches_op_and_ref(case):
    q_lens, hq, hkv, dv, causal, window, softcap, q_dtype, cache_dtype = case
    b = extend_batch(q_lens, hq=hq, hkv=hkv, dv=dv, q_dtype=q_dtype, cache_dtype=cache_dtype, pad_rows=2)
    args = ext_args(b, causal, window, softcap)
    o, lse = tri.paged_attention_extend_triton(*args)
    _check_extend_result(o, lse, args, sum(q_lens), _tol_dtype(q_dtype, cache_dtype))


@pytest.mark.parametrize("block_m,block_n", [(32, 16), (16, 32)])
@pytest.mark.parametrize("causal,window", [(True, -1), (True, 6), (False, 20)])
def test_extend_block_shapes(block_m, block_n, causal, window):
    """Other block sizes: request->block mapping, interior/edge split of the kv loop."""
    # prefixes 14 / 30 put a block's causal edge one key before a BLOCK_N boundary
    # q_len 18 / 2: a last block of 2 rows (edge of the window's unmasked range)
    q_lens, prefix = [40, 0, 2, 18, 33], [14, 4, 0, 30, 9]
    b = extend_batch(q_lens, prefix, hq=2, hkv=1, pad_rows=37)  # padding spans several blocks
    args = ext_args(b, causal, window)
    o, lse = tri.paged_attention_extend_triton(*args, config=dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4))
    _check_extend_result(o, lse, args, sum(q_lens), F32)


@pytest.mark.parametrize("cache_dtype,d,dv", [(F32, 256, 256), (BF16, 192, 128)])
def test_extend_gpu_tile_of_fp32_dots_at_head_dim_256(cache_dtype, d, dv):
    """The tile the launcher picks on a GPU for fp32 dots at head dim 256 (an fp32 cache; an fp32 query
    over a bf16 cache at 192 / 128, held in 256-wide blocks), run here in the interpreter: query
    blocks of 32 over key blocks of 64, across a causal edge, a window and a 70-token prefix."""
    import types

    on_gpu = types.SimpleNamespace(device=torch.device("cuda"), dtype=F32)
    kv = torch.empty(1, 1, d, dtype=cache_dtype)
    cfg = tri._extend_config(on_gpu, kv, kv, d, dv)
    assert (cfg["BLOCK_M"], cfg["BLOCK_N"]) == (32, 64), cfg
    b = extend_batch([40, 3], [70, 0], hq=2, hkv=1, d=d, dv=dv, q_dtype=F32, cache_dtype=cache_dtype, pad_rows=1)
    for causal, window in [(True, -1), (True, 50)]:
        args = ext_args(b, causal, window)
        o, lse = tri.paged_attention_extend_triton(*args, config=cfg)
        _check_extend_result(o, lse, args, 43, _tol_dtype(F32, cache_dtype))


def test_extend_odd_head_dims_noncontiguous_q():
    """D=24 (padded to 32), Dv=8 (padded to 16), GQA group 3, q a strided view of a fused projection."""
    q_lens, prefix, hq, hkv, d = [20, 1, 0, 6], [3, 12, 5, 0], 6, 2, 24
    b = extend_batch(q_lens, prefix, hq=hq, hkv=hkv, d=d, dv=8, pad_rows=1)
    qkv = torch.randn(b["q"].shape[0], (hq + 2 * hkv) * d)
    b["q"] = qkv[:, : hq * d].view(-1, hq, d)
    assert not b["q"].is_contiguous()
    for causal, window, softcap in [(True, -1, 0.0), (False, 4, 1.5)]:
        args = ext_args(b, causal, window, softcap, scale=0.3)
        o, lse = tri.paged_attention_extend_triton(*args)
        _check_extend_result(o, lse, args, sum(q_lens), F32)


def test_extend_shared_prefix_int64():
    k_cache, v_cache = _pool(40, 2, D, D, BF16)
    prefix = [31, 2, 17, 8, 25]
    b = dict(
        q=torch.randn(5, 4, D).to(BF16), k_cache=k_cache, v_cache=v_cache,
        qo_indptr=cu_seqlens_of([3, 2], dtype=torch.int64), kv_indptr=cu_seqlens_of([8, 7], dtype=torch.int64),
        kv_indices=torch.tensor(prefix + [3, 4, 5] + prefix + [11, 39], dtype=torch.int64),
    )
    args = ext_args(b)
    o, lse = tri.paged_attention_extend_triton(*args)
    _check_extend_result(o, lse, args, 5, BF16)


def test_extend_only_padding_rows():
    b = extend_batch([0, 0], [3, 0], pad_rows=5)
    o, lse = tri.paged_attention_extend_triton(*ext_args(b))
    assert torch.equal(o, torch.zeros(5, 4, D)) and bool((lse == NEG_INF).all())
    b = extend_batch([], [], pad_rows=3)  # no request at all
    o, lse = tri.paged_attention_extend_triton(*ext_args(b))
    assert torch.equal(o, torch.zeros(3, 4, D)) and bool((lse == NEG_INF).all())


def test_extend_softcap_changes_result():
    b = extend_batch([9], [4], hq=2, hkv=1)
    o_cap, _ = tri.paged_attention_extend_triton(*ext_args(b, True, -1, 0.5))
    o_nocap, _ = tri.paged_attention_extend_triton(*ext_args(b, True, -1, 0.0))
    assert (o_cap - o_nocap).abs().max() > 1e-2


# ------------------------------------------------------------------------------------------
# paged_attention_decode
# ------------------------------------------------------------------------------------------

# (kv_lens, hq, hkv, dv, window, softcap, q_dtype, cache_dtype, num_splits)
DECODE_CASES = [
    ([5], 4, 2, D, -1, 0.0, F32, F32, 1),
    ([0, 7, 1], 4, 1, 8, 6, 0.0, BF16, F32, 3),
    ([65, 0, 3], 4, 2, D, -1, 2.0, F32, BF16, 2),
    ([130, 17, 64, 1], 4, 2, D, 64, 1.0, F32, F32, 1),
    ([130, 17, 64, 1], 2, 1, D, -1, 0.0, BF16, BF16, 4),
    ([0, 0], 4, 2, D, -1, 0.0, F32, F32, 3),
    ([1, 1, 1], 6, 2, D, 1, 0.0, F32, F32, 2),
    ([65, 0, 3], 4, 2, D, -1, 0.0, F16, F16, 2),
    ([130, 17, 64, 1], 4, 1, 8, 20, 1.0, F16, F16, 1),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: "{}-hq{}-hkv{}-dv{}-w{}-cap{}-{}-{}-s{}".format(
    *c[:6], str(c[6])[6:], str(c[7])[6:], c[8]))
def test_decode_matches_op_and_ref(case):
    kv_lens, hq, hkv, dv, window, softcap, q_dtype, cache_dtype, splits = case
    b = decode_batch(kv_lens, hq=hq, hkv=hkv, dv=dv, q_dtype=q_dtype, cache_dtype=cache_dtype)
    args = dec_args(b, window, softcap)
    o, lse = tri.paged_attention_decode_triton(*args, num_splits=splits)
    assert o.dtype == q_dtype and o.shape == (len(kv_lens), hq, dv) and lse.dtype == F32
    tol = _tol_dtype(q_dtype, cache_dtype)
    op_o, op_lse = attn.paged_attention_decode(*args)
    ref_o, ref_lse = paged_attention_decode_ref(*args)
    assert_close(o, op_o, tol)
    assert_close(o, ref_o, tol)
    assert_close(lse, op_lse)
    assert_close(lse, ref_lse)
    for r, n in enumerate(kv_lens):  # padding rows: zeros and -inf, no NaN
        if n == 0:
            assert torch.equal(o[r].float(), torch.zeros(hq, dv)) and bool((lse[r] == NEG_INF).all())
        else:
            assert bool(torch.isfinite(lse[r]).all())
    assert torch.isfinite(o).all()


def test_decode_split_counts_agree():
    """1 split (direct write), a few, and more splits than a request has kv blocks."""
    b = decode_batch([40, 0, 3, 33], hq=2, hkv=1)
    args = dec_args(b, 35, 0.0)
    ref_o, ref_lse = paged_attention_decode_ref(*args)
    for splits in (1, 3, 16):
        o, lse = tri.paged_attention_decode_triton(*args, num_splits=splits, config=dict(BLOCK_G=16, BLOCK_N=16))
        assert_close(o, ref_o)
        assert_close(lse, ref_lse)
    # the default (shape-derived) split count
    o, lse = tri.paged_attention_decode_triton(*args)
    assert_close(o, ref_o)
    assert_close(lse, ref_lse)


def test_decode_large_group_several_head_blocks():
    """GQA group 20 > BLOCK_G=16: two head blocks per kv head, the second partly masked; D=24."""
    b = decode_batch([9, 0, 23], hq=40, hkv=2, d=24, dv=8)
    args = dec_args(b)
    o, lse = tri.paged_attention_decode_triton(*args, num_splits=2, config=dict(BLOCK_G=16, BLOCK_N=16))
    ref_o, ref_lse = paged_attention_decode_ref(*args)
    assert_close(o, ref_o)
    assert_close(lse, ref_lse)


@pytest.mark.parametrize("window,softcap", [(-1, 0.0), (5, 3.0)])
def test_decode_equals_last_row_of_extend(window, softcap):
    b = extend_batch([6, 1, 11], [3, 8, 20], hq=4, hkv=2)
    o, lse = tri.paged_attention_extend_triton(*ext_args(b, True, window, softcap))
    last = (b["qo_indptr"][1:] - 1).long()
    od, lsed = tri.paged_attention_decode_triton(
        b["q"][last], b["k_cache"], b["v_cache"], b["kv_indptr"], b["kv_indices"], D**-0.5, window, softcap,
        num_splits=2,
    )
    torch.testing.assert_close(od, o[last], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lsed, lse[last], atol=1e-5, rtol=1e-5)


def test_launchers_read_no_tensor_values_on_host(monkeypatch):
    """CUDA-graph safety proxy on CPU: extend and decode never pull a tensor value to the host
    (grid and buffers come from shapes; per-request bounds are read inside the kernels)."""
    e = extend_batch([5, 0, 20], pad_rows=2)
    d = decode_batch([5, 0, 20])
    want_e = tri.paged_attention_extend_triton(*ext_args(e))
    want_d = tri.paged_attention_decode_triton(*dec_args(d), num_splits=2)

    def host_sync(*args, **kwargs):
        raise AssertionError("host read of a tensor value")

    for name in ("item", "tolist", "__bool__", "__int__", "__index__", "__float__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, host_sync)
    got_e = tri.paged_attention_extend_triton(*ext_args(e))
    got_d = tri.paged_attention_decode_triton(*dec_args(d), num_splits=2)
    monkeypatch.undo()
    for got, want in ((got_e, want_e), (got_d, want_d)):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ------------------------------------------------------------------------------------------
# merge_attention_states
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_merge_matches_ref(dtype):
    t, h, dv = 7, 3, 24
    o_a = torch.randn(t, h, dv).to(dtype)
    o_b = torch.randn(h, t, dv).to(dtype).transpose(0, 1)  # non-contiguous view
    lse_a, lse_b = torch.randn(t, h) * 3, torch.randn(t, h) * 3
    lse_a[0, :] = NEG_INF  # one side empty
    lse_b[1, 1] = NEG_INF
    lse_a[2, 2] = lse_b[2, 2] = NEG_INF  # both empty
    lse_b[3, 0] = 80.0  # large gap
    o, lse = tri.merge_attention_states_triton(o_a, lse_a, o_b, lse_b)
    ref_o, ref_lse = merge_attention_states_ref(o_a, lse_a, o_b, lse_b)
    op_o, op_lse = attn.merge_attention_states(o_a, lse_a, o_b, lse_b)
    assert o.dtype == dtype and lse.dtype == F32
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert_close(o, ref_o, dtype)
    assert_close(o, op_o, dtype)
    assert_close(lse, ref_lse)
    assert_close(lse, op_lse)
    assert torch.equal(o[0].float(), o_b[0].float()) and torch.equal(lse[0], lse_b[0])
    assert torch.equal(o[2, 2].float(), torch.zeros(dv)) and lse[2, 2] == NEG_INF


def test_merge_of_split_decodes_equals_whole():
    kv_lens = [9, 1, 0, 20]
    b = decode_batch(kv_lens)
    whole = tri.paged_attention_decode_triton(*dec_args(b), num_splits=1)
    kvp = b["kv_indptr"].tolist()
    pa, pb, la, lb = [], [], [], []
    for r, n in enumerate(kv_lens):
        idx = b["kv_indices"][kvp[r] : kvp[r + 1]]
        cut = n // 3
        pa.append(idx[:cut])
        pb.append(idx[cut:])
        la.append(cut)
        lb.append(n - cut)
    sa = tri.paged_attention_decode_triton(b["q"], b["k_cache"], b["v_cache"], cu_seqlens_of(la), torch.cat(pa), D**-0.5)
    sb = tri.paged_attention_decode_triton(b["q"], b["k_cache"], b["v_cache"], cu_seqlens_of(lb), torch.cat(pb), D**-0.5)
    o, lse = tri.merge_attention_states_triton(sa[0], sa[1], sb[0], sb[1])
    assert_close(o, whole[0])
    assert_close(lse, whole[1])


# ------------------------------------------------------------------------------------------
# GPU: the registered CUDA ops (run by the lead on the H100)
# ------------------------------------------------------------------------------------------

ops = torch.ops.hybrid_compile
CUDA = "cuda"


def _cpu(args):
    return tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)


# (hq, hkv, d, dv, q_dtype, cache_dtype)
GPU_HEADS = [
    pytest.param((16, 2, 256, 256, BF16, BF16), marks=pytest.mark.smoke),  # Qwen3-Next full attention
    (32, 8, 128, 128, BF16, BF16),
    (8, 1, 80, 80, F16, F16),
    (12, 4, 96, 96, BF16, F32),
    (16, 2, 192, 128, F32, BF16),
    (4, 4, 64, 64, F32, F32),
    (32, 1, 128, 128, BF16, BF16),  # decode BLOCK_G 32
]


# an fp32 cache at head dim 256: the extend tile that fits shared memory (its kernel build took ~130 s of
# an H100 host per case with the spilling 64 x 64 tile used until 2026-11-29; extend runs it in one case,
# decode in all).
FP32_HEAD_256 = (16, 2, 256, 256, F32, F32)
def _head_id(h) -> str:
    return "hq{}-hkv{}-d{}-dv{}-{}-{}".format(*h[:4], str(h[4])[6:], str(h[5])[6:])


_HEAD_IDS = dict(ids=_head_id)


def _extend_case(h, causal, window, softcap):
    heads, marks = (h.values[0], h.marks) if hasattr(h, "values") else (h, ())
    return pytest.param(heads, causal, window, softcap, marks=marks,
                        id=f"{causal}-{window}-{softcap}-{_head_id(heads)}")


@pytest.mark.gpu
@pytest.mark.parametrize("heads,causal,window,softcap", [
    _extend_case(h, *case)
    for h in GPU_HEADS for case in [(True, -1, 0.0), (True, 300, 0.0), (True, -1, 30.0), (False, -1, 0.0)]
] + [_extend_case(FP32_HEAD_256, True, 300, 0.0)])
def test_gpu_extend_realistic(heads, causal, window, softcap):
    hq, hkv, d, dv, q_dtype, cache_dtype = heads
    q_lens, prefix = [700, 1, 37, 0, 129, 513], [300, 1500, 0, 5, 64, 0]
    b = extend_batch(q_lens, prefix, hq=hq, hkv=hkv, d=d, dv=dv, q_dtype=q_dtype, cache_dtype=cache_dtype,
                     pad_rows=5, device=CUDA)
    args = ext_args(b, causal, window, softcap)
    o, lse = ops.paged_attention_extend(*args)
    want_o, want_lse = attn.paged_attention_extend(*_cpu(args))
    n = sum(q_lens)
    assert_close(o.cpu(), want_o, _tol_dtype(q_dtype, cache_dtype))
    assert_close(lse.cpu()[:n], want_lse[:n], F32 if q_dtype == cache_dtype == F32 else F16)
    assert bool((lse[n:] == NEG_INF).all()) and bool((o[n:] == 0).all())


@pytest.mark.gpu
@pytest.mark.parametrize("heads", GPU_HEADS + [FP32_HEAD_256], **_HEAD_IDS)
@pytest.mark.parametrize("window,softcap", [(-1, 0.0), (1000, 0.0), (-1, 30.0)])
@pytest.mark.parametrize("batch", [3, 64])
def test_gpu_decode_realistic(heads, window, softcap, batch):
    hq, hkv, d, dv, q_dtype, cache_dtype = heads
    g = torch.Generator().manual_seed(batch)
    kv_lens = torch.randint(1, 5000, (batch,), generator=g).tolist()
    kv_lens[1] = 0  # CUDA-graph padding row
    b = decode_batch(kv_lens, hq=hq, hkv=hkv, d=d, dv=dv, q_dtype=q_dtype, cache_dtype=cache_dtype, device=CUDA)
    args = dec_args(b, window, softcap)
    o, lse = ops.paged_attention_decode(*args)
    want_o, want_lse = attn.paged_attention_decode(*_cpu(args))
    assert_close(o.cpu(), want_o, _tol_dtype(q_dtype, cache_dtype))
    assert_close(lse.cpu(), want_lse, F32 if q_dtype == cache_dtype == F32 else F16)
    assert bool((o[1] == 0).all()) and bool((lse[1] == NEG_INF).all())


@pytest.mark.gpu
@pytest.mark.smoke
@pytest.mark.parametrize("cache_dtype", [BF16, F32])
def test_gpu_store_realistic(cache_dtype):
    hkv, d, t, num_slots = 2, 256, 3000, 10000
    k_cache, v_cache = _pool(num_slots, hkv, d, d, cache_dtype, CUDA)
    qkv = torch.randn(t, (16 + 2 * hkv) * d, device=CUDA, dtype=BF16)
    k = qkv[:, 16 * d : (16 + hkv) * d].view(t, hkv, d)  # non-contiguous views of a fused projection
    v = qkv[:, (16 + hkv) * d :].view(t, hkv, d)
    slots = torch.randperm(num_slots, device=CUDA)[:t]
    slots[::7] = -1
    want_k, want_v = k_cache.cpu(), v_cache.cpu()
    attn.store_kv_cache(want_k, want_v, slots.cpu(), k.cpu(), v.cpu(), k_scale=None, v_scale=None)
    ops.store_kv_cache(k_cache, v_cache, slots, k, v, k_scale=None, v_scale=None)
    assert torch.equal(k_cache.cpu(), want_k) and torch.equal(v_cache.cpu(), want_v)


@pytest.mark.gpu
@pytest.mark.smoke
def test_gpu_merge_realistic():
    t, h, dv = 4096, 16, 256
    o_a, o_b = torch.randn(t, h, dv, device=CUDA, dtype=BF16), torch.randn(t, h, dv, device=CUDA, dtype=BF16)
    lse_a, lse_b = torch.randn(t, h, device=CUDA) * 5, torch.randn(t, h, device=CUDA) * 5
    lse_a[::5] = NEG_INF
    lse_b[::3] = NEG_INF
    o, lse = ops.merge_attention_states(o_a, lse_a, o_b, lse_b)
    want_o, want_lse = attn.merge_attention_states(o_a.cpu(), lse_a.cpu(), o_b.cpu(), lse_b.cpu())
    assert_close(o.cpu(), want_o, BF16)
    torch.testing.assert_close(lse.cpu(), want_lse)
    assert not torch.isnan(o).any()


@pytest.mark.gpu
@pytest.mark.smoke
def test_gpu_opcheck():
    b = extend_batch([5, 0, 17], [3, 2, 0], hq=4, hkv=2, d=64, dv=64, q_dtype=BF16, cache_dtype=BF16, pad_rows=2,
                     device=CUDA)
    torch.library.opcheck(ops.paged_attention_extend, ext_args(b, True, 4, 0.0))
    d = decode_batch([5, 0, 33], hq=4, hkv=2, d=64, dv=64, q_dtype=BF16, cache_dtype=BF16, device=CUDA)
    torch.library.opcheck(ops.paged_attention_decode, dec_args(d, -1, 1.0))
    k_cache, v_cache = _pool(10, 2, 64, 64, BF16, CUDA)
    slots = torch.tensor([4, -1, 0, 9], device=CUDA)
    torch.library.opcheck(
        ops.store_kv_cache, (k_cache, v_cache, slots, torch.randn(4, 2, 64, device=CUDA), torch.randn(4, 2, 64, device=CUDA), None,
                                None)
    )
    lse_a = torch.randn(5, 2, device=CUDA)
    lse_a[1] = NEG_INF
    torch.library.opcheck(
        ops.merge_attention_states,
        (torch.randn(5, 2, 64, device=CUDA), lse_a, torch.randn(5, 2, 64, device=CUDA), torch.randn(5, 2, device=CUDA)),
    )


@pytest.mark.gpu
@pytest.mark.smoke
@pytest.mark.parametrize("window", [-1, 256])
def test_gpu_decode_cuda_graph_replay(window):
    """Capture decode once with static buffers, replay with new lengths/slots (padding rows included)."""
    hq, hkv, d, bsz, max_tokens, num_slots = 16, 2, 256, 8, 20000, 30000
    k_cache, v_cache = _pool(num_slots, hkv, d, d, BF16, CUDA)
    q = torch.zeros(bsz, hq, d, device=CUDA, dtype=BF16)
    kv_indptr = torch.zeros(bsz + 1, device=CUDA, dtype=torch.int32)
    kv_indices = torch.zeros(max_tokens, device=CUDA, dtype=torch.int32)

    def fill(lens):
        q.copy_(torch.randn(bsz, hq, d, device=CUDA, dtype=BF16))
        kv_indptr.copy_(cu_seqlens_of(lens, device=CUDA))
        kv_indices.copy_(torch.randint(0, num_slots, (max_tokens,), device=CUDA, dtype=torch.int32))

    def step():
        return ops.paged_attention_decode(q, k_cache, v_cache, kv_indptr, kv_indices, d**-0.5, window, 0.0)

    fill([10] * bsz)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up: compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_o, out_lse = step()
    for lens in ([3000, 1, 0, 77, 2500, 0, 64, 5], [0] * bsz, [2400] * bsz):
        fill(lens)
        graph.replay()
        torch.cuda.synchronize()
        want_o, want_lse = attn.paged_attention_decode(
            q.cpu(), k_cache.cpu(), v_cache.cpu(), kv_indptr.cpu(), kv_indices.cpu(), d**-0.5, window, 0.0
        )
        assert_close(out_o.cpu(), want_o, BF16)
        assert_close(out_lse.cpu(), want_lse, F16)
        for r, n in enumerate(lens):
            if n == 0:
                assert bool((out_o[r] == 0).all()) and bool((out_lse[r] == NEG_INF).all())


@pytest.mark.gpu
@pytest.mark.smoke
def test_gpu_extend_cuda_graph_replay():
    """The extend launcher reads nothing to the host either: capture it and replay new batches."""
    hq, hkv, d, t, nb, max_tokens, num_slots = 16, 2, 128, 64, 4, 4096, 8192
    k_cache, v_cache = _pool(num_slots, hkv, d, d, BF16, CUDA)
    q = torch.zeros(t, hq, d, device=CUDA, dtype=BF16)
    qo = torch.zeros(nb + 1, device=CUDA, dtype=torch.int32)
    kvp = torch.zeros(nb + 1, device=CUDA, dtype=torch.int32)
    kvi = torch.zeros(max_tokens, device=CUDA, dtype=torch.int32)

    def fill(q_lens, prefix):
        q.copy_(torch.randn(t, hq, d, device=CUDA, dtype=BF16))
        qo.copy_(cu_seqlens_of(q_lens, device=CUDA))
        kvp.copy_(cu_seqlens_of([a + b for a, b in zip(q_lens, prefix)], device=CUDA))
        kvi.copy_(torch.randperm(num_slots, device=CUDA)[:max_tokens].to(torch.int32))

    def step():
        return ops.paged_attention_extend(q, k_cache, v_cache, qo, kvp, kvi, d**-0.5, True, -1, 0.0)

    fill([4, 4, 4, 4], [0, 0, 0, 0])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_o, out_lse = step()
    for q_lens, prefix in (([40, 0, 1, 20], [900, 3, 0, 17]), ([0, 0, 0, 7], [0, 0, 0, 1000])):
        fill(q_lens, prefix)
        graph.replay()
        torch.cuda.synchronize()
        want_o, want_lse = attn.paged_attention_extend(
            q.cpu(), k_cache.cpu(), v_cache.cpu(), qo.cpu(), kvp.cpu(), kvi.cpu(), d**-0.5, True, -1, 0.0
        )
        assert_close(out_o.cpu(), want_o, BF16)
        assert_close(out_lse.cpu(), want_lse, F16)


_SM90_BUILD = r'''
import json, types
import torch
from benchmarks.kda_intra_build import build_kernel
from hybrid_compile.ops.triton import attention as tri

# the launcher's tile for fp32 dots at head dim 256: an fp32 cache (d 256 / 256), an fp32 query over a
# bf16 cache (d 192 / 128, BLOCK_D 256) (q only says "on a GPU" and its dtype)
q = types.SimpleNamespace(device=torch.device("cuda"), dtype=torch.float32)
kernel = tri._extend_kernel
for cache, d, dv in ((torch.float32, 256, 256), (torch.bfloat16, 192, 128)):
    kv = torch.empty(1, 2, d, dtype=cache)
    cfg = tri._extend_config(q, kv, kv, d, dv)
    qk_f32, pv_f32 = tri._dot_modes(q, kv, kv)
    const = dict(GROUP=8, HEAD_D=d, HEAD_DV=dv, BLOCK_D=256, BLOCK_DV=dv, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                 CAUSAL=True, USE_WINDOW=True, USE_SOFTCAP=False, QK_F32=qk_f32, PV_F32=pv_f32, KV_FP8=False,
                 USE_TREE=False, HEAD_DPE=0, BLOCK_DPE=16)
    kv_ptr = "*fp32" if cache == torch.float32 else "*bf16"
    pointers = dict(Q="*fp32", K=kv_ptr, V=kv_ptr, O="*fp32", LSE="*fp32", QO="*i32", KVP="*i32", KVI="*i32",
                    KS="*fp32", VS="*fp32", TREE="*i32", qk_mult="fp32", cap_mult="fp32")
    sig = {n: "constexpr" if n in const else pointers.get(n, "i32") for n in kernel.arg_names}
    stats = build_kernel(kernel, sig, const, cfg["num_warps"], stages=cfg["num_stages"])
    print(json.dumps(dict(cache=str(cache), d=d, cfg=cfg, **stats)))
'''


def test_fp32_head_256_extend_tile_builds_for_sm90_without_spilling(tmp_path):
    """The extend tile of fp32 dots at head dim 256 (an fp32 cache; an fp32 query over a bf16 cache at
    head dims 192 / 128), compiled for sm_90 by Triton's bundled ptxas (no GPU needed; outside the
    interpreter, in a subprocess: ``benchmarks/kda_intra_build.build_kernel``): it fits the H100's
    shared memory and keeps its fp32 query and accumulator in registers (the 64 x 64 / 4-warp tile of
    the fp32 cache spilled 238 KB a thread, the 16-bit tile with an fp32 query 31.5 KB; both took
    40-70 s to build)."""
    from sm90_builds import build_stats

    rows = build_stats(_SM90_BUILD, tmp_path)
    assert [(r["cache"], r["d"]) for r in rows] == [("torch.float32", 256), ("torch.bfloat16", 192)], rows
    for out in rows:
        assert out["shared"] <= 232448, out  # the H100's shared memory per block
        # (spill stores, bytes a thread: 352 / 0 at the tile chosen)
        assert out["spill_stores"] is not None and out["spill_stores"] <= 2048, out
