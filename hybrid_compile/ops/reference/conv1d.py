"""Per-token reference of the causal conv1d ops: one request, one token at a time.

The conv window is kept explicitly as a list of the ``W-1`` most recent inputs (fp32,
oldest first). Each new token is appended, the output is the dot product of the ``W``
inputs (window ++ token) with the weight, then the oldest input is dropped. Pools are not
mutated: every function returns new tensors.
"""

from __future__ import annotations

import torch


def _act(v: torch.Tensor, activation) -> torch.Tensor:
    name = "none" if activation is None else activation.lower()
    if name in ("silu", "swish"):
        return v / (1.0 + torch.exp(-v))
    if name in ("none", "identity", ""):
        return v
    raise ValueError(f"unknown activation {activation!r}")


def _step(window: list, token: torch.Tensor, weight: torch.Tensor, bias, activation):
    """Consume one token: returns (output, new window)."""
    inputs = window + [token]  # W inputs, oldest first
    acc = torch.zeros_like(token) if bias is None else bias.float().clone()
    for w in range(len(inputs)):
        acc = acc + weight[:, w].float() * inputs[w]
    return _act(acc, activation), inputs[1:]


def _window_of(conv_states, slot, use: bool, k: int, dim: int) -> list:
    if use:
        return [conv_states[slot, j].float() for j in range(k)]
    return [torch.zeros(dim) for _ in range(k)]


def causal_conv1d_fn_ref(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, activation):
    """Returns (out [T, D] in x's dtype, new conv_states)."""
    num_tokens, dim = x.shape
    k = weight.shape[1] - 1
    out = torch.zeros(num_tokens, dim)
    states = conv_states.clone()
    qsl = [int(v) for v in query_start_loc]
    for b in range(len(qsl) - 1):
        slot = int(cache_indices[b])
        if slot < 0:
            continue
        window = _window_of(conv_states, slot, bool(has_initial_state[b]), k, dim)
        for t in range(qsl[b], qsl[b + 1]):
            out[t], window = _step(window, x[t].float(), weight, bias, activation)
        if qsl[b + 1] > qsl[b]:
            for j in range(k):
                states[slot, j] = window[j].to(states.dtype)
    return out.to(x.dtype), states


def causal_conv1d_update_ref(
    x, conv_states, weight, bias, activation, conv_state_indices, disable_state_update=False,
    intermediate_conv_windows=None,
):
    """Returns (out [B, L, D], new conv_states, new intermediate_conv_windows or None)."""
    batch, steps, dim = x.shape
    k = weight.shape[1] - 1
    out = torch.zeros(batch, steps, dim)
    states = conv_states.clone()
    inter = None if intermediate_conv_windows is None else intermediate_conv_windows.clone()
    for b in range(batch):
        slot = int(conv_state_indices[b])
        if slot < 0:
            continue
        window = _window_of(conv_states, slot, True, k, dim)
        for t in range(steps):
            out[b, t], window = _step(window, x[b, t].float(), weight, bias, activation)
            if inter is not None:
                for j in range(k):
                    inter[b, t, j] = window[j].to(inter.dtype)
        if not disable_state_update:
            for j in range(k):
                states[slot, j] = window[j].to(states.dtype)
    return out.to(x.dtype), states, inter


def track_conv_window_ref(conv_states, x, query_start_loc, cache_indices, has_initial_state, track_lens, dst_slots):
    """Returns the new conv_states after checkpointing each request's window at track_lens[b]."""
    dim = x.shape[1]
    k = conv_states.shape[1]
    states = conv_states.clone()
    for b in range(cache_indices.shape[0]):
        slot, n, dst = int(cache_indices[b]), int(track_lens[b]), int(dst_slots[b])
        if slot < 0 or n < 0 or dst < 0:
            continue
        start = int(query_start_loc[b])
        assert n <= int(query_start_loc[b + 1]) - start, "track_lens beyond the request"
        window = _window_of(conv_states, slot, bool(has_initial_state[b]), k, dim)
        for t in range(start, start + n):
            window = window[1:] + [x[t].float()]
        for j in range(k):
            states[dst, j] = window[j].to(states.dtype)
    return states


def conv1d_hf_equivalent(x_bdl, weight, bias, activation):
    """HF's prefill math without a cache: nn.Conv1d(groups=D, padding=W-1) over [B, D, L], then act.

    ``x_bdl`` [B, D, L]; returns [B, D, L] fp32. Used as an oracle independent of the pools.
    """
    dim, width = weight.shape
    y = torch.nn.functional.conv1d(
        x_bdl.float(), weight.float()[:, None, :], None if bias is None else bias.float(),
        padding=width - 1, groups=dim,
    )[..., : x_bdl.shape[-1]]
    return _act(y, activation)


__all__ = [
    "causal_conv1d_fn_ref",
    "causal_conv1d_update_ref",
    "track_conv_window_ref",
    "conv1d_hf_equivalent",
]
