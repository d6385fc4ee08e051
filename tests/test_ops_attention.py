"""Paged attention ops against the per-query reference, SDPA with an explicit mask, and
transformers' own attention functions (sdpa_attention_forward, Llama / Gemma-2 eager)."""

import types

import pytest
import torch

import hybrid_compile  # noqa: F401
from hybrid_compile.ops.reference.attention import (
    merge_attention_states_ref,
    paged_attention_decode_ref,
    paged_attention_extend_ref,
    store_kv_cache_ref,
)
from op_testing import VARLEN_CASES, assert_close, compile_and_compare, cu_seqlens_of, run_opcheck

ops = torch.ops.hybrid_compile
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
D = 16
SCALE = D**-0.5
NEG_INF = float("-inf")


# ------------------------------------------------------------------------------------------
# batch builders
# ------------------------------------------------------------------------------------------


def make_pool(num_slots, hkv, d=D, dv=D, dtype=F32):
    return torch.randn(num_slots, hkv, d).to(dtype), torch.randn(num_slots, hkv, dv).to(dtype)


def make_extend(
    q_lens,
    prefix_lens=None,
    hq=4,
    hkv=2,
    d=D,
    dv=D,
    q_dtype=F32,
    cache_dtype=F32,
    pad_rows=0,
    index_dtype=torch.int32,
    spare_slots=9,
):
    """Extend batch: request b has prefix_lens[b] cached tokens + q_lens[b] new tokens, all at random,
    non-contiguous slots of the pool (listed in position order in kv_indices)."""
    if prefix_lens is None:
        prefix_lens = [(7 * i + 3) % 12 for i in range(len(q_lens))]
    kv_lens = [p + n for p, n in zip(prefix_lens, q_lens)]
    nnz = sum(kv_lens)
    num_slots = nnz + spare_slots
    k_cache, v_cache = make_pool(num_slots, hkv, d, dv, cache_dtype)
    kv_indices = torch.randperm(num_slots)[:nnz].to(index_dtype)
    q = torch.randn(sum(q_lens) + pad_rows, hq, d).to(q_dtype)
    return dict(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        qo_indptr=cu_seqlens_of(q_lens, dtype=index_dtype),
        kv_indptr=cu_seqlens_of(kv_lens, dtype=index_dtype),
        kv_indices=kv_indices,
    )


def extend_args(b, causal=True, window=-1, softcap=0.0):
    return (b["q"], b["k_cache"], b["v_cache"], b["qo_indptr"], b["kv_indptr"], b["kv_indices"], SCALE, causal, window, softcap)


def make_decode(kv_lens, hq=4, hkv=2, d=D, dv=D, q_dtype=F32, cache_dtype=F32, index_dtype=torch.int32):
    nnz = sum(kv_lens)
    num_slots = nnz + 5
    k_cache, v_cache = make_pool(num_slots, hkv, d, dv, cache_dtype)
    return dict(
        q=torch.randn(len(kv_lens), hq, d).to(q_dtype),
        k_cache=k_cache,
        v_cache=v_cache,
        kv_indptr=cu_seqlens_of(kv_lens, dtype=index_dtype),
        kv_indices=torch.randperm(num_slots)[:nnz].to(index_dtype),
    )


def decode_args(b, window=-1, softcap=0.0):
    return (b["q"], b["k_cache"], b["v_cache"], b["kv_indptr"], b["kv_indices"], SCALE, window, softcap)


def gathered(b, req):
    """Per request: q rows [L, Hq, D], K [S, Hkv, D], V [S, Hkv, Dv] (fp32) and the kv length."""
    qo = b["qo_indptr"].tolist()
    kvp = b["kv_indptr"].tolist()
    idx = b["kv_indices"][kvp[req] : kvp[req + 1]].long()
    return (
        b["q"][qo[req] : qo[req + 1]].float(),
        b["k_cache"][idx].float(),
        b["v_cache"][idx].float(),
    )


