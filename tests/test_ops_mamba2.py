"""Tests of the Mamba2 kernel ops (ssd_chunk_scan, selective_state_update) against the per-token
reference and against transformers' own mamba2 functions."""

from __future__ import annotations

import math

import pytest
import torch

from hybrid_compile.ops import _varlen
from hybrid_compile.ops.mamba2 import selective_state_update, ssd_chunk_scan, varlen_chunk_table
from hybrid_compile.ops.reference.mamba2 import selective_state_update_reference, ssd_scan_reference
from op_testing import (
    TOLERANCE,
    VARLEN_CASES,
    assert_close,
    compile_and_compare,
    cu_seqlens_of,
    distinct_slots,
    run_opcheck,
)

INF = float("inf")
NUM_SLOTS = 9


def _cast(t, dtype):
    return None if t is None else t.to(dtype)


def make_prefill(
    lens, *, H=4, G=2, P=8, N=16, dtype=torch.float32, pool_dtype=torch.float32, with_D=True, with_z=True,
    with_bias=True, pad_rows=(), init=None, softplus=True, dt_min=0.0, dt_max=INF, num_slots=NUM_SLOTS,
):
    """Inputs of ssd_chunk_scan as a dict. x/B/C (and z) are non-contiguous views split out of one
    packed projection, the way the mixer's in_proj + split produces them."""
    T = sum(lens)
    batch = len(lens)
    proj = torch.randn(T, 2 * H * P + 2 * G * N)
    proj[:, H * P : H * P + 2 * G * N] *= 0.5
    proj = proj.to(dtype)
    x = proj[:, : H * P].view(T, H, P)
    B = proj[:, H * P : H * P + G * N].view(T, G, N)
    C = proj[:, H * P + G * N : H * P + 2 * G * N].view(T, G, N)
    z = proj[:, H * P + 2 * G * N :].view(T, H, P)
    dt = (torch.randn(T, H) - 1.0).to(dtype)
    A = -torch.exp(torch.rand(H) * 1.5 - 0.5)  # fp32, in [-e, -0.6]
    D = torch.randn(H).to(dtype) if with_D else None
    dt_bias = (0.5 * torch.randn(H)).to(dtype) if with_bias else None
    if not with_z:
        z = None
    ssm_states = torch.randn(num_slots, H, P, N).to(pool_dtype)
    state_indices = distinct_slots(batch, num_slots, pad_rows=pad_rows)
    if init is None:
        init = [b % 2 == 0 for b in range(batch)]
    has_initial_state = torch.tensor(init, dtype=torch.bool).reshape(batch)
    return dict(
        x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, dt_softplus=softplus, dt_min=dt_min,
        dt_max=dt_max, ssm_states=ssm_states, cu_seqlens=cu_seqlens_of(lens), state_indices=state_indices,
        has_initial_state=has_initial_state,
    )


PREFILL_ORDER = (
    "x", "dt", "A", "B", "C", "D", "z", "dt_bias", "dt_softplus", "dt_min", "dt_max", "ssm_states", "cu_seqlens",
    "state_indices", "has_initial_state",
)
DECODE_ORDER = (
    "x", "dt", "A", "B", "C", "D", "z", "dt_bias", "dt_softplus", "dt_min", "dt_max", "ssm_states", "state_indices",
    "disable_state_update", "intermediate_states",
)


def run_prefill(inp, chunk_size, output_chunk_states=True):
    return ssd_chunk_scan(*(inp[k] for k in PREFILL_ORDER), chunk_size, output_chunk_states, ssm_scales=None)


def ref_prefill(inp):
    return ssd_scan_reference(*(inp[k] for k in PREFILL_ORDER))


