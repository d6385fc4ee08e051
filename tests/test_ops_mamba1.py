"""Tests of the Mamba1 kernel ops (mamba1_selective_scan, mamba1_state_update) against the per-token
reference and against transformers' own Mamba1 functions (``modeling_mamba``)."""

from __future__ import annotations

import pytest
import torch

from hybrid_compile.ops import _varlen
from hybrid_compile.ops.mamba1 import mamba1_selective_scan, mamba1_state_update
from hybrid_compile.ops.reference import tree as ref_tree
from hybrid_compile.ops.reference.mamba1 import mamba1_scan_reference, mamba1_state_update_reference
from op_testing import TOLERANCE, VARLEN_CASES, assert_close, compile_and_compare, cu_seqlens_of, distinct_slots, run_opcheck

NUM_SLOTS = 9

SCAN_ORDER = (
    "x", "dt", "A", "B", "C", "D", "z", "dt_bias", "dt_softplus", "ssm_states", "cu_seqlens", "state_indices",
    "has_initial_state",
)
UPDATE_ORDER = (
    "x", "dt", "A", "B", "C", "D", "z", "dt_bias", "dt_softplus", "ssm_states", "state_indices",
    "disable_state_update", "intermediate_states",
)


def _negative_A(D_inner, N):
    return -torch.exp(torch.rand(D_inner, N) * 1.5 - 0.5)  # fp32, per (channel, state) entry


def _dt(raw, softplus: bool, dtype):
    """The op's dt input: raw (the op applies the softplus) or, with ``dt_softplus=False``, already
    non-negative as the caller's (RecurrentGemma's) is; a negative dt would grow the state without
    bound (exp(-dt * |A|) > 1) and overflow over a long prompt."""
    return (raw if softplus else torch.nn.functional.softplus(raw)).to(dtype)


def make_scan(lens, *, D_inner=12, N=8, G=1, dtype=torch.float32, pool_dtype=torch.float32, with_D=True, with_z=True,
              with_bias=True, pad_rows=(), init=None, softplus=True, num_slots=NUM_SLOTS):
    """Inputs of mamba1_selective_scan. x / z are non-contiguous views of one in_proj output and B / C
    of one x_proj output, the way the mixer splits them."""
    T, batch = sum(lens), len(lens)
    xz = torch.randn(T, 2 * D_inner).to(dtype)
    bc = (0.5 * torch.randn(T, 2 * G * N)).to(dtype)
    if init is None:
        init = [b % 2 == 0 for b in range(batch)]
    return dict(
        x=xz[:, :D_inner], dt=_dt(torch.randn(T, D_inner) - 1.0, softplus, dtype), A=_negative_A(D_inner, N),
        B=bc[:, : G * N].view(T, G, N), C=bc[:, G * N :].view(T, G, N), D=torch.randn(D_inner).to(dtype) if with_D else None,
        z=xz[:, D_inner:] if with_z else None, dt_bias=(0.5 * torch.randn(D_inner)).to(dtype) if with_bias else None,
        dt_softplus=softplus, ssm_states=torch.randn(num_slots, D_inner, N).to(pool_dtype),
        cu_seqlens=cu_seqlens_of(lens), state_indices=distinct_slots(batch, num_slots, pad_rows=pad_rows),
        has_initial_state=torch.tensor(init, dtype=torch.bool).reshape(batch),
    )