def hf_mask(q_len, kv_len, causal=True, window=-1):
    """Boolean [q_len, kv_len] mask built with transformers.masking_utils' own mask functions."""
    from transformers import masking_utils as mu

    if window > 0:
        fn = mu.sliding_window_causal_mask_function(window) if causal else mu.sliding_window_overlay(window)
    else:
        fn = mu.causal_mask_function if causal else mu.bidirectional_mask_function
    q_idx = torch.arange(kv_len - q_len, kv_len)[:, None]  # cache positions of the new tokens
    kv_idx = torch.arange(kv_len)[None, :]
    zero = torch.zeros((), dtype=torch.long)
    return fn(zero, zero, q_idx, kv_idx).expand(q_len, kv_len)


# ------------------------------------------------------------------------------------------
# store_kv_cache
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cache_dtype,kv_dtype", [(F32, F32), (F32, BF16), (BF16, F32), (F16, BF16)])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_store_kv_cache_matches_ref(cache_dtype, kv_dtype, index_dtype):
    hkv, t, num_slots = 2, 6, 13
    k_cache, v_cache = make_pool(num_slots, hkv, D, 8, cache_dtype)
    # HF layout: key_states [1, Hkv, T, D]; the caller passes key_states[0].transpose(0, 1)
    k4 = torch.randn(1, hkv, t, D).to(kv_dtype)
    v4 = torch.randn(1, hkv, t, 8).to(kv_dtype)
    k, v = k4[0].transpose(0, 1), v4[0].transpose(0, 1)
    assert not k.is_contiguous()
    slots = torch.tensor([7, -1, 0, 12, -1, 3], dtype=index_dtype)
    want_k, want_v = store_kv_cache_ref(k_cache, v_cache, slots, k, v)
    before_k = k_cache.clone()
    ops.store_kv_cache(k_cache, v_cache, slots, k, v, k_scale=None, v_scale=None)
    # written slots hold the cast values, every other slot is bit-identical to before
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    untouched = [s for s in range(num_slots) if s not in (7, 0, 12, 3)]
    assert torch.equal(k_cache[untouched], before_k[untouched])
    assert torch.equal(k_cache[7].float(), k[0].to(cache_dtype).float())


def test_store_kv_cache_empty_and_all_padding():
    k_cache, v_cache = make_pool(4, 1)
    before = k_cache.clone(), v_cache.clone()
    ops.store_kv_cache(k_cache, v_cache, torch.zeros(0, dtype=torch.int32), torch.zeros(0, 1, D), torch.zeros(0, 1, D), k_scale=None, v_scale=None)
    ops.store_kv_cache(k_cache, v_cache, torch.tensor([-1, -1]), torch.randn(2, 1, D), torch.randn(2, 1, D), k_scale=None, v_scale=None)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


# ------------------------------------------------------------------------------------------
# extend vs reference
# ------------------------------------------------------------------------------------------

# (hq, hkv, dv, causal, sliding_window, logit_softcap)
EXTEND_CONFIGS = [
    (4, 2, D, True, -1, 0.0),
    (4, 1, 8, True, 5, 0.0),
    (2, 2, D, True, -1, 2.0),
    (2, 1, D, False, 7, 0.0),
]


@pytest.mark.parametrize("config", EXTEND_CONFIGS, ids=lambda c: "hq{}-hkv{}-dv{}-causal{}-w{}-cap{}".format(*c))
@pytest.mark.parametrize("q_dtype", [F32, BF16])
@pytest.mark.parametrize("q_lens", VARLEN_CASES, ids=str)
def test_extend_matches_ref(q_lens, q_dtype, config):
    hq, hkv, dv, causal, window, softcap = config
    b = make_extend(q_lens, hq=hq, hkv=hkv, dv=dv, q_dtype=q_dtype, pad_rows=2)
    args = extend_args(b, causal, window, softcap)
    o, lse = ops.paged_attention_extend(*args)
    ref_o, ref_lse = paged_attention_extend_ref(*args)
    assert o.dtype == q_dtype and o.shape == (sum(q_lens) + 2, hq, dv)
    assert lse.dtype == F32 and lse.shape == (sum(q_lens) + 2, hq)
    assert_close(o, ref_o, q_dtype)
    assert_close(lse, ref_lse, F32)
    # trailing padding rows (beyond qo_indptr[-1]) are zero / -inf
    assert torch.equal(o[-2:].float(), torch.zeros(2, hq, dv))
    assert bool((lse[-2:] == NEG_INF).all())
    assert torch.isfinite(o).all() and bool(torch.isfinite(lse[:-2]).all())


