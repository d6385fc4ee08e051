"""Reference paged attention: one request, one query, one head at a time, explicit softmax.

Attention is not recurrent; the reference is the literal definition: gather the request's
K/V from the pool by ``kv_indices``, compute the visible logits of one query and one head,
softmax them by hand (in float64) and sum the values. Masking as in transformers'
``masking_utils`` (``kv <= q`` when causal, ``kv > q - sliding_window`` with a window).
Shares no code with ``hybrid_compile.ops.attention``.
"""

from __future__ import annotations

import math

import torch


def store_kv_cache_ref(k_cache, v_cache, slots, k, v):
    """Return new (k_cache, v_cache) with token t written at slots[t] (slot -1 skipped)."""
    k_cache = k_cache.clone()
    v_cache = v_cache.clone()
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        k_cache[s] = k[t].to(k_cache.dtype)
        v_cache[s] = v[t].to(v_cache.dtype)
    return k_cache, v_cache


def _one_query(q_h, keys, values, q_pos, scale, causal, sliding_window, logit_softcap):
    """One query and one head: q_h [D] float64, keys [S, D], values [S, Dv] float64 of the request's
    kv positions 0..S-1. Returns the output [Dv] float64 and the lse (a float)."""
    dots = (keys @ q_h).tolist()
    logits = []
    rows = []
    for k_pos in range(keys.shape[0]):
        if causal and k_pos > q_pos:
            continue
        if sliding_window > 0 and k_pos <= q_pos - sliding_window:
            continue
        x = dots[k_pos] * scale
        if logit_softcap > 0:
            x = logit_softcap * math.tanh(x / logit_softcap)
        logits.append(x)
        rows.append(k_pos)
    if not logits:
        return torch.zeros(values.shape[1], dtype=torch.float64), float("-inf")
    m = max(logits)
    weights = [math.exp(x - m) for x in logits]
    denom = sum(weights)
    probs = torch.tensor([w / denom for w in weights], dtype=torch.float64)
    out = probs @ values[rows]
    return out, m + math.log(denom)


def _gather(pool, slots, head):
    """[S, D] float64: the pool rows of the given slots, one kv head."""
    if not slots:
        return torch.zeros(0, pool.shape[2], dtype=torch.float64)
    return torch.stack([pool[s, head].double() for s in slots])


def paged_attention_extend_ref(
    q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, scale, causal=True, sliding_window=-1, logit_softcap=0.0
):
    """Returns (o [T, Hq, Dv] fp32, lse [T, Hq] fp32); rows past qo_indptr[-1] are 0 / -inf."""
    t, hq, _ = q.shape
    hkv, dv = k_cache.shape[1], v_cache.shape[2]
    group = hq // hkv
    o = torch.zeros(t, hq, dv, dtype=torch.float32)
    lse = torch.full((t, hq), float("-inf"), dtype=torch.float32)
    qo = qo_indptr.tolist()
    kvp = kv_indptr.tolist()
    for b in range(len(qo) - 1):
        q_len = qo[b + 1] - qo[b]
        slots = kv_indices[kvp[b] : kvp[b + 1]].tolist()
        kv_len = len(slots)
        assert kv_len >= q_len, "reference: kv_len < q_len"
        keys = [_gather(k_cache, slots, kvh) for kvh in range(hkv)]
        values = [_gather(v_cache, slots, kvh) for kvh in range(hkv)]
        for j in range(q_len):
            row = qo[b] + j
            q_pos = kv_len - q_len + j
            for h in range(hq):
                kvh = h // group
                out, l = _one_query(
                    q[row, h].double(), keys[kvh], values[kvh], q_pos, scale, causal, sliding_window, logit_softcap
                )
                o[row, h] = out.float()
                lse[row, h] = l
    return o, lse


def paged_attention_decode_ref(q, k_cache, v_cache, kv_indptr, kv_indices, scale, sliding_window=-1, logit_softcap=0.0):
    """Returns (o [B, Hq, Dv] fp32, lse [B, Hq] fp32); a request with kv_len 0 gives 0 / -inf."""
    bsz, hq, _ = q.shape
    hkv, dv = k_cache.shape[1], v_cache.shape[2]
    group = hq // hkv
    o = torch.zeros(bsz, hq, dv, dtype=torch.float32)
    lse = torch.full((bsz, hq), float("-inf"), dtype=torch.float32)
    kvp = kv_indptr.tolist()
    for b in range(bsz):
        slots = kv_indices[kvp[b] : kvp[b + 1]].tolist()
        if not slots:
            continue
        q_pos = len(slots) - 1
        for h in range(hq):
            kvh = h // group
            out, l = _one_query(
                q[b, h].double(), _gather(k_cache, slots, kvh), _gather(v_cache, slots, kvh), q_pos, scale, True,
                sliding_window, logit_softcap,
            )
            o[b, h] = out.float()
            lse[b, h] = l
    return o, lse


def merge_attention_states_ref(o_a, lse_a, o_b, lse_b):
    """Per row and head: weights exp(lse_x) normalised; returns (o fp32, lse fp32)."""
    t, h, dv = o_a.shape
    o = torch.zeros(t, h, dv, dtype=torch.float32)
    lse = torch.full((t, h), float("-inf"), dtype=torch.float32)
    for i in range(t):
        for j in range(h):
            la, lb = float(lse_a[i, j]), float(lse_b[i, j])
            if la == float("-inf") and lb == float("-inf"):
                continue
            m = max(la, lb)
            wa, wb = math.exp(la - m), math.exp(lb - m)
            o[i, j] = ((wa * o_a[i, j].double() + wb * o_b[i, j].double()) / (wa + wb)).float()
            lse[i, j] = m + math.log(wa + wb)
    return o, lse
