"""Triton kernels of Kimi Delta Attention (the per-channel gate ``g [..., H, K]``): the chunked
prefill pipeline of hybrid_compile/ops/triton/gdn_chunk.py with a per-channel gate (packed varlen
batch, chunk states, FP8 pool staging, decays that exp(-cumsum) would overflow) and the recurrent
kernel of hybrid_compile/ops/triton/gdn.py (verify / decode steps), against the plain-torch ops and
the per-token reference.

On CPU the launchers run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1) at
tiny shapes; the ``gpu`` tests run the registered CUDA ops at Kimi-Linear-48B shapes (H=32,
K=V=128), under opcheck and in a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_compile.ops import gdn
from hybrid_compile.ops._varlen import chunk_row_offsets
from hybrid_compile.ops.reference import gdn as ref
from hybrid_compile.ops.triton import gdn as tgdn
from op_testing import assert_close, cu_seqlens_of, distinct_slots, run_opcheck

# CPU tests here call the launchers on CPU tensors under Triton's interpreter (see conftest).
INTERPRETER_ONLY = True

ops = torch.ops.hybrid_compile
C = gdn.GDN_CHUNK_SIZE
NUM_SLOTS = 10


def make_inputs(lead, h, kd, vd, dtype, device="cpu", strength=0.4):
    q = torch.randn(*lead, h, kd).to(device=device, dtype=dtype)
    k = (torch.randn(*lead, h, kd) / kd ** 0.5).to(device=device, dtype=dtype)
    v = torch.randn(*lead, h, vd).to(device=device, dtype=dtype)
    g = (-torch.rand(*lead, h, kd) * strength - 0.01).to(device)
    beta = torch.rand(*lead, h).to(device)
    return q, k, v, g, beta


def make_pool(h, kd, vd, dtype=torch.float32, num_slots=NUM_SLOTS, device="cpu"):
    return (torch.randn(num_slots, h, kd, vd) * 0.5).to(device=device, dtype=dtype)


def tol(*dtypes):
    return torch.bfloat16 if torch.bfloat16 in dtypes or torch.float16 in dtypes else torch.float32


def _prefill_vs_reference(q, k, v, g, beta, pool, cu, slots, has_init, use_l2=True, dtype=torch.float32,
                          pool_dtype=None, chunk_states=True):
    """Run the op (its Triton path under the interpreter) and the per-token reference on copies of
    ``pool``; assert output, pool and chunk states close (``dtype`` / ``pool_dtype`` tolerances);
    return (output, pool after, chunk states)."""
    got_pool = pool.clone()
    o, cs = tgdn.chunk_gated_delta_rule_fp8_aware(q, k, v, g, beta, got_pool, cu, slots, has_init, use_l2, 0.0,
                                                  chunk_states)
    want_o, want_pool, want_cs = ref.chunk_gated_delta_rule_ref(q, k, v, g, beta, pool, cu, slots, has_init, use_l2,
                                                                0.0, chunk_states)
    assert_close(o, want_o, tol(dtype), msg="output")
    assert_close(got_pool, want_pool, tol(pool_dtype or dtype), msg="pool")
    assert_close(cs, want_cs, tol(dtype), msg="chunk states")  # bf16: bf16 MMA operands (as the GDN pipeline)
    return o, got_pool, cs


@pytest.mark.parametrize("lens,pad_rows", [([5], ()), ([0, 7, 1], (2,)), ([65, 0, 3], ()), ([130, 17, 64, 1], (1,))])
@pytest.mark.parametrize("dtype,pool_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)])
def test_chunk_prefill_matches_reference(lens, pad_rows, dtype, pool_dtype):
    h, kd, vd = 2, 8, 16
    T = sum(lens)
    q, k, v, g, beta = make_inputs((T,), h, kd, vd, dtype)
    pool = make_pool(h, kd, vd, pool_dtype)
    cu = cu_seqlens_of(lens)
    slots = distinct_slots(len(lens), NUM_SLOTS, pad_rows=pad_rows)
    has_init = torch.tensor([i % 2 == 0 for i in range(len(lens))])
    o, got_pool, cs = _prefill_vs_reference(q, k, v, g, beta, pool, cu, slots, has_init, dtype=dtype,
                                            pool_dtype=pool_dtype)
    written = {int(s) for s, n in zip(slots, lens) if int(s) >= 0 and n > 0}
    untouched = [i for i in range(NUM_SLOTS) if i not in written]
    assert torch.equal(got_pool[untouched], pool[untouched])  # padding rows and empty requests
    offs = chunk_row_offsets(cu, C)
    for r in pad_rows:
        assert torch.all(o[cu[r]:cu[r + 1]] == 0)
        n = -(-lens[r] // C)
        assert torch.all(cs[offs[r]:offs[r] + n] == 0)
    o_none, cs_none = tgdn.chunk_gated_delta_rule_fp8_aware(q, k, v, g, beta, pool.clone(), cu, slots, has_init,
                                                            True, 0.0, False)
    assert cs_none.shape[0] == 0 and torch.equal(o_none, o)


def test_chunk_prefill_grouped_heads():
    """Two value heads per q/k head (the op's grouped layout; Kimi itself has one head count)."""
    hk, hv, kd, vd = 1, 2, 16, 16
    q, k, _, _, _ = make_inputs((70,), hk, kd, vd, torch.float32)
    _, _, v, g, beta = make_inputs((70,), hv, kd, vd, torch.float32)
    pool = make_pool(hv, kd, vd)
    cu, slots, init = cu_seqlens_of([66, 4]), torch.tensor([1, 7], dtype=torch.int32), torch.tensor([True, False])
    _prefill_vs_reference(q, k, v, g, beta, pool, cu, slots, init)


def test_chunk_prefill_strong_decay_is_finite():
    """Decays down to exp(-300) within a 64-token chunk: every exponent in the kernel is a
    difference c_i - c_j (j <= i), so nothing overflows."""
    h, kd, vd = 2, 16, 16
    q, k, v, g, beta = make_inputs((80,), h, kd, vd, torch.float32, strength=10.0)
    pool = make_pool(h, kd, vd)
    cu, slots, init = cu_seqlens_of([80]), torch.tensor([4], dtype=torch.int32), torch.tensor([True])
    o, got_pool, _ = _prefill_vs_reference(q, k, v, g, beta, pool, cu, slots, init)
    assert torch.isfinite(o).all() and torch.isfinite(got_pool).all()


def _decay(T, h, kd, kind):
    """Per-channel log-decays: ``strong`` about -5 per token on every channel (exp(-cumsum) overflows
    fp32 within one chunk), ``mixed`` channels from almost none (-1e-3) to -8 per token."""
    if kind == "strong":
        return -5.0 + torch.randn(T, h, kd) * 0.5
    span = torch.logspace(-3, torch.log10(torch.tensor(8.0)).item(), kd)
    return -(span * (0.5 + torch.rand(T, h, kd)))


@pytest.mark.parametrize("kind,dtype,use_l2", [("strong", torch.float32, True), ("mixed", torch.float32, False),
                                               ("strong", torch.bfloat16, False), ("mixed", torch.bfloat16, True)])
def test_chunk_prefill_multichunk_varlen_decay(kind, dtype, use_l2):
    """Multi-chunk varlen batch (requests of 0 to 3 chunks, a padding request, initial states on
    some) with chunk states, K = 48 (two K blocks of the intra kernel, one masked) and V = 24, under
    decays whose inverse exp(-cumsum) overflows: the per-token reference, finite everywhere."""
    h, kd, vd = 2, 48, 24
    lens = [150, 0, 64, 1, 129, 40]
    T = sum(lens)
    q, k, v, _, beta = make_inputs((T,), h, kd, vd, dtype)
    g = _decay(T, h, kd, kind)
    assert float((-g[:64].sum(0)).max()) > 89  # exp(-c) would overflow fp32 within the first chunk
    pool = make_pool(h, kd, vd)
    cu = cu_seqlens_of(lens)
    slots = distinct_slots(len(lens), NUM_SLOTS, pad_rows=(5,))
    has_init = torch.tensor([True, False, True, False, True, True])
    o, got_pool, cs = _prefill_vs_reference(q, k, v, g, beta, pool, cu, slots, has_init, use_l2, dtype=dtype)
    assert torch.isfinite(o).all() and torch.isfinite(got_pool).all() and torch.isfinite(cs).all()
    assert torch.all(o[cu[5]:] == 0)  # the padding request
    offs = chunk_row_offsets(cu, C)
    assert torch.all(cs[offs[5]:] == 0)


@pytest.mark.parametrize("key,bk,kind", [("kda_intra_bk", 32, "mixed"), ("kda_intra_bk", 64, "mixed"),
                                         ("kda_gram_bk", 32, "mild"), ("kda_gram_bk", 64, "mild")])
def test_chunk_prefill_k_block_tunable(monkeypatch, key, bk, kind):
    """Other K blocks of the intra kernel's block path (``gdn_chunk.CONFIG["kda_intra_bk"]``, default
    16; steep decays, so every chunk takes it) and of the chunk-wide gram kernel (``"kda_gram_bk"``,
    default 16; mild decays), both swept on the GPU by benchmarks/profile_gdn_chunk.py --kda: two K
    blocks of 32 (one masked) or one masked block of 64 at K = 48."""
    from hybrid_compile.ops.triton import gdn_chunk

    monkeypatch.setitem(gdn_chunk.CONFIG, key, bk)
    h, kd, vd = 1, 48, 16
    lens = [100, 30]
    q, k, v, _, beta = make_inputs((sum(lens),), h, kd, vd, torch.float32)
    g = _decay(sum(lens), h, kd, "mixed") if kind == "mixed" else _gate(sum(lens), h, kd, "mild")
    pool = make_pool(h, kd, vd)
    cu, slots, init = cu_seqlens_of(lens), torch.tensor([2, 5], dtype=torch.int32), torch.tensor([True, False])
    _prefill_vs_reference(q, k, v, g, beta, pool, cu, slots, init)


def _gate(T, h, kd, kind):
    """Per-channel log-decays for the intra kernel's two diagonal-block paths: ``mild`` (-0.01 to
    -0.41 a token: every 16-token block's cumsum spans < 64, the one-MMA path), ``steep`` (uniform
    in [-20, 0]: spans far past 64, the bisection; exp(c_i - ref) of a 16-row block would overflow
    fp32), ``patchy`` (mild, with 16 steep tokens every 40: both paths in one chunk)."""
    if kind == "mild":
        return -torch.rand(T, h, kd) * 0.4 - 0.01
    if kind == "steep":
        return -torch.rand(T, h, kd) * 20.0
    g = -torch.rand(T, h, kd) * 0.4 - 0.01
    steep = (torch.arange(T) % 40) < 16
    g[steep] = -torch.rand(int(steep.sum()), h, kd) * 20.0
    return g


@pytest.mark.parametrize("kind,mma_range,dtype", [("mild", None, torch.float32), ("mild", -1.0, torch.float32),
                                                  ("steep", None, torch.float32), ("patchy", None, torch.bfloat16),
                                                  ("patchy", -1.0, torch.bfloat16)])
def test_chunk_prefill_diag_block_paths(monkeypatch, kind, mma_range, dtype):
    """The diagonal 16x16 blocks of A / P: one MMA with a mid-value decay split where the block's
    cumsum spans <= ``CONFIG["kda_intra_mma_range"]`` (64), else four MMAs bisecting the block
    (forced everywhere by -1), on a varlen batch with chunk-boundary lengths (16, 63, 64, 65, 128 tokens,
    one of 1), against the per-token reference; finite for log-decays down to -20 a token."""
    from hybrid_compile.ops.triton import gdn_chunk

    monkeypatch.setitem(gdn_chunk.CONFIG, "kda_intra_mma_range", mma_range)
    h, kd, vd = 1, 32, 16
    lens = [64, 17, 128, 1, 63, 16, 65]
    T = sum(lens)
    q, k, v, _, beta = make_inputs((T,), h, kd, vd, dtype)
    g = _gate(T, h, kd, kind)
    pool = make_pool(h, kd, vd)
    cu = cu_seqlens_of(lens)
    slots = distinct_slots(len(lens), NUM_SLOTS)
    has_init = torch.tensor([i % 2 == 1 for i in range(len(lens))])
    o, got_pool, cs = _prefill_vs_reference(q, k, v, g, beta, pool, cu, slots, has_init, dtype=dtype)
    assert torch.isfinite(o).all() and torch.isfinite(got_pool).all() and torch.isfinite(cs).all()
    if kind == "mild" and mma_range is None:  # the one-MMA path ran (the bisection rounds differently)
        monkeypatch.setitem(gdn_chunk.CONFIG, "kda_intra_mma_range", -1.0)
        o_exact, _ = tgdn.chunk_gated_delta_rule_fp8_aware(q, k, v, g, beta, pool.clone(), cu, slots, has_init, True,
                                                           0.0, False)
        assert not torch.equal(o, o_exact)
        assert_close(o, o_exact)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_prefill_chunk_wide_and_block_paths_in_one_call(monkeypatch, dtype):
    """A chunk whose decay spans <= 64 on every channel takes the chunk-wide 64x64 MMAs
    (``_chunk_kda_gram_kernel``), a steeper one the 16x16 blocks of the intra kernel, per (chunk,
    head) within one call: head 0 mild everywhere, head 1 mild in its first request and steep
    (every 16-token block past 64) in the second. Against the reference; and against a run with
    every chunk in blocks (``kda_intra_mma_range`` -1): head 1's steep request is bit-equal there
    (it took the blocks, whose steep diagonal blocks bisect either way), head 0 is not (it took the
    chunk-wide path)."""
    from hybrid_compile.ops.triton import gdn_chunk

    h, kd, vd = 2, 32, 16
    lens = [70, 128]  # the steep request in whole chunks: a partial one's empty 16-row blocks span 0
    T = sum(lens)
    q, k, v, _, beta = make_inputs((T,), h, kd, vd, dtype)
    g = _gate(T, h, kd, "mild")
    g[lens[0]:, 1] = _gate(lens[1], 1, kd, "steep")[:, 0]
    pool = make_pool(h, kd, vd)
    cu, slots, init = cu_seqlens_of(lens), torch.tensor([3, 6], dtype=torch.int32), torch.tensor([True, False])
    o, got_pool, cs = _prefill_vs_reference(q, k, v, g, beta, pool, cu, slots, init, dtype=dtype)
    monkeypatch.setitem(gdn_chunk.CONFIG, "kda_intra_mma_range", -1.0)
    o_blocks, cs_blocks = tgdn.chunk_gated_delta_rule_fp8_aware(q, k, v, g, beta, pool.clone(), cu, slots, init, True,
                                                                0.0, True)
    assert torch.equal(o[lens[0]:, 1], o_blocks[lens[0]:, 1])
    assert not torch.equal(o[:, 0], o_blocks[:, 0])
    assert_close(o, o_blocks, tol(dtype))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning", "ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_prefill_chunk_wide_up_to_its_range(monkeypatch, dtype):
    """Decays of -1.1 to -1.9 a token on every channel: a 64-token chunk spans ~96 (natural log), past
    the 16x16 blocks' 64 but within the chunk-wide path's ``CONFIG["kda_gram_range"]`` (128), whose
    factors then reach ``e^+-48`` and whose discarded entries above the diagonal overflow. Against the
    reference, finite; the chunk-wide path ran (not bit-equal to every chunk in blocks,
    ``kda_gram_range`` -1); a range of 64 puts these chunks in blocks (bit-equal to that run). (The
    interpreter's numpy warns of the discarded entries' overflow.)"""
    from hybrid_compile.ops.triton import gdn_chunk

    h, kd, vd = 2, 32, 16
    lens = [128, 64]
    T = sum(lens)
    q, k, v, _, beta = make_inputs((T,), h, kd, vd, dtype)
    g = -1.1 - torch.rand(T, h, kd) * 0.8
    assert 64 < float(-g[:64].sum(0).min()) and float(-g[:64].sum(0).max()) < 128
    pool = make_pool(h, kd, vd)
    cu, slots, init = cu_seqlens_of(lens), torch.tensor([1, 4], dtype=torch.int32), torch.tensor([True, False])
    o, got_pool, _ = _prefill_vs_reference(q, k, v, g, beta, pool, cu, slots, init, dtype=dtype)
    assert torch.isfinite(o).all() and torch.isfinite(got_pool).all()

    def run():
        return tgdn.chunk_gated_delta_rule_fp8_aware(q, k, v, g, beta, pool.clone(), cu, slots, init, True, 0.0,
                                                     False)[0]

    monkeypatch.setitem(gdn_chunk.CONFIG, "kda_gram_range", -1.0)  # every chunk in blocks
    o_blocks = run()
    assert not torch.equal(o, o_blocks)
    monkeypatch.setitem(gdn_chunk.CONFIG, "kda_gram_range", 64.0)
    assert torch.equal(run(), o_blocks)
    monkeypatch.setitem(gdn_chunk.CONFIG, "kda_gram_range", 200.0)
    with pytest.raises(ValueError, match="kda_gram_range"):
        run()


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning", "ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_prefill_split_channels(monkeypatch, dtype):
    """``CONFIG["kda_split_channels"]``: a chunk with a few channels steeper than the chunk-wide
    range takes the chunk-wide MMAs over the others and the 16x16 blocks over those few (gathered
    from a per-chunk list). K = 48 (three K blocks of 16): head 0 mild except channels 3, 17, 30 and
    41 (steep, scattered over the blocks), head 1 steep on every channel in its second request, mild
    elsewhere; a varlen batch with a partial chunk, a padding request and initial states. Against the
    per-token reference, finite; against the unsplit run: head 0's mixed chunks differ (they took the
    split), the chunks with no steep channel and those with every channel steep are bit-equal (the
    same path); with ``kda_gram_range`` -1 (every channel steep) split and unsplit are bit-equal."""
    from hybrid_compile.ops.triton import gdn_chunk

    h, kd, vd = 2, 48, 16
    lens = [128, 0, 64, 40]
    T = sum(lens)
    q, k, v, _, beta = make_inputs((T,), h, kd, vd, dtype)
    g = _gate(T, h, kd, "mild")
    steep_ch = [3, 17, 30, 41]
    g[:, 0, steep_ch] = -torch.rand(T, len(steep_ch)) * 20.0 - 3.0
    g[lens[0]:lens[0] + lens[2], 1] = _gate(lens[2], 1, kd, "steep")[:, 0] - 3.0
    pool = make_pool(h, kd, vd)
    cu = cu_seqlens_of(lens)
    slots = distinct_slots(len(lens), NUM_SLOTS, pad_rows=(1,))
    init = torch.tensor([True, False, False, True])

    def run():
        return tgdn.chunk_gated_delta_rule_fp8_aware(q, k, v, g, beta, pool.clone(), cu, slots, init, True, 0.0,
                                                     True)

    o_whole = run()[0]
    monkeypatch.setitem(gdn_chunk.CONFIG, "kda_split_channels", True)
    o, got_pool, cs = _prefill_vs_reference(q, k, v, g, beta, pool, cu, slots, init, dtype=dtype)
    assert torch.isfinite(o).all() and torch.isfinite(got_pool).all() and torch.isfinite(cs).all()
    assert torch.equal(o, run()[0])  # deterministic
    assert not torch.equal(o[:, 0], o_whole[:, 0])  # head 0: the split ran
    second = slice(lens[0], lens[0] + lens[2])
    assert torch.equal(o[second, 1], o_whole[second, 1])  # every channel steep: the blocks either way
    assert torch.equal(o[:lens[0], 1], o_whole[:lens[0], 1])  # no steep channel: the chunk-wide path
    assert_close(o, o_whole, tol(dtype))
    monkeypatch.setitem(gdn_chunk.CONFIG, "kda_gram_range", -1.0)
    o_split_blocks = run()[0]
    monkeypatch.setitem(gdn_chunk.CONFIG, "kda_split_channels", False)
    assert torch.equal(o_split_blocks, run()[0])


def test_chunk_prefill_diag_range_is_validated(monkeypatch):
    from hybrid_compile.ops.triton import gdn_chunk

    monkeypatch.setitem(gdn_chunk.CONFIG, "kda_intra_mma_range", 200.0)
    q, k, v, g, beta = make_inputs((5,), 1, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="kda_intra_mma_range"):
        tgdn.chunk_gated_delta_rule_fp8_aware(q, k, v, g, beta, make_pool(1, 16, 16), cu_seqlens_of([5]),
                                              torch.tensor([0], dtype=torch.int32), torch.tensor([False]), True, 0.0,
                                              False)


@pytest.mark.parametrize("disable", [False, True])
def test_verify_per_channel_matches_reference(disable):
    B, L, h, kd, vd = 3, 4, 2, 8, 8
    q, k, v, g, beta = make_inputs((B, L), h, kd, vd, torch.float32)
    pool = make_pool(h, kd, vd)
    slots = distinct_slots(B, NUM_SLOTS, pad_rows=(1,))
    inter = torch.zeros(B, L, h, kd, vd)
    got_pool, got_inter = pool.clone(), inter.clone()
    o = tgdn.fused_recurrent_gated_delta_rule_update_triton(q, k, v, g, beta, got_pool, slots, True, 0.0, disable,
                                                            got_inter)
    want_o, want_pool, want_inter = ref.fused_recurrent_gated_delta_rule_update_ref(q, k, v, g, beta, pool, slots,
                                                                                    True, 0.0, disable, inter)
    assert_close(o, want_o)
    assert_close(got_pool, want_pool)
    assert_close(got_inter, want_inter)


def test_fp8_pool_per_channel_prefill_and_verify():
    """``ssm_state_dtype="fp8"``: the plain op and the Triton kernel on an e4m3 pool (one scale per
    value column over K) equal the op on an fp32 pool holding the dequantized states, then quantized
    (the plain op bit for bit, Triton within one e4m3 step)."""
    from hybrid_compile.ops.fp8_cache import GDN_STATE_SCALE_DIM as DIM, dequantize_vectors, quantize_vectors

    h, kd, vd = 2, 16, 16
    lens = [70, 0, 9]
    q, k, v, g, beta = make_inputs((sum(lens),), h, kd, vd, torch.float32)
    cu = cu_seqlens_of(lens)
    slots = torch.tensor([3, 8, 6], dtype=torch.int32)
    init = torch.tensor([True, True, False])
    pq, ps = quantize_vectors(make_pool(h, kd, vd), DIM)
    ref_pool = dequantize_vectors(pq, ps, DIM)
    o_ref, cs_ref = ops.chunk_gated_delta_rule(q, k, v, g, beta, ref_pool, cu, slots, init, True, 0.0, True, ssm_scales=None)
    want_q, want_s = quantize_vectors(ref_pool[[3, 6]], DIM)
    for name in ("plain", "triton"):
        gq, gs = pq.clone(), ps.clone()
        if name == "plain":
            o, cs = ops.chunk_gated_delta_rule(q, k, v, g, beta, gq, cu, slots, init, True, 0.0, True, ssm_scales=gs)
        else:
            o, cs = tgdn.chunk_gated_delta_rule_fp8_aware(q, k, v, g, beta, gq, cu, slots, init, True, 0.0, True, gs)
        assert_close(o, o_ref, msg=name)
        assert_close(cs, cs_ref, msg=name)
        got = dequantize_vectors(gq[[3, 6]], gs[[3, 6]], DIM)
        want = dequantize_vectors(want_q, want_s, DIM)
        step = 0 if name == "plain" else 32
        assert bool(((got - want).abs() <= want_s.unsqueeze(DIM) * step + 1e-6).all()), name
        assert torch.equal(gq[8].view(torch.uint8), pq[8].view(torch.uint8))  # the empty request's slot


# ----------------------------------------------------------------------------------------------
# gpu: Kimi-Linear-48B shapes
# ----------------------------------------------------------------------------------------------

KIMI = (32, 128, 128)  # H, K, V
GPU_SLOTS = 64
GPU_LENS = [300, 0, 1, 63, 64, 65, 130, 17]  # request 5 is a padding row (the CPU oracle sets the size)
DEV = "cuda"  # the gpu tests' device (a module constant so their logic can be dry-run elsewhere)


def _sync():
    if torch.device(DEV).type == "cuda":
        torch.cuda.synchronize()


def _cpu(*xs):
    return [None if x is None else x.cpu() for x in xs]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,strength,cfg", [
    pytest.param(torch.bfloat16, 0.4, {}, marks=pytest.mark.smoke), (torch.float32, 0.4, {}), (torch.float16, 0.4, {}),
    (torch.bfloat16, 0.4, {"lowp": False}),
    (torch.bfloat16, 10.0, {}), (torch.bfloat16, 20.0, {}), (torch.float32, 20.0, {}),
    (torch.bfloat16, 0.4, {"kda_intra_mma_range": -1.0}), (torch.bfloat16, 0.4, {"kda_intra_bk": 32, "kda_intra_warps": 8}),
    (torch.bfloat16, 10.0, {"kda_intra_warps": 4}),
    (torch.bfloat16, 0.4, {"kda_intra_bk": 16, "kda_intra_warps": 8, "kda_intra_stages": 1}),
    (torch.bfloat16, 10.0, {"kda_intra_bk": 64}), (torch.bfloat16, 0.4, {"kda_gram_bk": 32}),
    (torch.float32, 0.4, {"kda_gram_bk": 32, "kda_gram_warps": 8}), (torch.bfloat16, 3.0, {}), (torch.float32, 3.0, {}),
    (torch.bfloat16, 0.4, {"kda_split_channels": True}), (torch.float32, 0.4, {"kda_split_channels": True}),
    (torch.bfloat16, 20.0, {"kda_split_channels": True})],
    ids=["bf16", "f32", "f16", "bf16-lowp-off", "bf16-s10", "bf16-s20", "f32-s20", "bisect", "bk32w8", "w4-s10", "bk16w8s1",
         "bk64-s10", "gram-bk32", "f32-gram-bk32w8", "bf16-s3", "f32-s3", "bf16-split", "f32-split", "bf16-s20-split"])