@pytest.mark.parametrize(
    "q_dtype,cache_dtype", [(BF16, F32), (F32, BF16), (F16, F32), (BF16, BF16)], ids=lambda d: str(d)[6:]
)
def test_extend_mixed_dtypes(q_dtype, cache_dtype):
    b = make_extend([9, 0, 20], prefix_lens=[4, 3, 0], q_dtype=q_dtype, cache_dtype=cache_dtype)
    args = extend_args(b, True, 6, 0.0)
    o, lse = ops.paged_attention_extend(*args)
    ref_o, ref_lse = paged_attention_extend_ref(*args)  # same (rounded) inputs, float64 math
    assert o.dtype == q_dtype
    assert_close(o, ref_o, q_dtype if q_dtype != F32 else cache_dtype)
    assert_close(lse, ref_lse, F32)


def test_extend_pure_prefill_and_shared_prefix():
    # pure prefill (prefix 0) for every request
    b = make_extend([5, 12, 1], prefix_lens=[0, 0, 0], index_dtype=torch.int64)
    args = extend_args(b)
    assert_close(ops.paged_attention_extend(*args)[0], paged_attention_extend_ref(*args)[0])
    # two requests sharing the same prefix slots (prefix cache hit), different new tokens
    k_cache, v_cache = make_pool(40, 2)
    prefix = [31, 2, 17, 8, 25]
    kv_indices = torch.tensor(prefix + [3, 4, 5] + prefix + [11, 39], dtype=torch.int32)
    b = dict(
        q=torch.randn(5, 4, D), k_cache=k_cache, v_cache=v_cache, qo_indptr=cu_seqlens_of([3, 2]),
        kv_indptr=cu_seqlens_of([8, 7]), kv_indices=kv_indices,
    )
    args = extend_args(b)
    o, lse = ops.paged_attention_extend(*args)
    ref_o, ref_lse = paged_attention_extend_ref(*args)
    assert_close(o, ref_o)
    assert_close(lse, ref_lse)


def test_extend_large_prefix_is_query_blocked(monkeypatch):
    """Force the query-block path (several blocks per request) and check it changes nothing."""
    import hybrid_compile.ops.attention as attn

    b = make_extend([40, 3], prefix_lens=[30, 2])
    for window in (-1, 9):
        args = extend_args(b, True, window, 0.0)
        full = ops.paged_attention_extend(*args)
        monkeypatch.setattr(attn, "_LOGITS_BUDGET", 4 * 70 * 7)  # 7 queries per block
        blocked = ops.paged_attention_extend(*args)
        monkeypatch.undo()
        assert_close(blocked[0], full[0])
        assert_close(blocked[1], full[1])
        ref = paged_attention_extend_ref(*args)
        assert_close(blocked[0], ref[0])


# ------------------------------------------------------------------------------------------
# extend: second oracles (SDPA with explicit mask, transformers)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal,window", [(True, -1), (True, 4), (False, -1), (False, 6)])
def test_extend_matches_sdpa(causal, window):
    b = make_extend([13, 1, 0, 7], prefix_lens=[6, 0, 2, 11], hq=4, hkv=2)
    o, lse = ops.paged_attention_extend(*extend_args(b, causal, window))
    qo = b["qo_indptr"].tolist()
    for req in range(4):
        q, k, v = gathered(b, req)
        if q.shape[0] == 0:
            continue
        g = q.shape[1] // k.shape[1]
        mask = hf_mask(q.shape[0], k.shape[0], causal, window)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.repeat_interleave(g, dim=1).transpose(0, 1)[None],
            v.repeat_interleave(g, dim=1).transpose(0, 1)[None],
            attn_mask=mask,
            scale=SCALE,
        )[0].transpose(0, 1)
        assert_close(o[qo[req] : qo[req + 1]], out)
        # lse against an explicit masked logsumexp
        logits = torch.einsum("lhd,shd->hls", q, k.repeat_interleave(g, dim=1)) * SCALE
        want_lse = torch.logsumexp(logits.masked_fill(~mask, NEG_INF), -1).T
        assert_close(lse[qo[req] : qo[req + 1]], want_lse)