def make_decode(
    batch, steps, *, H=4, G=2, P=8, N=16, dtype=torch.float32, pool_dtype=torch.float32, with_D=True,
    with_z=True, with_bias=True, pad_rows=(), inter=True, inter_dtype=torch.float32, disable=False,
    dt_min=0.0, dt_max=INF, num_slots=NUM_SLOTS,
):
    x = torch.randn(batch, steps, H, P).to(dtype)
    dt = (torch.randn(batch, steps, H) - 1.0).to(dtype)
    A = -torch.exp(torch.rand(H) * 1.5 - 0.5)
    B = (0.5 * torch.randn(batch, steps, G, N)).to(dtype)
    C = (0.5 * torch.randn(batch, steps, G, N)).to(dtype)
    return dict(
        x=x, dt=dt, A=A, B=B, C=C, D=torch.randn(H).to(dtype) if with_D else None,
        z=torch.randn(batch, steps, H, P).to(dtype) if with_z else None,
        dt_bias=(0.5 * torch.randn(H)).to(dtype) if with_bias else None, dt_softplus=True, dt_min=dt_min,
        dt_max=dt_max, ssm_states=torch.randn(num_slots, H, P, N).to(pool_dtype),
        state_indices=distinct_slots(batch, num_slots, pad_rows=pad_rows), disable_state_update=disable,
        intermediate_states=torch.full((batch + 1, steps, H, P, N), 7.0, dtype=inter_dtype) if inter else None,
    )


def run_decode(inp):
    return selective_state_update(*(inp[k] for k in DECODE_ORDER), A_is_log=False, ssm_scales=None, intermediate_scales=None)


def ref_decode(inp):
    return selective_state_update_reference(*(inp[k] for k in DECODE_ORDER))


def pad_rows_for(lens):
    return (len(lens) - 1,) if len(lens) >= 3 else ()


def check_pool(actual, expected, before, written_slots, msg=""):
    """Written slots close to the reference, every other slot bit-identical to before."""
    written = [s for s in written_slots if s >= 0]
    for s in range(actual.shape[0]):
        if s in written:
            assert_close(actual[s], expected[s], torch.float32 if actual.dtype == torch.float32 else torch.bfloat16,
                         msg=f"{msg} slot {s}")
        else:
            assert torch.equal(actual[s], before[s]), f"{msg}: untouched slot {s} changed"


# --------------------------------------------------------------------------------------------
# varlen_chunk_table
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lens", VARLEN_CASES + [[], [0, 0]])
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_varlen_chunk_table(lens, chunk_size):
    cu = cu_seqlens_of(lens)
    seq, start, length = varlen_chunk_table(cu, chunk_size)
    offsets = _varlen.chunk_row_offsets(cu, chunk_size).tolist() if lens else []
    exp_seq, exp_start, exp_len = [], [], []
    pos = 0
    for b, n in enumerate(lens):
        assert not lens or offsets[b] == len(exp_seq)
        for j in range(math.ceil(n / chunk_size)):
            exp_seq.append(b)
            exp_start.append(pos + j * chunk_size)
            exp_len.append(min(chunk_size, n - j * chunk_size))
        pos += n
    assert seq.tolist() == exp_seq and start.tolist() == exp_start and length.tolist() == exp_len
    assert seq.dtype == start.dtype == length.dtype == torch.int32
    rows = _varlen.max_chunk_rows(sum(lens), len(lens), chunk_size)
    seq_p, start_p, len_p = varlen_chunk_table(cu, chunk_size, num_rows=rows)
    pad = rows - len(exp_seq)
    assert pad >= 0
    assert seq_p.tolist() == exp_seq + [-1] * pad
    assert start_p.tolist() == exp_start + [0] * pad
    assert len_p.tolist() == exp_len + [0] * pad


# --------------------------------------------------------------------------------------------
# ssd_chunk_scan vs the per-token reference
# --------------------------------------------------------------------------------------------