def test_gpu_chunk_prefill_matches_torch_op(monkeypatch, dtype, strength, cfg):
    """Kimi-Linear-48B shapes, the multi-chunk varlen batch of GPU_LENS, against the plain-torch op
    (itself checked against the per-token reference); ``strength`` 3: chunks spanning ~96 (the
    chunk-wide path past the 16x16 blocks' 64); 10 / 20: per-channel log-decays
    down to -10 / -20 a token, far past where exp(-cumsum) overflows (the intra kernel's diagonal
    blocks then mostly take the bisection); ``cfg``: other intra-kernel settings
    (``gdn_chunk.CONFIG``: the bisection everywhere, other K blocks / warps / stages); fp16 inputs and
    bf16 with ``lowp`` off run the fp32-intermediate path (its state kernel once needed more shared
    memory than sm_90 has). ``kda_split_channels``: every 8th channel steep (log-decays -3 to -23 a
    token) in a mild gate, so that every chunk splits its channels (16 of 128 in blocks)."""
    from hybrid_compile.ops.triton import gdn_chunk

    for key, val in cfg.items():
        monkeypatch.setitem(gdn_chunk.CONFIG, key, val)
    h, kd, vd = KIMI
    T = sum(GPU_LENS)
    q, k, v, g, beta = make_inputs((T,), h, kd, vd, dtype, DEV, strength=strength)
    if cfg.get("kda_split_channels"):
        g[..., ::8] = -torch.rand_like(g[..., ::8]) * 20.0 - 3.0
    pool = make_pool(h, kd, vd, device=DEV, num_slots=GPU_SLOTS)
    cu = cu_seqlens_of(GPU_LENS, DEV)
    slots = distinct_slots(len(GPU_LENS), GPU_SLOTS, pad_rows=(5,)).to(DEV)
    has_init = torch.tensor([i % 3 != 0 for i in range(len(GPU_LENS))], device=DEV)
    got_pool = pool.clone()
    o, cs = ops.chunk_gated_delta_rule(q, k, v, g, beta, got_pool, cu, slots, has_init, True, 0.0, True, ssm_scales=None)
    _sync()
    cargs = _cpu(q, k, v, g, beta)
    want_pool = pool.cpu()
    want_o, want_cs = gdn.chunk_gated_delta_rule(*cargs, want_pool, cu.cpu(), slots.cpu(), has_init.cpu(), True, 0.0,
                                                 True, ssm_scales=None)
    assert_close(o.cpu(), want_o, tol(dtype))
    assert_close(got_pool.cpu(), want_pool, tol(dtype))
    assert_close(cs.cpu(), want_cs, tol(dtype))


