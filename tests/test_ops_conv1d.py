"""Causal conv1d ops (prefill / decode+verify / window tracking) against the per-token
reference, HF's own conv math, and each other (chaining, prefill+decode, verify windows)."""

import inspect

import pytest
import torch

import hybrid_compile  # noqa: F401
from hybrid_compile.ops.reference.conv1d import (
    causal_conv1d_fn_ref,
    causal_conv1d_update_ref,
    conv1d_hf_equivalent,
    track_conv_window_ref,
)
from op_testing import VARLEN_CASES, assert_close, compile_and_compare, cu_seqlens_of, distinct_slots, run_opcheck

ops = torch.ops.hybrid_compile
NUM_SLOTS = 16


def _x(rows, dim, dtype=torch.float32):
    """Non-contiguous [rows, dim] view (a column slice of a wider tensor, like q/k/v split from one projection)."""
    wide = torch.randn(rows, dim + 5).to(dtype)
    return wide[:, 2 : 2 + dim]


def _params(dim, width, dtype=torch.float32, bias=True):
    weight = (torch.randn(dim, width) * 0.5).to(dtype)
    b = (torch.randn(dim) * 0.1).to(dtype) if bias else None
    return weight, b


def _batch(lens, dim, width, dtype=torch.float32, pool_dtype=torch.float32, pad_rows=(), idx_dtype=torch.int32):
    batch = len(lens)
    x = _x(sum(lens), dim, dtype)
    states = torch.randn(NUM_SLOTS, width - 1, dim).to(pool_dtype)
    qsl = cu_seqlens_of(lens, dtype=idx_dtype)
    idx = distinct_slots(batch, NUM_SLOTS, pad_rows=pad_rows).to(idx_dtype)
    has_init = torch.tensor([b % 2 == 0 for b in range(batch)], dtype=torch.bool)
    return x, states, qsl, idx, has_init


def _pad_rows(lens):
    return (1,) if len(lens) >= 3 else ()


def _untouched(num_slots, *written):
    mask = torch.ones(num_slots, dtype=torch.bool)
    for s in written:
        if s >= 0:
            mask[s] = False
    return mask


# --------------------------------------------------------------------------------------------
# causal_conv1d_fn
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [8, 24])
@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("lens", VARLEN_CASES)
def test_fn_matches_reference(lens, width, dim, dtype):
    weight, bias = _params(dim, width, dtype)
    x, states, qsl, idx, has_init = _batch(lens, dim, width, dtype, pad_rows=_pad_rows(lens))
    before = states.clone()
    want_out, want_states = causal_conv1d_fn_ref(x, weight, bias, states, qsl, idx, has_init, "silu")
    out = ops.causal_conv1d_fn(x, weight, bias, states, qsl, idx, has_init, "silu")
    assert out.dtype == dtype and out.shape == x.shape
    assert_close(out, want_out, dtype)
    assert torch.equal(states, want_states)  # windows hold raw inputs: exact
    written = [int(s) for s, n in zip(idx, lens) if n > 0]
    keep = _untouched(NUM_SLOTS, *written)
    assert torch.equal(states[keep], before[keep])
    # padded requests: zero outputs
    for b in range(len(lens)):
        if idx[b] < 0:
            assert torch.count_nonzero(out[qsl[b] : qsl[b + 1]]) == 0
    # a request longer than the window really wrote its last W-1 inputs
    for b, n in enumerate(lens):
        if idx[b] >= 0 and n >= width - 1:
            assert torch.equal(states[idx[b]], x[qsl[b + 1] - (width - 1) : qsl[b + 1]].float())


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float16])
def test_fn_low_precision_pool(pool_dtype):
    lens, dim, width = [6, 1, 0, 2], 8, 4
    weight, bias = _params(dim, width)
    x, states, qsl, idx, has_init = _batch(lens, dim, width, pool_dtype=pool_dtype)
    has_init = torch.tensor([True, True, False, True])
    want_out, want_states = causal_conv1d_fn_ref(x, weight, bias, states, qsl, idx, has_init, "silu")
    out = ops.causal_conv1d_fn(x, weight, bias, states, qsl, idx, has_init, "silu")
    assert states.dtype == pool_dtype
    assert_close(out, want_out)
    assert torch.equal(states, want_states)