def make_update(batch, steps, *, D_inner=12, N=8, G=1, dtype=torch.float32, pool_dtype=torch.float32, with_D=True,
                with_z=True, with_bias=True, pad_rows=(), inter=True, disable=False, softplus=True, num_slots=NUM_SLOTS):
    return dict(
        x=torch.randn(batch, steps, D_inner).to(dtype), dt=_dt(torch.randn(batch, steps, D_inner) - 1.0, softplus, dtype),
        A=_negative_A(D_inner, N), B=(0.5 * torch.randn(batch, steps, G, N)).to(dtype),
        C=(0.5 * torch.randn(batch, steps, G, N)).to(dtype), D=torch.randn(D_inner).to(dtype) if with_D else None,
        z=torch.randn(batch, steps, D_inner).to(dtype) if with_z else None,
        dt_bias=(0.5 * torch.randn(D_inner)).to(dtype) if with_bias else None, dt_softplus=softplus,
        ssm_states=torch.randn(num_slots, D_inner, N).to(pool_dtype),
        state_indices=distinct_slots(batch, num_slots, pad_rows=pad_rows), disable_state_update=disable,
        intermediate_states=torch.full((batch + 1, steps, D_inner, N), 7.0) if inter else None,
    )


def pad_rows_for(lens):
    return (len(lens) - 1,) if len(lens) >= 3 else ()


def check_pool(actual, expected, before, written_slots, tol_dtype, msg=""):
    """Written slots close to the reference, every other slot bit-identical to before."""
    written = [s for s in written_slots if s >= 0]
    for s in range(actual.shape[0]):
        if s in written:
            assert_close(actual[s], expected[s], tol_dtype, msg=f"{msg} slot {s}")
        else:
            assert torch.equal(actual[s], before[s]), f"{msg}: untouched slot {s} changed"


