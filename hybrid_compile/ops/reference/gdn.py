"""Per-token reference of the Gated DeltaNet ops (``hybrid_compile/ops/gdn.py``).

The literal recurrence of transformers' ``torch_recurrent_gated_delta_rule`` (qwen3_next), one
request and one token at a time, in fp32. Per value head ``h`` (q/k head ``h // (Hv // Hk)``)::

    S = S * exp(g_t);  delta = (v_t - k_t^T S) * beta_t;  S = S + k_t delta^T;  o_t = q_t^T S

``g_t`` is one log-decay per head (Gated DeltaNet) or one per head and key channel (Kimi Delta
Attention, transformers' ``recurrent_kimi_delta_attention``: row ``k`` of ``S [K, V]`` decays by
``exp(g_t[k])``).

Functions take the op's arguments and return new tensors (pools are cloned, never mutated).
"""

from __future__ import annotations

import math

import torch


def gating_ref(A_log, a, b, dt_bias, softplus_beta=1.0, softplus_threshold=20.0):
    """(g, beta), fp32, elementwise: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)."""
    x = a.float() + dt_bias.float()
    bx = softplus_beta * x
    sp = torch.where(bx > softplus_threshold, x, torch.log1p(torch.exp(bx)) / softplus_beta)
    g = -torch.exp(A_log.float()) * sp
    beta = 1.0 / (1.0 + torch.exp(-b.float()))
    return g, beta


def _qk_token(x, num_v_heads, use_qk_l2norm):
    """[Hk, K] -> [Hv, K] fp32, optionally L2-normalised (eps 1e-6 inside the sqrt)."""
    x = x.float()
    if use_qk_l2norm:
        x = x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)
    rep = num_v_heads // x.shape[0]
    return torch.stack([x[h // rep] for h in range(num_v_heads)])


def delta_rule_ref(q, k, v, g, beta, initial_state, use_qk_l2norm, scale):
    """One request. q, k [L, Hk, K]; v [L, Hv, V]; g [L, Hv] or [L, Hv, K]; beta [L, Hv];
    initial_state [Hv, K, V] or None.

    Returns (o [L, Hv, V] fp32, states [L + 1, Hv, K, V] fp32) with states[t] the state after t tokens.
    """
    L, hv, vd = v.shape
    kd = q.shape[-1]
    scale = scale if scale > 0 else kd ** -0.5
    S = torch.zeros(hv, kd, vd) if initial_state is None else initial_state.float().clone()
    states = [S.clone()]
    outs = []
    for t in range(L):
        q_t = _qk_token(q[t], hv, use_qk_l2norm) * scale
        k_t = _qk_token(k[t], hv, use_qk_l2norm)
        v_t = v[t].float()
        o_t = torch.empty(hv, vd)
        for h in range(hv):
            if g.dim() == 2:
                S[h] = S[h] * math.exp(float(g[t, h]))
            else:
                S[h] = S[h] * torch.exp(g[t, h].float())[:, None]  # per key channel (row of S)
            kv_mem = k_t[h] @ S[h]
            delta = (v_t[h] - kv_mem) * float(beta[t, h])
            S[h] = S[h] + torch.outer(k_t[h], delta)
            o_t[h] = q_t[h] @ S[h]
        outs.append(o_t)
        states.append(S.clone())
    o = torch.stack(outs) if outs else torch.zeros(0, hv, vd)
    return o, torch.stack(states)


def chunk_gated_delta_rule_ref(
    q, k, v, g, beta, ssm_states, cu_seqlens, state_indices, has_initial_state,
    use_qk_l2norm, scale, output_chunk_states, chunk_size=64,
):
    """Reference of ``chunk_gated_delta_rule``: returns (o in v.dtype, new ssm_states, chunk_states)."""
    T, hv, vd = v.shape
    kd = q.shape[-1]
    cu = [int(x) for x in cu_seqlens.tolist()]
    slots = [int(x) for x in state_indices.tolist()]
    batch = len(slots)
    new_states = ssm_states.clone()
    o = torch.zeros(T, hv, vd)
    rows = T // chunk_size + batch if output_chunk_states else 0
    chunk_states = torch.zeros(rows, hv, kd, vd)
    row = 0
    for i in range(batch):
        s, e = cu[i], cu[i + 1]
        n_chunks = -(-(e - s) // chunk_size)
        if slots[i] >= 0 and e > s:
            init = ssm_states[slots[i]] if bool(has_initial_state[i]) else None
            o_i, states = delta_rule_ref(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], init, use_qk_l2norm, scale)
            o[s:e] = o_i
            new_states[slots[i]] = states[-1].to(ssm_states.dtype)
            if output_chunk_states:
                for j in range(n_chunks):
                    chunk_states[row + j] = states[j * chunk_size]
        row += n_chunks
    return o.to(v.dtype), new_states, chunk_states


def fused_sigmoid_gating_delta_rule_update_ref(
    A_log, dt_bias, q, k, v, a, b, ssm_states, state_indices, use_qk_l2norm, scale,
    softplus_beta=1.0, softplus_threshold=20.0,
):
    """Reference of the decode op: returns (o [B, Hv, V] in v.dtype, new ssm_states)."""
    bs, hv, vd = v.shape
    new_states = ssm_states.clone()
    o = torch.zeros(bs, hv, vd)
    for i in range(bs):
        slot = int(state_indices[i])
        if slot < 0:
            continue
        g, beta = gating_ref(A_log, a[i : i + 1], b[i : i + 1], dt_bias, softplus_beta, softplus_threshold)
        o_i, states = delta_rule_ref(q[i : i + 1], k[i : i + 1], v[i : i + 1], g, beta, ssm_states[slot], use_qk_l2norm, scale)
        o[i] = o_i[0]
        new_states[slot] = states[-1].to(ssm_states.dtype)
    return o.to(v.dtype), new_states


def fused_recurrent_gated_delta_rule_update_ref(
    q, k, v, g, beta, ssm_states, state_indices, use_qk_l2norm, scale, disable_state_update,
    intermediate_states,
):
    """Reference of the verify op: returns (o [B, L, Hv, V] in v.dtype, new ssm_states,
    new intermediate_states or None)."""
    bs, L, hv, vd = v.shape
    new_states = ssm_states.clone()
    new_inter = None if intermediate_states is None else intermediate_states.clone()
    o = torch.zeros(bs, L, hv, vd)
    for i in range(bs):
        slot = int(state_indices[i])
        if slot < 0:
            continue
        o_i, states = delta_rule_ref(q[i], k[i], v[i], g[i], beta[i], ssm_states[slot], use_qk_l2norm, scale)
        o[i] = o_i
        if not disable_state_update:
            new_states[slot] = states[-1].to(ssm_states.dtype)
        if new_inter is not None:
            for t in range(L):
                new_inter[i, t] = states[t + 1].to(new_inter.dtype)
    return o.to(v.dtype), new_states, new_inter