def test_fn_short_request_keeps_shifted_window():
    dim, width = 8, 4
    weight, bias = _params(dim, width)
    states = torch.randn(3, width - 1, dim)
    old = states[2].clone()
    x = torch.randn(1, dim)
    ops.causal_conv1d_fn(x, weight, bias, states, cu_seqlens_of([1]), torch.tensor([2]), torch.tensor([True]), "silu")
    assert torch.equal(states[2, :2], old[1:]) and torch.equal(states[2, 2], x[0])
    # without an initial state the old content is ignored: zeros shifted in
    states[1] = torch.randn(width - 1, dim)
    ops.causal_conv1d_fn(x, weight, None, states, cu_seqlens_of([1]), torch.tensor([1]), torch.tensor([False]), None)
    assert torch.count_nonzero(states[1, :2]) == 0 and torch.equal(states[1, 2], x[0])


def test_fn_zero_length_request_leaves_state():
    dim, width = 8, 4
    weight, bias = _params(dim, width)
    states = torch.randn(4, width - 1, dim)
    before = states.clone()
    x = torch.randn(3, dim)
    ops.causal_conv1d_fn(
        x, weight, bias, states, cu_seqlens_of([0, 3, 0]), torch.tensor([0, 1, 2]),
        torch.tensor([False, True, False]), "silu",
    )
    assert torch.equal(states[0], before[0]) and torch.equal(states[2], before[2])  # not zeroed
    assert not torch.equal(states[1], before[1])


def test_fn_nan_in_padded_slot_does_not_leak():
    dim, width = 8, 4
    weight, bias = _params(dim, width)
    states = torch.full((3, width - 1, dim), float("nan"))
    x = torch.randn(5, dim)
    out = ops.causal_conv1d_fn(
        x, weight, bias, states, cu_seqlens_of([2, 3]), torch.tensor([-1, 1]), torch.tensor([True, False]), "silu"
    )
    assert torch.count_nonzero(out[:2]) == 0 and torch.isfinite(out).all()


@pytest.mark.parametrize("activation", ["silu", "swish", "SiLU", None, "none", "identity"])
def test_fn_activation_names(activation):
    dim, width = 8, 4
    weight, bias = _params(dim, width)
    x, states, qsl, idx, has_init = _batch([5, 3], dim, width)
    out = ops.causal_conv1d_fn(x, weight, bias, states.clone(), qsl, idx, has_init, activation)
    lin = ops.causal_conv1d_fn(x, weight, bias, states.clone(), qsl, idx, has_init, None)
    if activation is not None and activation.lower() in ("silu", "swish"):
        assert_close(out, torch.nn.functional.silu(lin))
        assert not torch.allclose(out, lin)
    else:
        assert torch.equal(out, lin)


# --------------------------------------------------------------------------------------------
# HF oracle
# --------------------------------------------------------------------------------------------


def _hf_fallbacks(module_name):
    """The torch fallbacks of HF's causal_conv1d_fn/update (unwrapped from the hub-kernel decorator)."""
    import importlib

    mod = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    fn = getattr(mod, "causal_conv1d_fn", None)
    upd = getattr(mod, "causal_conv1d_update", None)
    if fn is None or upd is None:
        pytest.skip(f"{module_name} has no module-level causal_conv1d fallbacks")
    return inspect.unwrap(fn), inspect.unwrap(upd)