def check_scan(inp, chunk_size, y, chunk_states, tol_dtype):
    """y, pool and chunk states of one scan call (``inp`` holds the pool after it) against the reference."""
    before = inp["_before"]
    ref_inp = dict(inp, ssm_states=before)
    y_ref, states_ref, history = mamba1_scan_reference(*(ref_inp[k] for k in SCAN_ORDER))
    assert y.dtype == inp["x"].dtype and y.shape == inp["x"].shape
    assert_close(y, y_ref, tol_dtype)
    lens = (inp["cu_seqlens"][1:] - inp["cu_seqlens"][:-1]).tolist()
    slots = inp["state_indices"].tolist()
    written = [s for s, n in zip(slots, lens) if n > 0]
    check_pool(inp["ssm_states"], states_ref, before, written, tol_dtype)
    T, batch = inp["x"].shape[0], len(lens)
    assert chunk_states.shape == (_varlen.max_chunk_rows(T, batch, chunk_size), *inp["ssm_states"].shape[1:])
    offsets = _varlen.chunk_row_offsets(inp["cu_seqlens"], chunk_size).tolist()
    used = set()
    for b, n in enumerate(lens):
        for j in range((n + chunk_size - 1) // chunk_size):
            row = offsets[b] + j
            used.add(row)
            if slots[b] < 0:
                assert torch.equal(chunk_states[row], torch.zeros_like(chunk_states[row]))
            else:
                assert_close(chunk_states[row], history[b][j * chunk_size], tol_dtype, msg=f"req {b} chunk {j}")
    for row in set(range(chunk_states.shape[0])) - used:
        assert torch.equal(chunk_states[row], torch.zeros_like(chunk_states[row])), f"unused row {row}"


def run_scan(inp, chunk_size, output_chunk_states=True):
    inp["_before"] = inp["ssm_states"].clone()
    return mamba1_selective_scan(*(inp[k] for k in SCAN_ORDER), chunk_size, output_chunk_states, A_is_log=False, ssm_scales=None)


# --------------------------------------------------------------------------------------------
# mamba1_selective_scan
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lens", VARLEN_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selective_scan_matches_reference(lens, dtype):
    inp = make_scan(lens, dtype=dtype, pool_dtype=dtype, pad_rows=pad_rows_for(lens))
    y, cs = run_scan(inp, 16)
    check_scan(inp, 16, y, cs, dtype)


@pytest.mark.parametrize(
    "lens,chunk_size,opts",
    [
        ([9, 0, 20], 4, dict(with_D=False, with_z=False, with_bias=False)),
        ([3, 17], 64, dict(softplus=False, init=[True, True])),
        ([33, 2, 8], 8, dict(N=16, D_inner=5, init=[False, False, False])),
        ([19, 0, 6], 4, dict(G=3, pad_rows=(1,))),  # B/C groups (Zamba's heads)
    ],
)
def test_selective_scan_variants(lens, chunk_size, opts):
    inp = make_scan(lens, **opts)
    y, cs = run_scan(inp, chunk_size)
    check_scan(inp, chunk_size, y, cs, torch.float32)


def test_selective_scan_split_prefill_equals_one_call():
    """Chunked prefill: the second call continues from the state the first one wrote."""
    inp = make_scan([40], init=[False])
    y_full, _ = run_scan(dict(inp, ssm_states=inp["ssm_states"].clone()), 8)
    first = {k: (v[:24] if k in ("x", "dt", "B", "C", "z") else v) for k, v in inp.items()}
    first["cu_seqlens"] = cu_seqlens_of([24])
    y1, _ = run_scan(first, 8)
    second = {k: (v[24:] if k in ("x", "dt", "B", "C", "z") else v) for k, v in inp.items()}
    second.update(cu_seqlens=cu_seqlens_of([16]), has_initial_state=torch.tensor([True]),
                  ssm_states=first["ssm_states"])
    y2, _ = run_scan(second, 8)
    assert_close(torch.cat([y1, y2]), y_full)


def test_no_chunk_states_and_A_log():
    """``A_is_log``: the op takes the model's ``A_log`` (any float dtype) and negates ``exp`` of it."""
    inp = make_scan([5, 11])
    a_log = torch.log(-inp["A"]).to(torch.bfloat16)
    inp["_before"] = inp["ssm_states"].clone()
    y, cs = mamba1_selective_scan(*(a_log if k == "A" else inp[k] for k in SCAN_ORDER), 4, False, True, ssm_scales=None)
    assert cs.shape == (0, 12, 8)
    ref = dict(inp, A=-torch.exp(a_log.float()))
    y_ref, states_ref, _ = mamba1_scan_reference(*(dict(ref, ssm_states=inp["_before"])[k] for k in SCAN_ORDER))
    assert_close(y, y_ref)
    check_pool(inp["ssm_states"], states_ref, inp["_before"], inp["state_indices"].tolist(), torch.float32)


@pytest.mark.parametrize("T,D_inner,N,with_D,with_bias", [(23, 12, 8, True, True), (7, 6, 16, False, False)])
def test_selective_scan_matches_transformers(T, D_inner, N, with_D, with_bias):
    """HF's torch path of Mamba1 (``mamba_selective_scan``): one request, from zeros (HF's only start)."""
    from transformers.models.mamba.modeling_mamba import mamba_selective_scan

    inp = make_scan([T], D_inner=D_inner, N=N, with_D=with_D, with_bias=with_bias, init=[False])
    slot = int(inp["state_indices"][0])
    y_hf, final_hf = mamba_selective_scan(
        inp["x"].T[None], inp["dt"].T[None], inp["A"], inp["B"][:, 0].T[None], inp["C"][:, 0].T[None],
        D=inp["D"], z=inp["z"].T[None], delta_bias=inp["dt_bias"], delta_softplus=True, return_last_state=True,
    )
    y, _ = run_scan(inp, 16, output_chunk_states=False)
    assert_close(y, y_hf[0].T)
    assert_close(inp["ssm_states"][slot], final_hf[0])


# --------------------------------------------------------------------------------------------
# mamba1_state_update
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "batch,steps,opts",
    [
        (3, 1, dict(pad_rows=(1,), inter=False)),
        (2, 4, dict(disable=True)),
        (4, 3, dict(pad_rows=(0, 3), with_D=False, with_z=False, with_bias=False)),
        (3, 2, dict(G=4, pad_rows=(2,))),
    ],
)
def test_state_update_matches_reference(dtype, batch, steps, opts):
    inp = make_update(batch, steps, dtype=dtype, pool_dtype=dtype, **opts)
    before = inp["ssm_states"].clone()
    inter_before = None if inp["intermediate_states"] is None else inp["intermediate_states"].clone()
    y_ref, states_ref, inter_ref = mamba1_state_update_reference(
        *(dict(inp, ssm_states=before, intermediate_states=inter_before)[k] for k in UPDATE_ORDER)
    )
    y = mamba1_state_update(*(inp[k] for k in UPDATE_ORDER), A_is_log=False, ssm_scales=None, intermediate_scales=None)
    assert y.dtype == dtype
    assert_close(y, y_ref, dtype)
    written = [] if inp["disable_state_update"] else inp["state_indices"].tolist()
    check_pool(inp["ssm_states"], states_ref, before, written, dtype)
    if inter_ref is not None:
        assert_close(inp["intermediate_states"], inter_ref, dtype)