def check_prefill_against_reference(inp, chunk_size, dtype, msg=""):
    lens = (inp["cu_seqlens"][1:] - inp["cu_seqlens"][:-1]).tolist()
    before = inp["ssm_states"].clone()
    y_ref, states_ref, history = ref_prefill(inp)
    y, chunk_states = run_prefill(inp, chunk_size)
    assert y.dtype == inp["x"].dtype and y.shape == inp["x"].shape
    assert_close(y, y_ref, dtype, msg=f"{msg} output")
    slots = inp["state_indices"].tolist()
    written = [s for s, n in zip(slots, lens) if n > 0]
    check_pool(inp["ssm_states"], states_ref, before, written, msg)
    # padding requests: exactly zero output
    cu = inp["cu_seqlens"].tolist()
    for b, s in enumerate(slots):
        if s < 0:
            assert torch.all(y[cu[b] : cu[b + 1]] == 0)
    # chunk states: row offset_b + j = state after j * chunk_size tokens, other rows zero
    T, H, P = inp["x"].shape
    N = inp["B"].shape[2]
    assert chunk_states.dtype == torch.float32
    assert chunk_states.shape == (_varlen.max_chunk_rows(T, len(lens), chunk_size), H, P, N)
    offsets = _varlen.chunk_row_offsets(inp["cu_seqlens"], chunk_size).tolist()
    used = torch.zeros(chunk_states.shape[0], dtype=torch.bool)
    for b, n in enumerate(lens):
        for j in range(math.ceil(n / chunk_size)):
            row = offsets[b] + j
            if slots[b] >= 0:
                assert_close(chunk_states[row], history[b][j * chunk_size], msg=f"{msg} chunk state b={b} j={j}")
                used[row] = True
    assert torch.all(chunk_states[~used] == 0)


@pytest.mark.parametrize("lens", VARLEN_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ssd_chunk_scan_matches_reference(lens, dtype):
    inp = make_prefill(lens, dtype=dtype, pad_rows=pad_rows_for(lens))
    check_prefill_against_reference(inp, 16, dtype, msg=f"lens={lens}")


@pytest.mark.parametrize(
    "lens,chunk_size,H,G,N,opts",
    [
        ([130, 17, 64, 1], 64, 2, 1, 8, dict(with_D=False, with_z=False, with_bias=False)),
        ([300, 5], 256, 4, 1, 8, dict(softplus=False, dt_min=0.05, dt_max=1.5, init=[True, True])),
        ([33, 0, 9], 8, 4, 4, 8, dict(dt_min=0.1, dt_max=0.8, with_z=False)),
        ([40, 7], 16, 2, 2, 16, dict(pool_dtype=torch.bfloat16, init=[True, False])),
        ([21, 12], 16, 4, 2, 8, dict(pool_dtype=torch.float16, dtype=torch.float16, init=[True, True])),
    ],
)
def test_ssd_chunk_scan_variants(lens, chunk_size, H, G, N, opts):
    dtype = opts.get("dtype", torch.float32)
    inp = make_prefill(lens, H=H, G=G, N=N, **opts)
    check_prefill_against_reference(inp, chunk_size, dtype, msg=f"lens={lens} opts={opts}")


def test_ssd_chunk_scan_blocked_intra_chunk(monkeypatch):
    """The plain-torch scan builds the intra-chunk decay matrices a block of chunks at a time."""
    import hybrid_compile.ops.mamba2 as mamba2_mod

    monkeypatch.setattr(mamba2_mod, "_INTRA_BLOCK_ELEMS", 2 * 4 * 8 * 8)  # two chunks per block
    inp = make_prefill([45, 0, 17, 3], pad_rows=(3,))
    check_prefill_against_reference(inp, 8, torch.float32)


@pytest.mark.parametrize("chunk_size", [8, 16, 64])
def test_ssd_chunk_scan_split_prefill_equals_one_call(chunk_size):
    lens_a, lens_b = [20, 5, 0, 33], [17, 0, 9, 31]
    full = [a + b for a, b in zip(lens_a, lens_b)]
    inp = make_prefill(full, init=[True, False, True, False])
    one = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inp.items()}
    y_one, _ = run_prefill(one, chunk_size)

    cu = inp["cu_seqlens"].tolist()
    idx_a = torch.cat([torch.arange(cu[b], cu[b] + lens_a[b]) for b in range(4)])
    idx_b = torch.cat([torch.arange(cu[b] + lens_a[b], cu[b + 1]) for b in range(4)])
    per_tok = ("x", "dt", "B", "C", "z")
    first = dict(inp, **{k: inp[k][idx_a] for k in per_tok}, cu_seqlens=cu_seqlens_of(lens_a))
    y_a, _ = run_prefill(first, chunk_size)
    # the first call wrote the pool; request 2 has no tokens in the first part, so it keeps its flag
    second_init = torch.tensor([la > 0 or init for la, init in zip(lens_a, inp["has_initial_state"].tolist())])
    second = dict(first, **{k: inp[k][idx_b] for k in per_tok}, cu_seqlens=cu_seqlens_of(lens_b),
                  has_initial_state=second_init)
    y_b, _ = run_prefill(second, chunk_size)
    y_two = torch.empty_like(y_one)
    y_two[idx_a] = y_a
    y_two[idx_b] = y_b
    assert_close(y_two, y_one)
    assert_close(second["ssm_states"], one["ssm_states"])