@pytest.mark.parametrize("module_name", ["qwen3_next", "mamba2"])
@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("dim", [8, 24])
@pytest.mark.parametrize("width", [2, 4])
def test_fn_and_update_match_hf(width, dim, activation, module_name):
    hf_fn, hf_update = _hf_fallbacks(module_name)
    length = 11
    conv = torch.nn.Conv1d(dim, dim, width, groups=dim, padding=width - 1, bias=module_name == "mamba2")
    weight, bias = conv.weight.detach().squeeze(1), None if conv.bias is None else conv.bias.detach()
    x = _x(length, dim)
    x_bdl = x.t()[None]  # HF layout [1, D, L]
    states = torch.randn(4, width - 1, dim)
    out = ops.causal_conv1d_fn(
        x, weight, bias, states, cu_seqlens_of([length]), torch.tensor([3]), torch.tensor([False]), activation
    )
    # the nn.Conv1d module itself, HF's fallback, and the F.conv1d oracle
    with torch.no_grad():
        module_out = conv(x_bdl)[..., :length]
    if activation == "silu":
        module_out = torch.nn.functional.silu(module_out)
    assert_close(out, module_out[0].t())
    assert_close(out, hf_fn(x_bdl, weight, bias, activation=activation)[0].t())
    assert_close(out, conv1d_hf_equivalent(x_bdl, weight, bias, activation)[0].t())

    # decode / multi-token update from a cached window vs HF's update fallback ([B, D, state_len] state)
    steps = 3
    xd = torch.randn(2, steps, dim)
    hf_state = states[[3, 0]].transpose(1, 2).contiguous()  # [2, D, W-1]
    hf_out = hf_update(xd.transpose(1, 2).contiguous(), hf_state, weight, bias, activation=activation)
    got = ops.causal_conv1d_update(xd, states, weight, bias, activation, torch.tensor([3, 0]), False, None)
    assert_close(got, hf_out.transpose(1, 2))
    assert torch.equal(states[[3, 0]], hf_state.transpose(1, 2))


# --------------------------------------------------------------------------------------------
# causal_conv1d_update
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["plain", "intermediate", "verify"])
@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("dim", [8, 24])
@pytest.mark.parametrize("width", [2, 4])
def test_update_matches_reference(width, dim, steps, mode, dtype):
    batch = 4
    weight, bias = _params(dim, width, dtype)
    x = _x(batch * steps, dim, dtype).reshape(batch, steps, dim)  # packed [B*L, D] reshaped by the caller
    states = torch.randn(NUM_SLOTS, width - 1, dim)
    idx = distinct_slots(batch, NUM_SLOTS, pad_rows=(2,))
    inter = torch.randn(batch + 2, steps, width - 1, dim) if mode != "plain" else None  # buffer > batch
    disable = mode == "verify"
    before, inter_before = states.clone(), None if inter is None else inter.clone()
    want_out, want_states, want_inter = causal_conv1d_update_ref(
        x, states, weight, bias, "silu", idx, disable, inter
    )
    out = ops.causal_conv1d_update(x, states, weight, bias, "silu", idx, disable, inter)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close(out, want_out, dtype)
    assert torch.count_nonzero(out[2]) == 0
    assert torch.equal(states, want_states)
    if disable:
        assert torch.equal(states, before)
    else:
        keep = _untouched(NUM_SLOTS, *idx.tolist())
        assert torch.equal(states[keep], before[keep])
    if inter is not None:
        assert torch.equal(inter, want_inter)
        assert torch.equal(inter[2], inter_before[2]) and torch.equal(inter[batch:], inter_before[batch:])
        assert torch.equal(inter[0, steps - 1], want_states[idx[0]] if not disable else want_inter[0, steps - 1])


def test_update_low_precision_pool_and_buffer():
    dim, width, steps = 8, 4, 2
    weight, bias = _params(dim, width)
    x = torch.randn(3, steps, dim)
    states = torch.randn(NUM_SLOTS, width - 1, dim).to(torch.bfloat16)
    inter = torch.zeros(3, steps, width - 1, dim, dtype=torch.float16)
    idx = torch.tensor([4, -1, 0], dtype=torch.int64)
    want_out, want_states, want_inter = causal_conv1d_update_ref(x, states, weight, bias, "silu", idx, False, inter)
    out = ops.causal_conv1d_update(x, states, weight, bias, "silu", idx, False, inter)
    assert_close(out, want_out)
    assert torch.equal(states, want_states) and torch.equal(inter, want_inter)