def _hf_module(groups, head_dim=D):
    return types.SimpleNamespace(num_key_value_groups=groups, training=False, is_causal=True, head_dim=head_dim)


@pytest.mark.parametrize("q_len,prefix,window", [(9, 5, -1), (9, 5, 4), (1, 12, -1), (1, 12, 5), (6, 0, -1)])
def test_extend_matches_transformers(q_len, prefix, window):
    """One request with GQA against transformers' sdpa_attention_forward and Llama's eager attention,
    with the mask from masking_utils (causal / sliding-window causal) at the request's cache positions."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.llama.modeling_llama import eager_attention_forward

    hq, hkv = 4, 2
    b = make_extend([q_len], prefix_lens=[prefix], hq=hq, hkv=hkv)
    o, _ = ops.paged_attention_extend(*extend_args(b, True, window))
    q, k, v = gathered(b, 0)
    query, key, value = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, H, S, D]
    mask = hf_mask(q_len, prefix + q_len, True, window)[None, None]
    module = _hf_module(hq // hkv)
    out_sdpa, _ = sdpa_attention_forward(module, query, key, value, mask, dropout=0.0, scaling=SCALE, is_causal=True)
    assert_close(o, out_sdpa[0])
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(F32).min)
    out_eager, _ = eager_attention_forward(module, query, key, value, additive, scaling=SCALE)
    assert_close(o, out_eager[0])
    if q_len == 1:  # decode of the same request is the same thing
        od, _ = ops.paged_attention_decode(b["q"], b["k_cache"], b["v_cache"], b["kv_indptr"], b["kv_indices"], SCALE, window)
        assert_close(od, out_sdpa[0])


@pytest.mark.parametrize("window", [-1, 5])
def test_extend_softcap_matches_gemma2_eager(window):
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    hq, hkv, softcap = 4, 1, 1.5
    b = make_extend([10], prefix_lens=[7], hq=hq, hkv=hkv)
    o, _ = ops.paged_attention_extend(*extend_args(b, True, window, softcap))
    q, k, v = gathered(b, 0)
    mask = hf_mask(10, 17, True, window)[None, None]
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(F32).min)
    out, _ = eager_attention_forward(
        _hf_module(hq // hkv), q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], additive,
        scaling=SCALE, softcap=softcap,
    )
    assert_close(o, out[0])
    # and the cap really changes the result
    o_nocap, _ = ops.paged_attention_extend(*extend_args(b, True, window, 0.0))
    assert (o - o_nocap).abs().max() > 1e-2


# ------------------------------------------------------------------------------------------
# decode
# ------------------------------------------------------------------------------------------

DECODE_CASES = [[5], [1, 1, 1], [0, 7, 1], [64], [65, 0, 3], [130, 17, 64, 1], [0, 0]]


@pytest.mark.parametrize("window,softcap", [(-1, 0.0), (6, 0.0), (-1, 2.0), (64, 1.0)])
@pytest.mark.parametrize("q_dtype,cache_dtype", [(F32, F32), (BF16, F32), (F32, BF16)], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("kv_lens", DECODE_CASES, ids=str)
def test_decode_matches_ref(kv_lens, q_dtype, cache_dtype, window, softcap):
    hq, hkv, dv = (4, 1, 8) if window == 6 else (4, 2, D)
    b = make_decode(kv_lens, hq=hq, hkv=hkv, dv=dv, q_dtype=q_dtype, cache_dtype=cache_dtype)
    args = decode_args(b, window, softcap)
    o, lse = ops.paged_attention_decode(*args)
    ref_o, ref_lse = paged_attention_decode_ref(*args)
    assert o.dtype == q_dtype and o.shape == (len(kv_lens), hq, dv) and lse.dtype == F32
    assert_close(o, ref_o, BF16 if BF16 in (q_dtype, cache_dtype) else F32)
    assert_close(lse, ref_lse, F32)
    for r, n in enumerate(kv_lens):  # padding rows (kv_len 0): zeros and -inf, no NaN
        if n == 0:
            assert torch.equal(o[r].float(), torch.zeros(hq, dv)) and bool((lse[r] == NEG_INF).all())
    assert torch.isfinite(o).all()


def test_decode_grouping_budget(monkeypatch):
    """Tiny budget: every request is its own padded group; same result as one group."""
    import hybrid_compile.ops.attention as attn

    b = make_decode([30, 2, 0, 17, 1])
    want = ops.paged_attention_decode(*decode_args(b, 8))
    monkeypatch.setattr(attn, "_LOGITS_BUDGET", 1)
    got = ops.paged_attention_decode(*decode_args(b, 8))
    assert_close(got[0], want[0])
    assert_close(got[1], want[1])


@pytest.mark.parametrize("window,softcap", [(-1, 0.0), (5, 0.0), (-1, 3.0)])
def test_decode_equals_last_row_of_extend(window, softcap):
    b = make_extend([6, 1, 11], prefix_lens=[3, 8, 0], hq=4, hkv=2)
    o, lse = ops.paged_attention_extend(*extend_args(b, True, window, softcap))
    last = (b["qo_indptr"][1:] - 1).long()
    od, lsed = ops.paged_attention_decode(
        b["q"][last], b["k_cache"], b["v_cache"], b["kv_indptr"], b["kv_indices"], SCALE, window, softcap
    )
    torch.testing.assert_close(od, o[last], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lsed, lse[last], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------
# merge_attention_states
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_merge_matches_ref(dtype):
    t, h = 7, 3
    o_a, o_b = torch.randn(t, h, 8).to(dtype), torch.randn(t, h, 8).to(dtype)
    lse_a, lse_b = torch.randn(t, h) * 3, torch.randn(t, h) * 3
    lse_a[0, :] = NEG_INF  # one side empty
    lse_b[1, 1] = NEG_INF
    lse_a[2, 2] = lse_b[2, 2] = NEG_INF  # both empty
    lse_b[3, 0] = 80.0  # large gap
    o, lse = ops.merge_attention_states(o_a, lse_a, o_b, lse_b)
    ref_o, ref_lse = merge_attention_states_ref(o_a, lse_a, o_b, lse_b)
    assert o.dtype == dtype and lse.dtype == F32
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert_close(o, ref_o, dtype)
    assert_close(lse, ref_lse)
    assert torch.equal(o[0].float(), o_b[0].float()) and torch.equal(lse[0], lse_b[0])
    assert torch.equal(o[2, 2].float(), torch.zeros(8)) and lse[2, 2] == NEG_INF


@pytest.mark.parametrize("split", ["half", "random"])
def test_merge_of_decode_split_kv_equals_whole(split):
    """Split-KV decode: each request's kv tokens cut in two disjoint parts (possibly empty)."""
    kv_lens = [9, 1, 0, 20, 2]
    b = make_decode(kv_lens)
    whole = ops.paged_attention_decode(*decode_args(b))
    kvp = b["kv_indptr"].tolist()
    parts_a, parts_b, la, lb = [], [], [], []
    for r, n in enumerate(kv_lens):
        cut = n // 2 if split == "half" else int(torch.randint(0, n + 1, ()))
        idx = b["kv_indices"][kvp[r] : kvp[r + 1]]
        parts_a.append(idx[:cut])
        parts_b.append(idx[cut:])
        la.append(cut)
        lb.append(n - cut)
    oa, sa = ops.paged_attention_decode(b["q"], b["k_cache"], b["v_cache"], cu_seqlens_of(la), torch.cat(parts_a), SCALE)
    ob, sb = ops.paged_attention_decode(b["q"], b["k_cache"], b["v_cache"], cu_seqlens_of(lb), torch.cat(parts_b), SCALE)
    o, lse = ops.merge_attention_states(oa, sa, ob, sb)
    assert_close(o, whole[0])
    assert_close(lse, whole[1])