def test_verify_intermediates_equal_single_decode_steps():
    """L verify steps with intermediates == L single decode steps, state after each."""
    inp = make_update(3, 4, pad_rows=(2,))
    dec = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inp.items()}
    inp["disable_state_update"] = True
    y = mamba1_state_update(*(inp[k] for k in UPDATE_ORDER), A_is_log=False, ssm_scales=None, intermediate_scales=None)
    for t in range(4):
        step = {k: (v[:, t : t + 1] if k in ("x", "dt", "B", "C", "z") else v) for k, v in dec.items()}
        step["intermediate_states"] = None
        y_t = mamba1_state_update(*(step[k] for k in UPDATE_ORDER), A_is_log=False, ssm_scales=None, intermediate_scales=None)
        assert_close(y[:, t], y_t[:, 0])
        for b, slot in enumerate(inp["state_indices"].tolist()):
            if slot >= 0:
                assert_close(inp["intermediate_states"][b, t], dec["ssm_states"][slot])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_update_matches_transformers(dtype):
    from transformers.models.mamba.modeling_mamba import mamba_selective_state_update

    inp = make_update(3, 1, dtype=dtype, inter=False)
    slots = inp["state_indices"].to(torch.int64)
    state = inp["ssm_states"][slots].clone().float()
    y_hf = mamba_selective_state_update(
        state, inp["x"][:, 0], inp["dt"][:, 0], inp["A"], inp["B"][:, 0, 0], inp["C"][:, 0, 0], inp["D"],
        z=inp["z"][:, 0], dt_bias=inp["dt_bias"].float(), dt_softplus=True,
    )
    y = mamba1_state_update(*(inp[k] for k in UPDATE_ORDER), A_is_log=False, ssm_scales=None, intermediate_scales=None)
    assert_close(y[:, 0], y_hf, dtype)
    assert_close(inp["ssm_states"][slots], state, dtype)


# --------------------------------------------------------------------------------------------
# opcheck, invalid input, torch.compile
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "lens,chunk_size,opts,out_chunks",
    [
        ([0, 7, 1], 4, dict(pad_rows=(2,)), True),
        ([5, 12], 4, dict(with_D=False, with_z=False, with_bias=False), False),
        ([3, 9], 8, dict(dtype=torch.bfloat16, pool_dtype=torch.bfloat16), True),
    ],
)
def test_selective_scan_opcheck(lens, chunk_size, opts, out_chunks):
    inp = make_scan(lens, **opts)
    run_opcheck(torch.ops.hybrid_compile.mamba1_selective_scan.default,
                tuple(inp[k] for k in SCAN_ORDER) + (chunk_size, out_chunks, False))