# --------------------------------------------------------------------------------------------
# composition: chaining, prefill + decode, verify windows
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dim", [8, 24])
@pytest.mark.parametrize("width", [2, 4])
def test_fn_chaining_equals_one_call(width, dim):
    lens, split = [9, 2, 5, 1, 6], [4, 1, 5, 0, 2]
    weight, bias = _params(dim, width)
    x, states, qsl, idx, has_init = _batch(lens, dim, width, pad_rows=(4,))
    one = states.clone()
    want = ops.causal_conv1d_fn(x, weight, bias, one, qsl, idx, has_init, "silu")

    first = [x[qsl[b] : qsl[b] + split[b]] for b in range(len(lens))]
    second = [x[qsl[b] + split[b] : qsl[b + 1]] for b in range(len(lens))]
    two = states.clone()
    out1 = ops.causal_conv1d_fn(torch.cat(first), weight, bias, two, cu_seqlens_of(split), idx, has_init, "silu")
    rest = [n - s for n, s in zip(lens, split)]
    # the second call continues from the window the first left (or the original one for an empty first part)
    has2 = torch.tensor([bool(has_init[b]) or split[b] > 0 for b in range(len(lens))])
    out2 = ops.causal_conv1d_fn(torch.cat(second), weight, bias, two, cu_seqlens_of(rest), idx, has2, "silu")
    q1, q2 = cu_seqlens_of(split), cu_seqlens_of(rest)
    got = torch.cat([torch.cat([out1[q1[b] : q1[b + 1]], out2[q2[b] : q2[b + 1]]]) for b in range(len(lens))])
    assert_close(got, want)
    assert torch.equal(two, one)


@pytest.mark.parametrize("width", [2, 4])
def test_prefill_then_decode_equals_one_prefill(width):
    dim, prompt, decode = 24, [6, 1, 3], 4
    weight, bias = _params(dim, width)
    full_lens = [n + decode for n in prompt]
    x, states, qsl_full, idx, has_init = _batch(full_lens, dim, width, pad_rows=())
    one = states.clone()
    want = ops.causal_conv1d_fn(x, weight, bias, one, qsl_full, idx, has_init, "silu")

    step = states.clone()
    xp = torch.cat([x[qsl_full[b] : qsl_full[b] + prompt[b]] for b in range(3)])
    outp = ops.causal_conv1d_fn(xp, weight, bias, step, cu_seqlens_of(prompt), idx, has_init, "silu")
    qp = cu_seqlens_of(prompt)
    for b in range(3):
        assert_close(outp[qp[b] : qp[b + 1]], want[qsl_full[b] : qsl_full[b] + prompt[b]])
    for t in range(decode):
        xt = torch.stack([x[qsl_full[b] + prompt[b] + t] for b in range(3)])[:, None]  # [B, 1, D]
        ot = ops.causal_conv1d_update(xt, step, weight, bias, "silu", idx, False, None)
        for b in range(3):
            assert_close(ot[b, 0], want[qsl_full[b] + prompt[b] + t])
    assert torch.equal(step, one)


@pytest.mark.parametrize("width", [2, 4])
def test_verify_windows_commit_equals_prefill(width):
    dim, steps, batch = 8, 4, 3
    weight, bias = _params(dim, width)
    states = torch.randn(NUM_SLOTS, width - 1, dim)
    idx = torch.tensor([5, -1, 2])
    x = torch.randn(batch, steps, dim)
    inter = torch.zeros(batch, steps, width - 1, dim)
    before = states.clone()
    out = ops.causal_conv1d_update(x, states, weight, bias, "silu", idx, True, inter)
    assert torch.equal(states, before)
    for b in (0, 2):
        for t in range(steps):
            pre = before.clone()
            ref_out = ops.causal_conv1d_fn(
                x[b, : t + 1], weight, bias, pre, cu_seqlens_of([t + 1]), idx[b : b + 1], torch.tensor([True]), "silu"
            )
            assert torch.equal(inter[b, t], pre[idx[b]])
            assert_close(out[b, : t + 1], ref_out)
    assert torch.count_nonzero(inter[1]) == 0
    # committing the window of the last accepted step
    accepted = torch.tensor([2, 1, steps])
    ops.commit_speculative_state([states], [inter], idx, accepted)
    assert torch.equal(states[5], inter[0, 1]) and torch.equal(states[2], inter[2, steps - 1])


