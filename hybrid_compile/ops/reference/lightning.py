"""Per-token reference of the lightning attention ops (``hybrid_compile/ops/lightning.py``).

The literal recurrence of transformers' ``MiniMaxLightningAttention`` decode loop, one request,
one head and one token at a time, in fp32::

    S = exp(-slope_h) * S + k_t v_t^T;  o_t = q_t^T S

Functions take the op's arguments and return new tensors (pools are cloned, never mutated).
"""

from __future__ import annotations

import math

import torch


def lightning_ref(q, k, v, slope, initial_state):
    """One request. q, k [L, H, K]; v [L, H, V]; slope [H]; initial_state [H, K, V] or None.

    Returns (o [L, H, V] fp32, states [L + 1, H, K, V] fp32) with states[t] the state after t tokens.
    """
    L, h, vd = v.shape
    kd = q.shape[-1]
    S = torch.zeros(h, kd, vd) if initial_state is None else initial_state.float().clone()
    states = [S.clone()]
    o = torch.zeros(L, h, vd)
    for t in range(L):
        for hh in range(h):
            S[hh] = math.exp(-float(slope[hh])) * S[hh] + torch.outer(k[t, hh].float(), v[t, hh].float())
            o[t, hh] = q[t, hh].float() @ S[hh]
        states.append(S.clone())
    return o, torch.stack(states)


def chunk_lightning_attention_ref(q, k, v, slope, ssm_states, cu_seqlens, state_indices, has_initial_state,
                                  output_chunk_states, chunk_size=64):
    """Reference of ``chunk_lightning_attention``: returns (o in v.dtype, new ssm_states, chunk_states)."""
    T, h, vd = v.shape
    kd = q.shape[-1]
    cu = [int(x) for x in cu_seqlens.tolist()]
    slots = [int(x) for x in state_indices.tolist()]
    new_states = ssm_states.clone()
    o = torch.zeros(T, h, vd)
    chunk_states = torch.zeros(T // chunk_size + len(slots) if output_chunk_states else 0, h, kd, vd)
    row = 0
    for i, slot in enumerate(slots):
        s, e = cu[i], cu[i + 1]
        n_chunks = -(-(e - s) // chunk_size)
        if slot >= 0 and e > s:
            init = ssm_states[slot] if bool(has_initial_state[i]) else None
            o[s:e], states = lightning_ref(q[s:e], k[s:e], v[s:e], slope, init)
            new_states[slot] = states[-1].to(ssm_states.dtype)
            if output_chunk_states:
                for j in range(n_chunks):
                    chunk_states[row + j] = states[j * chunk_size]
        row += n_chunks
    return o.to(v.dtype), new_states, chunk_states


def recurrent_lightning_attention_update_ref(q, k, v, slope, ssm_states, state_indices, disable_state_update,
                                             intermediate_states):
    """Reference of ``recurrent_lightning_attention_update``: returns (o [B, L, H, V] in v.dtype,
    new ssm_states, new intermediate_states or None)."""
    bs, L, h, vd = v.shape
    new_states = ssm_states.clone()
    new_inter = None if intermediate_states is None else intermediate_states.clone()
    o = torch.zeros(bs, L, h, vd)
    for i in range(bs):
        slot = int(state_indices[i])
        if slot < 0:
            continue
        o[i], states = lightning_ref(q[i], k[i], v[i], slope, ssm_states[slot])
        if not disable_state_update:
            new_states[slot] = states[-1].to(ssm_states.dtype)
        if new_inter is not None:
            new_inter[i, :L] = states[1:].to(new_inter.dtype)
    return o.to(v.dtype), new_states, new_inter