def test_decode_after_prefill_equals_longer_prefill():
    lens = [20, 1, 37]
    long_inp = make_prefill([n + 1 for n in lens], init=[True, False, True])
    y_long, _ = run_prefill({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in long_inp.items()}, 16)
    expected_states = long_inp["ssm_states"].clone()
    run_prefill(dict(long_inp, ssm_states=expected_states), 16)

    cu = long_inp["cu_seqlens"].tolist()
    last = torch.tensor([cu[b + 1] - 1 for b in range(3)])
    head = torch.cat([torch.arange(cu[b], cu[b + 1] - 1) for b in range(3)])
    per_tok = ("x", "dt", "B", "C", "z")
    pre = dict(long_inp, **{k: long_inp[k][head] for k in per_tok}, cu_seqlens=cu_seqlens_of(lens))
    y_pre, _ = run_prefill(pre, 16)
    dec = {k: pre[k] for k in ("A", "D", "dt_bias", "dt_softplus", "dt_min", "dt_max", "ssm_states", "state_indices")}
    dec.update({k: long_inp[k][last][:, None] for k in per_tok})
    dec.update(disable_state_update=False, intermediate_states=None)
    y_dec = run_decode(dec)
    assert_close(y_pre, y_long[head])
    assert_close(y_dec[:, 0], y_long[last])
    assert_close(dec["ssm_states"], expected_states)


# --------------------------------------------------------------------------------------------
# selective_state_update vs the per-token reference
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "batch,steps,opts",
    [
        (3, 1, dict(pad_rows=(1,), inter=False)),
        (4, 1, dict(with_D=False, with_z=False, with_bias=False, inter=False)),
        (3, 4, dict(pad_rows=(0,))),
        (2, 3, dict(disable=True, dt_min=0.1, dt_max=0.7, G=1, H=2, N=8)),
        (3, 2, dict(pool_dtype=torch.bfloat16, inter_dtype=torch.bfloat16, pad_rows=(2,))),
        (1, 1, dict(pad_rows=(0,))),
    ],
)
def test_selective_state_update_matches_reference(dtype, batch, steps, opts):
    inp = make_decode(batch, steps, dtype=dtype, **opts)
    before = inp["ssm_states"].clone()
    inter_before = None if inp["intermediate_states"] is None else inp["intermediate_states"].clone()
    y_ref, states_ref, inter_ref = ref_decode(inp)
    y = run_decode(inp)
    assert y.dtype == dtype and y.shape == inp["x"].shape
    assert_close(y, y_ref, dtype)
    slots = inp["state_indices"].tolist()
    written = [] if inp["disable_state_update"] else slots
    check_pool(inp["ssm_states"], states_ref, before, written)
    for b, s in enumerate(slots):
        if s < 0:
            assert torch.all(y[b] == 0)
    if inter_ref is not None:
        inter = inp["intermediate_states"]
        tol_dtype = torch.float32 if inter.dtype == torch.float32 else torch.bfloat16
        for b in range(inter.shape[0]):
            if b < batch and slots[b] >= 0:
                assert_close(inter[b], inter_ref[b], tol_dtype)
            else:  # padding rows and rows past the batch are untouched
                assert torch.equal(inter[b], inter_before[b])