# --------------------------------------------------------------------------------------------
# track_conv_window
# --------------------------------------------------------------------------------------------


def _track_case(width, dim, idx_dtype=torch.int32):
    lens = [5, 0, 7, 1, 3, 9, 4]
    track = [2, 0, 7, -1, 0, 3, 4]  # < W-1, empty request, full length, none, zero, mid, padded row
    x, states, qsl, idx, has_init = _batch(lens, dim, width, pad_rows=(6,), idx_dtype=idx_dtype)
    free = [s for s in range(NUM_SLOTS) if s not in idx.tolist()]
    # row 3: no checkpoint (track -1); row 5: no destination; row 6: padding request with a destination
    dst = torch.tensor([free[0], free[1], free[2], free[3], free[4], -1, free[5]], dtype=idx_dtype)
    return lens, track, x, states, qsl, idx, has_init, torch.tensor(track, dtype=idx_dtype), dst


@pytest.mark.parametrize("dim", [8, 24])
@pytest.mark.parametrize("width", [2, 4])
def test_track_matches_reference_and_prefix_prefill(width, dim):
    lens, track, x, states, qsl, idx, has_init, tl, dst = _track_case(width, dim)
    dst[5] = [s for s in range(NUM_SLOTS) if s not in idx.tolist() and s not in dst.tolist()][0]
    before = states.clone()
    want = track_conv_window_ref(states, x, qsl, idx, has_init, tl, dst)
    ops.track_conv_window(states, x, qsl, idx, has_init, tl, dst)
    assert torch.equal(states, want)
    tracked = [b for b in range(len(lens)) if tl[b] >= 0 and dst[b] >= 0 and idx[b] >= 0]
    keep = _untouched(NUM_SLOTS, *[int(dst[b]) for b in tracked])
    assert torch.equal(states[keep], before[keep])

    # == causal_conv1d_fn run on only the first track_lens[b] tokens of each tracked request
    pre = before.clone()
    for b in range(len(lens)):
        if not has_init[b] and idx[b] >= 0:
            pre[idx[b]] = 0  # the "state" of a request without initial window is zeros
    prefix_lens = [max(int(tl[b]), 0) for b in range(len(lens))]
    xp = torch.cat([x[qsl[b] : qsl[b] + prefix_lens[b]] for b in range(len(lens))])
    weight, bias = _params(dim, width)
    ops.causal_conv1d_fn(xp, weight, bias, pre, cu_seqlens_of(prefix_lens), idx, has_init, "silu")
    for b in tracked:
        assert torch.equal(states[dst[b]], pre[idx[b]]), f"request {b}"


def test_track_before_fn_then_fn():
    """Documented order: track first (reads the source slots), then the extend overwrites them."""
    dim, width = 8, 4
    lens, track, x, states, qsl, idx, has_init, tl, dst = _track_case(width, dim, idx_dtype=torch.int64)
    want_states = track_conv_window_ref(states, x, qsl, idx, has_init, tl, dst)
    weight, bias = _params(dim, width)
    _, want_states = causal_conv1d_fn_ref(x, weight, bias, want_states, qsl, idx, has_init, "silu")
    ops.track_conv_window(states, x, qsl, idx, has_init, tl, dst)
    ops.causal_conv1d_fn(x, weight, bias, states, qsl, idx, has_init, "silu")
    assert torch.equal(states, want_states)


def test_track_bf16_pool():
    dim, width = 8, 4
    lens, track, x, states, qsl, idx, has_init, tl, dst = _track_case(width, dim)
    states = states.to(torch.bfloat16)
    x = x.to(torch.bfloat16)
    want = track_conv_window_ref(states, x, qsl, idx, has_init, tl, dst)
    ops.track_conv_window(states, x, qsl, idx, has_init, tl, dst)
    assert torch.equal(states, want)