def test_merge_of_extend_halves_equals_whole():
    """Non-causal extend over two disjoint halves of the kv set, merged, equals the whole set."""
    q_lens, kv_lens = [4, 0, 3], [10, 4, 7]
    b = make_extend(q_lens, prefix_lens=[n - q for n, q in zip(kv_lens, q_lens)])
    whole = ops.paged_attention_extend(*extend_args(b, causal=False))
    kvp = b["kv_indptr"].tolist()
    ha, hb = [], []
    for r in range(3):
        idx = b["kv_indices"][kvp[r] : kvp[r + 1]]
        perm = idx[torch.randperm(idx.numel())]  # any disjoint split, positions do not matter here
        ha.append(perm[: idx.numel() // 2])
        hb.append(perm[idx.numel() // 2 :])
    outs = []
    for halves in (ha, hb):
        bb = dict(b, kv_indptr=cu_seqlens_of([h.numel() for h in halves]), kv_indices=torch.cat(halves))
        outs.append(ops.paged_attention_extend(*extend_args(bb, causal=False)))
    o, lse = ops.merge_attention_states(outs[0][0], outs[0][1], outs[1][0], outs[1][1])
    assert_close(o, whole[0])
    assert_close(lse, whole[1])


# ------------------------------------------------------------------------------------------
# opcheck
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pad", [False, True])
def test_opcheck_store(pad):
    k_cache, v_cache = make_pool(10, 2, D, 8)
    slots = torch.tensor([4, -1, 0, 9] if pad else [4, 1, 0, 9], dtype=torch.int64 if pad else torch.int32)
    k = torch.randn(2, 4, D).transpose(0, 1)  # non-contiguous [T, Hkv, D]
    run_opcheck(ops.store_kv_cache, (k_cache, v_cache, slots, k, torch.randn(4, 2, 8)))


@pytest.mark.parametrize(
    "q_lens,prefix,causal,window,softcap,pad_rows",
    [([5], [0], True, -1, 0.0, 0), ([0, 7, 1], [3, 0, 4], True, 3, 0.0, 2), ([1, 1], [2, 5], False, -1, 1.0, 0)],
)
def test_opcheck_extend(q_lens, prefix, causal, window, softcap, pad_rows):
    b = make_extend(q_lens, prefix_lens=prefix, hq=4, hkv=2, dv=8, pad_rows=pad_rows)
    run_opcheck(ops.paged_attention_extend, extend_args(b, causal, window, softcap))


@pytest.mark.parametrize("kv_lens,window", [([5, 0, 3], -1), ([1], 2), ([0], -1)])
def test_opcheck_decode(kv_lens, window):
    b = make_decode(kv_lens, hq=2, hkv=1, q_dtype=BF16)
    run_opcheck(ops.paged_attention_decode, decode_args(b, window, 0.0))


def test_opcheck_merge():
    lse_a = torch.randn(5, 2)
    lse_a[1] = NEG_INF
    run_opcheck(ops.merge_attention_states, (torch.randn(5, 2, 8), lse_a, torch.randn(5, 2, 8), torch.randn(5, 2)))


# ------------------------------------------------------------------------------------------
# invalid arguments
# ------------------------------------------------------------------------------------------


def test_store_invalid():
    k_cache, v_cache = make_pool(6, 2)
    k, v = torch.randn(3, 2, D), torch.randn(3, 2, D)
    slots = torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"store_kv_cache: `k` has shape"):
        ops.store_kv_cache(k_cache, v_cache, slots, torch.randn(3, 1, D), v, k_scale=None, v_scale=None)
    with pytest.raises(ValueError, match=r"store_kv_cache: `slots` must have dtype"):
        ops.store_kv_cache(k_cache, v_cache, slots.float(), k, v, k_scale=None, v_scale=None)
    with pytest.raises(IndexError, match=r"store_kv_cache: `slots` has values in \[0, 6\]"):
        ops.store_kv_cache(k_cache, v_cache, torch.tensor([0, 6, 1]), k, v, k_scale=None, v_scale=None)
    with pytest.raises(ValueError, match=r"store_kv_cache: `slots` has repeated"):
        ops.store_kv_cache(k_cache, v_cache, torch.tensor([2, 1, 2]), k, v, k_scale=None, v_scale=None)
    with pytest.raises(ValueError, match=r"store_kv_cache: `k_cache`.*must agree"):
        ops.store_kv_cache(k_cache, torch.randn(5, 2, D), slots, k, v, k_scale=None, v_scale=None)
    with pytest.raises(ValueError, match=r"store_kv_cache: `k_cache` must have dtype"):
        ops.store_kv_cache(k_cache.int(), v_cache, slots, k, v, k_scale=None, v_scale=None)


def test_extend_invalid():
    b = make_extend([3, 2], prefix_lens=[1, 0])
    good = extend_args(b)

    def call(**over):
        keys = ["q", "k_cache", "v_cache", "qo_indptr", "kv_indptr", "kv_indices", "scale", "causal", "window", "cap"]
        kw = dict(zip(keys, good))
        kw.update(over)
        return ops.paged_attention_extend(*[kw[k] for k in keys])

    call()
    with pytest.raises(ValueError, match=r"paged_attention_extend: request\(s\) \[0\] have more query tokens"):
        call(kv_indptr=torch.tensor([0, 2, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"paged_attention_extend: number of query heads 3"):
        call(q=torch.randn(5, 3, D))
    with pytest.raises(ValueError, match=r"paged_attention_extend: `q` head dim 8"):
        call(q=torch.randn(5, 4, 8))
    with pytest.raises(IndexError, match=r"paged_attention_extend: `kv_indices` has values"):
        call(kv_indices=torch.tensor([0, 1, 2, 3, 99, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"paged_attention_extend: `qo_indptr` ends at 9"):
        call(qo_indptr=torch.tensor([0, 3, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"paged_attention_extend: `qo_indptr` must be non-decreasing"):
        call(qo_indptr=torch.tensor([0, 3, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"paged_attention_extend: `kv_indptr` has shape"):
        call(kv_indptr=torch.tensor([0, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"paged_attention_extend: `kv_indptr` ends at 7"):
        call(kv_indptr=torch.tensor([0, 4, 7], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"paged_attention_extend: `qo_indptr` must have dtype"):
        call(qo_indptr=b["qo_indptr"].float())
    with pytest.raises(ValueError, match=r"paged_attention_extend: `logit_softcap`"):
        call(cap=-1.0)
    with pytest.raises(ValueError, match=r"paged_attention_extend: `k_cache`.*`v_cache`.*must agree"):
        call(v_cache=torch.randn(b["k_cache"].shape[0], 1, D))


def test_decode_and_merge_invalid():
    b = make_decode([3, 2])
    with pytest.raises(ValueError, match=r"paged_attention_decode: `kv_indptr` has shape"):
        ops.paged_attention_decode(b["q"], b["k_cache"], b["v_cache"], torch.tensor([0, 5]), b["kv_indices"], SCALE)
    with pytest.raises(IndexError, match=r"paged_attention_decode: `kv_indices` has values"):
        ops.paged_attention_decode(b["q"], b["k_cache"], b["v_cache"], b["kv_indptr"], b["kv_indices"] + 100, SCALE)
    with pytest.raises(ValueError, match=r"paged_attention_decode: `q` must have dtype"):
        ops.paged_attention_decode(b["q"].int(), b["k_cache"], b["v_cache"], b["kv_indptr"], b["kv_indices"], SCALE)
    o, lse = torch.randn(4, 2, 8), torch.randn(4, 2)
    with pytest.raises(ValueError, match=r"merge_attention_states: `o_b` has shape"):
        ops.merge_attention_states(o, lse, torch.randn(4, 2, 4), lse)
    with pytest.raises(ValueError, match=r"merge_attention_states: `lse_b` must have dtype"):
        ops.merge_attention_states(o, lse, o, lse.bfloat16())
    with pytest.raises(ValueError, match=r"merge_attention_states: `o_b` must have dtype"):
        ops.merge_attention_states(o, lse, o.bfloat16(), lse)


def test_fake_impl_validates():
    """The same checks run on fake tensors (trace time), without reading values."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, kc, vc = torch.empty(5, 3, D), torch.empty(9, 2, D), torch.empty(9, 2, 8)
        ind = torch.zeros(3, dtype=torch.int32)
        with pytest.raises(ValueError, match="number of query heads 3"):
            ops.paged_attention_extend(q, kc, vc, ind, ind, torch.zeros(5, dtype=torch.int32), SCALE)
        o, lse = ops.paged_attention_extend(torch.empty(5, 4, D, dtype=BF16), kc, vc, ind, ind, ind, SCALE)
        assert o.shape == (5, 4, 8) and o.dtype == BF16 and lse.shape == (5, 4) and lse.dtype == F32


# ------------------------------------------------------------------------------------------
# torch.compile
# ------------------------------------------------------------------------------------------


def test_compile_store_extend_decode_merge():
    hq, hkv = 4, 2
    q_lens, prefix = [5, 0, 3], [4, 2, 0]
    kv_lens = [p + n for p, n in zip(prefix, q_lens)]
    num_slots = sum(kv_lens) + 6
    k_cache, v_cache = make_pool(num_slots, hkv, D, 8, BF16)
    kv_indices = torch.randperm(num_slots)[: sum(kv_lens)].to(torch.int32)
    # slots of the new tokens: the last q_len entries of each request's kv list
    kvp = cu_seqlens_of(kv_lens).tolist()
    new_slots = torch.cat([kv_indices[kvp[r + 1] - q_lens[r] : kvp[r + 1]] for r in range(3)])
    new_slots = torch.cat([new_slots, torch.tensor([-1], dtype=torch.int32)])  # one padding token
    t = new_slots.numel()
    q = torch.randn(t, hq, D)
    k = torch.randn(1, hkv, t, D)
    v = torch.randn(t, hkv, 8)
    qo_indptr, kv_indptr = cu_seqlens_of(q_lens), cu_seqlens_of(kv_lens)

    def fn(k_cache, v_cache, q, k, v, new_slots, qo_indptr, kv_indptr, kv_indices):
        ops.store_kv_cache(k_cache, v_cache, new_slots, k[0].transpose(0, 1), v, k_scale=None, v_scale=None)
        o, lse = ops.paged_attention_extend(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, SCALE, True, 4, 0.0)
        od, lsed = ops.paged_attention_decode(q[:3], k_cache, v_cache, kv_indptr, kv_indices, SCALE, -1, 1.5)
        om, lsem = ops.merge_attention_states(o[:3], lse[:3], od, lsed)
        return o * 2, lse, om, lsem

    args = (k_cache, v_cache, q, k, v, new_slots, qo_indptr, kv_indptr, kv_indices)
    eager, compiled, eager_args, compiled_args = compile_and_compare(fn, *args)
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e)
    assert torch.equal(eager_args[0], compiled_args[0]) and torch.equal(eager_args[1], compiled_args[1])
    # the store happened before the extend read the pool: compare with the reference
    want_k, want_v = store_kv_cache_ref(k_cache, v_cache, new_slots, k[0].transpose(0, 1), v)
    assert torch.equal(eager_args[0], want_k) and torch.equal(eager_args[1], want_v)
    ref_o, _ = paged_attention_extend_ref(q, want_k, want_v, qo_indptr, kv_indptr, kv_indices, SCALE, True, 4, 0.0)
    assert_close(eager[0], ref_o * 2)