@pytest.mark.gpu
@pytest.mark.smoke
def test_gpu_verify_and_decode_step_per_channel_in_cuda_graph():
    h, kd, vd = KIMI
    B, L = 8, 3
    q, k, v, g, beta = make_inputs((B, L), h, kd, vd, torch.bfloat16, DEV)
    pool = make_pool(h, kd, vd, device=DEV, num_slots=GPU_SLOTS)
    slots = distinct_slots(B, GPU_SLOTS, pad_rows=(2,)).to(DEV)
    inter = torch.zeros(B, L, h, kd, vd, device=DEV)

    def verify():
        return ops.fused_recurrent_gated_delta_rule_update(q, k, v, g, beta, pool, slots, True, 0.0, True, inter, ssm_scales=None, intermediate_scales=None, parent_indices=None)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        verify()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = verify()
    for _ in range(2):
        nq, nk, nv, ng, nb = make_inputs((B, L), h, kd, vd, torch.bfloat16, DEV)
        for dst, src in ((q, nq), (k, nk), (v, nv), (g, ng), (beta, nb)):
            dst.copy_(src)
        inter.zero_()
        want_inter = torch.zeros(B, L, h, kd, vd)
        want = gdn.fused_recurrent_gated_delta_rule_update(*_cpu(q, k, v, g, beta), pool.cpu(), slots.cpu(), True,
                                                           0.0, True, want_inter, ssm_scales=None, intermediate_scales=None)
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out.cpu(), want, torch.bfloat16)
        assert_close(inter.cpu(), want_inter, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_opcheck_per_channel():
    h, kd, vd = 4, 128, 128
    q, k, v, g, beta = make_inputs((75,), h, kd, vd, torch.bfloat16, DEV)
    pool = make_pool(h, kd, vd, device=DEV)
    cu = cu_seqlens_of([70, 0, 5], DEV)
    slots = torch.tensor([3, 1, -1], dtype=torch.int32, device=DEV)
    has_init = torch.tensor([True, False, False], device=DEV)
    run_opcheck(ops.chunk_gated_delta_rule, (q, k, v, g, beta, pool, cu, slots, has_init, True, 0.0, True))
    vq, vk, vv, vg, vb = make_inputs((3, 2), h, kd, vd, torch.bfloat16, DEV)
    inter = torch.zeros(3, 2, h, kd, vd, device=DEV)
    run_opcheck(ops.fused_recurrent_gated_delta_rule_update, (vq, vk, vv, vg, vb, pool, slots, True, 0.0, False,
                                                              inter))