# --------------------------------------------------------------------------------------------
# opcheck
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "lens,pad,bias,activation,idx_dtype",
    [
        ([0, 3, 1], (1,), True, "silu", torch.int32),
        ([5], (), False, None, torch.int64),
        ([1, 1, 1, 0], (3,), True, "identity", torch.int32),
        ([], (), True, "silu", torch.int32),
    ],
)
def test_opcheck_fn(lens, pad, bias, activation, idx_dtype):
    dim, width = 8, 4
    weight, b = _params(dim, width, bias=bias)
    x, states, qsl, idx, has_init = _batch(lens, dim, width, pad_rows=pad, idx_dtype=idx_dtype)
    run_opcheck(ops.causal_conv1d_fn, (x, weight, b, states, qsl, idx, has_init, activation))


@pytest.mark.parametrize("steps,inter,disable,bias", [(1, False, False, True), (3, True, True, False), (2, True, False, True)])
def test_opcheck_update(steps, inter, disable, bias):
    dim, width, batch = 8, 4, 3
    weight, b = _params(dim, width, bias=bias)
    x = torch.randn(batch, steps, dim)
    states = torch.randn(NUM_SLOTS, width - 1, dim)
    idx = torch.tensor([3, -1, 7])
    buf = torch.randn(batch + 1, steps, width - 1, dim) if inter else None
    run_opcheck(ops.causal_conv1d_update, (x, states, weight, b, "silu", idx, disable, buf))


def test_opcheck_track():
    dim, width = 8, 4
    lens, track, x, states, qsl, idx, has_init, tl, dst = _track_case(width, dim)
    run_opcheck(ops.track_conv_window, (states, x, qsl, idx, has_init, tl, dst))


# --------------------------------------------------------------------------------------------
# invalid arguments
# --------------------------------------------------------------------------------------------


def _fn_args(**over):
    dim, width = 8, 4
    weight, bias = _params(dim, width)
    x, states, qsl, idx, has_init = _batch([3, 2], dim, width)
    args = dict(x=x, weight=weight, bias=bias, conv_states=states, query_start_loc=qsl, cache_indices=idx,
                has_initial_state=has_init, activation="silu")
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over,exc,match",
    [
        (dict(x=torch.randn(5, 9)), ValueError, r"causal_conv1d_fn: `x` has shape"),
        (dict(x=torch.randn(5, 8).to(torch.int32)), ValueError, r"`x` must have dtype"),
        (dict(weight=torch.randn(8)), ValueError, r"`weight` must have 2 dims"),
        (dict(weight=torch.randn(8, 1)), ValueError, r"kernel width W >= 2"),
        (dict(bias=torch.randn(7)), ValueError, r"`bias` has shape"),
        (dict(conv_states=torch.randn(NUM_SLOTS, 2, 8)), ValueError, r"`conv_states` has shape"),
        (dict(query_start_loc=torch.tensor([0, 3], dtype=torch.int32)), ValueError, r"`query_start_loc` has shape"),
        (dict(query_start_loc=torch.tensor([0, 3, 4], dtype=torch.int32)), ValueError, r"must end at the number"),
        (dict(query_start_loc=torch.tensor([0, 3.0, 5.0])), ValueError, r"`query_start_loc` must have dtype"),
        (dict(cache_indices=torch.tensor([0, NUM_SLOTS])), IndexError, r"`cache_indices` has values"),
        (dict(cache_indices=torch.tensor([-2, 0])), IndexError, r"`cache_indices` has values"),
        (dict(cache_indices=torch.tensor([4, 4])), ValueError, r"repeated slot"),
        (dict(has_initial_state=torch.tensor([1, 0])), ValueError, r"`has_initial_state` must have dtype"),
        (dict(activation="relu"), ValueError, r"unsupported `activation` 'relu'"),
    ],
)
def test_fn_invalid(over, exc, match):
    with pytest.raises(exc, match=match):
        ops.causal_conv1d_fn(**_fn_args(**over))


def test_invalid_args_also_fail_at_trace_time():
    args = _fn_args(x=torch.randn(5, 9))
    meta = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    with pytest.raises(ValueError, match=r"causal_conv1d_fn: `x` has shape"):
        ops.causal_conv1d_fn(**meta)