@pytest.mark.parametrize(
    "batch,steps,opts", [(3, 1, dict(pad_rows=(1,), inter=False)), (2, 3, dict(disable=True)),
                         (2, 2, dict(with_D=False, with_z=False, with_bias=False, dtype=torch.bfloat16))],
)
def test_state_update_opcheck(batch, steps, opts):
    inp = make_update(batch, steps, **opts)
    run_opcheck(torch.ops.hybrid_compile.mamba1_state_update.default, tuple(inp[k] for k in UPDATE_ORDER) + (False,))
    a_log = torch.log(-inp["A"]).to(inp["x"].dtype)
    run_opcheck(torch.ops.hybrid_compile.mamba1_state_update.default,
                tuple(a_log if k == "A" else inp[k] for k in UPDATE_ORDER) + (True,))


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(A=torch.zeros(12, 7)), "A"),
        (dict(B=torch.zeros(16, 8)), "B"),
        (dict(B=torch.zeros(16, 5, 8), C=torch.zeros(16, 5, 8)), "multiple of the number of B/C groups"),
        (dict(ssm_states=torch.zeros(9, 12, 8, dtype=torch.float8_e4m3fn)), "ssm_states"),
        (dict(state_indices=torch.tensor([3, 3], dtype=torch.int32)), "state_indices"),
        (dict(cu_seqlens=torch.tensor([0, 5, 20], dtype=torch.int32)), "cu_seqlens"),
    ],
)
def test_selective_scan_invalid(changes, match):
    inp = make_scan([5, 11])
    inp.update(changes)
    with pytest.raises((ValueError, TypeError), match=match):
        mamba1_selective_scan(*(inp[k] for k in SCAN_ORDER), 8, True, A_is_log=False, ssm_scales=None)


def test_state_update_invalid():
    inp = make_update(2, 3)
    inp["intermediate_states"] = torch.zeros(2, 2, 12, 8)
    with pytest.raises(ValueError, match="intermediate_states"):
        mamba1_state_update(*(inp[k] for k in UPDATE_ORDER), A_is_log=False, ssm_scales=None, intermediate_scales=None)


def test_compile_prefill_then_decode():
    pre = make_scan([9, 0, 20, 5], pad_rows=(3,), init=[True, True, False, True])
    dec = make_update(4, 2, pad_rows=(3,))
    dec["state_indices"] = pre["state_indices"].clone()

    def fn(x, dt, A, B, C, D, z, dt_bias, ssm_states, cu, idx, has_init, xd, dtd, Bd, Cd, zd, inter):
        y, cs = torch.ops.hybrid_compile.mamba1_selective_scan(
            x, dt, A, B, C, D, z, dt_bias, True, ssm_states, cu, idx, has_init, 8, True, A_is_log=False, ssm_scales=None,
        )
        yd = torch.ops.hybrid_compile.mamba1_state_update(
            xd, dtd, A, Bd, Cd, D, zd, dt_bias, True, ssm_states, idx, False, inter, A_is_log=False, ssm_scales=None, intermediate_scales=None,
        )
        return y * 2, cs, yd + 1

    args = [pre[k] for k in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "ssm_states", "cu_seqlens",
                             "state_indices", "has_initial_state")]
    args += [dec[k] for k in ("x", "dt", "B", "C", "z", "intermediate_states")]
    eager, compiled, eager_args, compiled_args = compile_and_compare(fn, *args)
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e, atol=TOLERANCE[torch.float32][0], rtol=TOLERANCE[torch.float32][1])
    assert_close(compiled_args[8], eager_args[8])
    assert_close(compiled_args[-1], eager_args[-1])
    assert not torch.equal(eager_args[8], pre["ssm_states"])


# --------------------------------------------------------------------------------------------
# draft trees (parent_indices)
# --------------------------------------------------------------------------------------------

# two trees of 6 nodes (node 0 = the root, the request's pending token) and a chain
TREES = [[-1, 0, 0, 1, 2, 1], [-1, 0, 1, 0, 3, 3], [-1, 0, 1, 2, 3, 4]]


def make_tree_update(dtype=torch.float32, G=1, **opts):
    """Verify inputs over the rows of ``TREES`` (row 0 padding) and their parents."""
    inp = make_update(3, 6, dtype=dtype, pool_dtype=dtype, G=G, D_inner=12, pad_rows=(0,), disable=True, **opts)
    return inp, torch.tensor(TREES, dtype=torch.int32)