def test_verify_intermediates_equal_single_decode_steps():
    inp = make_decode(3, 4, pad_rows=(1,), disable=True)
    states0 = inp["ssm_states"].clone()
    y = run_decode(inp)
    assert torch.equal(inp["ssm_states"], states0)  # disable_state_update
    step_states = states0.clone()
    for t in range(4):
        step = dict(inp, ssm_states=step_states, disable_state_update=False, intermediate_states=None,
                    **{k: inp[k][:, t : t + 1] for k in ("x", "dt", "B", "C", "z")})
        y_t = run_decode(step)
        assert_close(y_t[:, 0], y[:, t])
        for b, s in enumerate(inp["state_indices"].tolist()):
            if s >= 0:
                assert_close(inp["intermediate_states"][b, t], step_states[s])


# --------------------------------------------------------------------------------------------
# transformers' mamba2 functions as a second oracle
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_init", [False, True])
@pytest.mark.parametrize(
    "T,chunk_size,H,G,N,dt_limit,with_D,with_bias",
    [
        (37, 16, 4, 2, 16, (0.0, INF), True, True),
        (37, 8, 2, 1, 8, (0.05, 1.2), False, True),
        (130, 64, 4, 1, 8, (0.0, INF), True, False),
        (16, 16, 2, 2, 16, (0.1, INF), True, True),
    ],
)
def test_ssd_chunk_scan_matches_transformers(with_init, T, chunk_size, H, G, N, dt_limit, with_D, with_bias):
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

    inp = make_prefill([T], H=H, G=G, N=N, init=[with_init], with_z=False, with_D=with_D, with_bias=with_bias,
                       dt_min=dt_limit[0], dt_max=dt_limit[1])
    slot = int(inp["state_indices"][0])
    init_state = inp["ssm_states"][slot].clone()
    y_hf, final_hf = mamba2_chunk_scan(
        inp["x"][None], inp["dt"][None], inp["A"], inp["B"][None], inp["C"][None], chunk_size=chunk_size,
        D=inp["D"], dt_bias=inp["dt_bias"], initial_states=init_state[None] if with_init else None,
        dt_softplus=True, dt_limit=dt_limit, return_final_states=True,
    )
    y, _ = run_prefill(inp, chunk_size, output_chunk_states=False)
    assert_close(y, y_hf[0])
    assert_close(inp["ssm_states"][slot], final_hf[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,G,N,with_z", [(4, 2, 16, False), (2, 1, 8, True), (4, 4, 8, True)])
def test_selective_state_update_matches_transformers(dtype, H, G, N, with_z):
    from transformers.models.mamba2.modeling_mamba2 import mamba2_selective_state_update

    batch, P = 3, 8
    inp = make_decode(batch, 1, H=H, G=G, N=N, dtype=dtype, with_z=with_z, inter=False)
    slots = inp["state_indices"].to(torch.int64)
    state = inp["ssm_states"][slots].clone()
    # Build the expanded shapes exactly like Mamba2Mixer.forward does
    y_hf = mamba2_selective_state_update(
        state,
        inp["x"][:, 0],
        inp["dt"][:, 0][..., None].expand(-1, -1, P),
        inp["A"][:, None, None].expand(-1, P, N),
        inp["B"][:, 0],
        inp["C"][:, 0],
        inp["D"][:, None].expand(-1, P),
        z=inp["z"][:, 0] if with_z else None,
        dt_bias=inp["dt_bias"][:, None].expand(-1, P),
        dt_softplus=True,
    )
    y = run_decode(inp)
    assert_close(y[:, 0], y_hf, dtype)
    assert_close(inp["ssm_states"][slots], state, dtype)


# --------------------------------------------------------------------------------------------
# opcheck
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "lens,chunk_size,opts,out_chunks",
    [
        ([0, 7, 1], 8, dict(pad_rows=(2,)), True),
        ([5, 12], 4, dict(with_D=False, with_z=False, with_bias=False), False),
        ([3, 0, 9, 2], 8, dict(pad_rows=(0,), pool_dtype=torch.bfloat16, dtype=torch.bfloat16), True),
    ],
)
def test_ssd_chunk_scan_opcheck(lens, chunk_size, opts, out_chunks):
    inp = make_prefill(lens, **opts)
    run_opcheck(torch.ops.hybrid_compile.ssd_chunk_scan.default,
                tuple(inp[k] for k in PREFILL_ORDER) + (chunk_size, out_chunks))


@pytest.mark.parametrize(
    "batch,steps,opts",
    [
        (3, 1, dict(pad_rows=(1,), inter=False)),
        (2, 3, dict(pad_rows=(0,), disable=True)),
        (2, 2, dict(with_D=False, with_z=False, with_bias=False, dtype=torch.bfloat16)),
    ],
)
def test_selective_state_update_opcheck(batch, steps, opts):
    inp = make_decode(batch, steps, **opts)
    run_opcheck(torch.ops.hybrid_compile.selective_state_update.default, tuple(inp[k] for k in DECODE_ORDER) + (False,))
    a_log = torch.log(-inp["A"]).to(inp["x"].dtype)  # A_is_log: the op takes A_log (any float dtype)
    args = tuple(a_log if k == "A" else inp[k] for k in DECODE_ORDER) + (True,)
    run_opcheck(torch.ops.hybrid_compile.selective_state_update.default, args)


# --------------------------------------------------------------------------------------------
# invalid arguments
# --------------------------------------------------------------------------------------------


def _bad_prefill(**changes):
    inp = make_prefill([4, 3])
    inp.update(changes)
    return inp


@pytest.mark.parametrize(
    "changes,exc,match",
    [
        (dict(dt=torch.randn(6, 4)), ValueError, "ssd_chunk_scan: `dt`"),
        (dict(A=torch.randn(4, dtype=torch.bfloat16)), ValueError, "ssd_chunk_scan: `A` must have dtype"),
        (dict(A=torch.randn(3)), ValueError, "ssd_chunk_scan: `A`"),
        (dict(C=torch.randn(7, 1, 16)), ValueError, "ssd_chunk_scan: `C`"),
        (dict(B=torch.randn(7, 3, 16), C=torch.randn(7, 3, 16)), ValueError, "multiple of the number of groups"),
        (dict(D=torch.randn(5)), ValueError, "ssd_chunk_scan: `D`"),
        (dict(z=torch.randn(7, 4, 4)), ValueError, "ssd_chunk_scan: `z`"),
        (dict(ssm_states=torch.randn(4, 4, 8, 8)), ValueError, "ssd_chunk_scan: `ssm_states`"),
        (dict(x=torch.randn(7, 4, 8).long()), ValueError, "ssd_chunk_scan: `x` must have dtype"),
        (dict(cu_seqlens=torch.tensor([0.0, 4.0, 7.0])), ValueError, "`cu_seqlens` must have dtype"),
        (dict(cu_seqlens=torch.tensor([0, 4, 8], dtype=torch.int32)), ValueError, "must end at the number of tokens"),
        (dict(state_indices=torch.tensor([0, 1, 2], dtype=torch.int32)), ValueError, "`state_indices`"),
        (dict(state_indices=torch.tensor([0, NUM_SLOTS], dtype=torch.int32)), IndexError, "`state_indices` has values"),
        (dict(state_indices=torch.tensor([2, 2], dtype=torch.int32)), ValueError, "repeated slot"),
        (dict(has_initial_state=torch.tensor([1, 0], dtype=torch.int32)), ValueError, "`has_initial_state`"),
        (dict(dt_min=2.0, dt_max=1.0), ValueError, "dt_min"),
    ],
)
def test_ssd_chunk_scan_invalid(changes, exc, match):
    inp = _bad_prefill(**changes)
    with pytest.raises(exc, match=match):
        run_prefill(inp, 8)


def test_ssd_chunk_scan_invalid_chunk_size_and_fake():
    inp = make_prefill([4, 3])
    with pytest.raises(ValueError, match="chunk_size must be > 0"):
        run_prefill(inp, 0)
    # the fake impl validates too
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = {k: (mode.from_tensor(v) if isinstance(v, torch.Tensor) else v) for k, v in inp.items()}
        y, cs = run_prefill(fake, 4)
        assert y.shape == (7, 4, 8) and cs.shape == (_varlen.max_chunk_rows(7, 2, 4), 4, 8, 16)
        fake["dt"] = mode.from_tensor(torch.randn(7, 3))
        with pytest.raises(ValueError, match="ssd_chunk_scan: `dt`"):
            run_prefill(fake, 4)


@pytest.mark.parametrize(
    "changes,exc,match",
    [
        (dict(x=torch.randn(2, 1, 4, 8)), ValueError, "selective_state_update: `dt`"),
        (dict(dt=torch.randn(3, 2, 3)), ValueError, "selective_state_update: `dt`"),
        (dict(A=torch.randn(4).double()), ValueError, "selective_state_update: `A` must have dtype"),
        (dict(z=torch.randn(3, 2, 4, 4)), ValueError, "selective_state_update: `z`"),
        (dict(intermediate_states=torch.zeros(2, 2, 4, 8, 16)), ValueError, "`intermediate_states` has shape"),
        (dict(intermediate_states=torch.zeros(4, 3, 4, 8, 16)), ValueError, "`intermediate_states` has shape"),
        (dict(state_indices=torch.tensor([0, 1, -2], dtype=torch.int32)), IndexError, "`state_indices` has values"),
        (dict(state_indices=torch.tensor([0, 1], dtype=torch.int32)), ValueError, "`state_indices`"),
        (dict(ssm_states=torch.randn(5, 4, 8, 8)), ValueError, "`ssm_states`"),
    ],
)
def test_selective_state_update_invalid(changes, exc, match):
    inp = make_decode(3, 2)
    inp.update(changes)
    with pytest.raises(exc, match=match):
        run_decode(inp)


# --------------------------------------------------------------------------------------------
# torch.compile
# --------------------------------------------------------------------------------------------


def test_compile_prefill_then_decode():
    pre = make_prefill([9, 0, 20, 5], pad_rows=(3,), init=[True, True, False, True])
    dec = make_decode(4, 2, pad_rows=(3,))
    dec["state_indices"] = pre["state_indices"].clone()

    def fn(x, dt, A, B, C, D, z, dt_bias, ssm_states, cu, idx, has_init, xd, dtd, Bd, Cd, zd, inter):
        y, cs = torch.ops.hybrid_compile.ssd_chunk_scan(
            x, dt, A, B, C, D, z, dt_bias, True, 0.0, INF, ssm_states, cu, idx, has_init, 8, True, ssm_scales=None,
        )
        yd = torch.ops.hybrid_compile.selective_state_update(
            xd, dtd, A, Bd, Cd, D, zd, dt_bias, True, 0.0, INF, ssm_states, idx, False, inter, A_is_log=False, ssm_scales=None, intermediate_scales=None, parent_indices=None,
        )
        return y * 2, cs, yd + 1

    args = [pre[k] for k in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "ssm_states", "cu_seqlens",
                             "state_indices", "has_initial_state")]
    args += [dec[k] for k in ("x", "dt", "B", "C", "z", "intermediate_states")]
    eager, compiled, eager_args, compiled_args = compile_and_compare(fn, *args)
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e, atol=TOLERANCE[torch.float32][0], rtol=TOLERANCE[torch.float32][1])
    assert_close(compiled_args[8], eager_args[8])  # ssm_states
    assert_close(compiled_args[-1], eager_args[-1])  # intermediate_states
    assert not torch.equal(eager_args[8], pre["ssm_states"])  # the pool really was written