def _update_args(**over):
    dim, width, steps = 8, 4, 2
    weight, bias = _params(dim, width)
    args = dict(x=torch.randn(3, steps, dim), conv_states=torch.randn(NUM_SLOTS, width - 1, dim), weight=weight,
                bias=bias, activation="silu", conv_state_indices=torch.tensor([0, -1, 2]), disable_state_update=False,
                intermediate_conv_windows=torch.zeros(3, steps, width - 1, dim))
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over,exc,match",
    [
        (dict(x=torch.randn(3, 8)), ValueError, r"causal_conv1d_update: `x` must have 3 dims"),
        (dict(conv_state_indices=torch.tensor([0, 1])), ValueError, r"`conv_state_indices` has shape"),
        (dict(conv_state_indices=torch.tensor([0, 1, 99])), IndexError, r"`conv_state_indices` has values"),
        (dict(conv_state_indices=torch.tensor([1, 1, -1])), ValueError, r"repeated slot"),
        (dict(intermediate_conv_windows=torch.zeros(2, 2, 3, 8)), ValueError, r"at least the batch size 3"),
        (dict(intermediate_conv_windows=torch.zeros(3, 3, 3, 8)), ValueError, r"`intermediate_conv_windows` has shape"),
        (dict(conv_states=torch.randn(NUM_SLOTS, 3, 9)), ValueError, r"`conv_states` has shape"),
        (dict(activation="gelu"), ValueError, r"unsupported `activation`"),
    ],
)
def test_update_invalid(over, exc, match):
    with pytest.raises(exc, match=match):
        ops.causal_conv1d_update(**_update_args(**over))


@pytest.mark.parametrize(
    "what,exc,match",
    [
        ("too_long", ValueError, r"track_conv_window: `track_lens\[0\]` = 6 exceeds the request's 5"),
        ("dst_range", IndexError, r"`dst_slots` has values"),
        ("dst_dup", ValueError, r"`dst_slots` has repeated"),
        ("x_dim", ValueError, r"`x` has shape"),
        ("tl_shape", ValueError, r"`track_lens` has shape"),
    ],
)
def test_track_invalid(what, exc, match):
    lens, track, x, states, qsl, idx, has_init, tl, dst = _track_case(4, 8)
    if what == "too_long":
        tl[0] = 6
    elif what == "dst_range":
        dst[0] = NUM_SLOTS
    elif what == "dst_dup":
        dst[1] = dst[0]
    elif what == "x_dim":
        x = torch.randn(x.shape[0], 9)
    elif what == "tl_shape":
        tl = tl[:-1]
    with pytest.raises(exc, match=match):
        ops.track_conv_window(states, x, qsl, idx, has_init, tl, dst)


# --------------------------------------------------------------------------------------------
# torch.compile
# --------------------------------------------------------------------------------------------


def test_compile_fullgraph():
    dim, width, steps = 8, 4, 2
    weight, bias = _params(dim, width)
    lens, track, x, states, qsl, idx, has_init, tl, dst = _track_case(width, dim)
    xd = torch.randn(3, steps, dim)
    didx = torch.tensor([int(idx[0]), -1, int(idx[2])], dtype=torch.int32)
    inter = torch.zeros(3, steps, width - 1, dim)

    def f(x, xd, weight, bias, states, qsl, idx, has_init, tl, dst, didx, inter):
        ops.track_conv_window(states, x, qsl, idx, has_init, tl, dst)
        y = ops.causal_conv1d_fn(x * 2.0, weight, bias, states, qsl, idx, has_init, "silu")
        z = ops.causal_conv1d_update(xd, states, weight, bias, "silu", didx, False, inter)
        return y + 1.0, z.sum(-1)

    eager, compiled, ea, ca = compile_and_compare(f, x, xd, weight, bias, states, qsl, idx, has_init, tl, dst, didx, inter)
    for e, c in zip(eager, compiled):
        assert_close(c, e)
    assert torch.equal(ea[4], ca[4]) and torch.equal(ea[11], ca[11])
    assert not torch.equal(ea[4], states)  # the pools really were mutated