def tree_oracle(inp, parents):
    """Every node's root path run as a CHAIN through the per-token reference: (y, states) of the
    node are the chain's last step (ops/reference/tree.py knows nothing of how the op walks trees)."""
    def chain(b, xs, n):
        x, dt, B, C, *z = xs
        y, _, st = mamba1_state_update_reference(
            x, dt, inp["A"], B, C, inp["D"], z[0] if z else None, inp["dt_bias"], inp["dt_softplus"],
            inp["ssm_states"], inp["state_indices"][b:b + 1], True,
            torch.zeros(1, n, *inp["intermediate_states"].shape[2:]))
        return y, st

    per_token = [inp[k] for k in ("x", "dt", "B", "C", "z") if inp[k] is not None]
    return ref_tree.tree_by_paths(chain, per_token, parents)


@pytest.mark.parametrize("dtype,G", [(torch.float32, 1), (torch.float32, 4), (torch.bfloat16, 1)])
def test_state_update_tree_matches_chain_reference_per_path(dtype, G):
    inp, parents = make_tree_update(dtype, G)
    want_y, want_states = tree_oracle(inp, parents)
    ref = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inp.items()}
    y_ref, pool_ref, inter_ref = mamba1_state_update_reference(*(ref[k] for k in UPDATE_ORDER), parents)
    got = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inp.items()}
    y = mamba1_state_update(*(got[k] for k in UPDATE_ORDER), False, None, None, parents)
    real = [1, 2]
    # (the tree references read bf16 parents as stored, the chain keeps fp32 between steps)
    assert_close(y_ref[real], want_y[real], dtype)
    assert_close(inter_ref[real], want_states[real], dtype)
    assert_close(y[real], y_ref[real], dtype)
    assert_close(got["intermediate_states"][real], inter_ref[real], dtype)
    assert torch.all(y[0] == 0)
    assert torch.all(got["intermediate_states"][0] == 7.0) and torch.all(got["intermediate_states"][3] == 7.0)
    assert torch.equal(got["ssm_states"], inp["ssm_states"]) and torch.equal(pool_ref, inp["ssm_states"])


def test_state_update_chain_parents_equal_no_parents():
    inp, _ = make_tree_update()
    chain = torch.tensor([[-1, 0, 1, 2, 3, 4]] * 3, dtype=torch.int32)
    a = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inp.items()}
    b = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inp.items()}
    y_a = mamba1_state_update(*(a[k] for k in UPDATE_ORDER), False, None, None, chain)
    y_b = mamba1_state_update(*(b[k] for k in UPDATE_ORDER), False, None, None, None)
    assert torch.equal(y_a, y_b) and torch.equal(a["intermediate_states"], b["intermediate_states"])


def test_state_update_tree_opcheck():
    inp, parents = make_tree_update()
    run_opcheck(torch.ops.hybrid_compile.mamba1_state_update.default,
                tuple(inp[k] for k in UPDATE_ORDER) + (False, None, None, parents))


def test_state_update_tree_invalid():
    inp, parents = make_tree_update()
    args = lambda d: tuple(d[k] for k in UPDATE_ORDER)  # noqa: E731
    with pytest.raises(ValueError, match="parent precedes"):
        mamba1_state_update(*args(inp), False, None, None, torch.tensor([[-1, 1, 0, 0, 0, 0]] * 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="disable_state_update"):
        mamba1_state_update(*args(dict(inp, disable_state_update=False)), False, None, None, parents)
    with pytest.raises(ValueError, match="intermediate buffer"):
        mamba1_state_update(*args(dict(inp, intermediate_states=None)), False, None, None, parents)
    with pytest.raises(ValueError, match="parent_indices"):
        mamba1_state_update(*args(inp), False, None, None, parents[:, :4])
