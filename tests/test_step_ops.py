"""The engine's per-step ops (issue 5): ``uniform_step_metadata`` (hybrid_compile/ops/metadata.py,
Triton kernel in ops/triton/metadata.py) and ``argmax_rows`` (ops/sampling.py, ops/triton/sampling.py).

- Both the plain-torch op and the Triton launcher (Triton's interpreter on CPU) write exactly what
  a literal per-request, per-token loop writes, for decode (1 token per request) and verify-like
  (3 tokens) steps with padding rows (also between real rows), device ids, long cached prefixes;
  bad staging raises.
- ``argmax_rows`` equals ``torch.argmax`` (ties to the first index, NaN wins) for fp32/bf16/fp16,
  strided rows, rows spanning several blocks.
- opcheck on both ops; the ``gpu`` tests run the registered CUDA kernels at model shapes, the
  argmax inside a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

import hybrid_compile  # noqa: F401
from hybrid_compile.ops import metadata as md_ops
from hybrid_compile.ops.triton import metadata as tmeta
from hybrid_compile.ops.triton import sampling as tsamp
from op_testing import run_opcheck

# CPU tests here call the launchers on CPU tensors under Triton's interpreter (see conftest).
INTERPRETER_ONLY = True

ops = torch.ops.hybrid_compile
PADDING_SLOT = 0


# --------------------------------------------------------------------------------------------
# uniform_step_metadata
# --------------------------------------------------------------------------------------------


def _step(kinds, steps, *, width=48, num_rows=9, seed=0, device="cpu", ids_on_device=0, masked=0):
    """(args of the op, req_to_token) for requests described by ``kinds``: a cached length per
    real request, None per padding request; ``masked``: each real request's last tokens of KV slot
    -1 (an MTP head's window)."""
    g = torch.Generator().manual_seed(seed)
    req_to_token = torch.randint(1, 10_000, (num_rows, width), generator=g, dtype=torch.int32)
    slots = torch.randperm(num_rows, generator=g).tolist()
    rows, start = [], 0
    for i, prefix in enumerate(kinds):
        if prefix is None:
            rows.append(md_ops.padding_row(start, steps))
            start += steps
            continue
        kv = torch.randint(1, 10_000, (steps,), generator=g).tolist()
        kv[steps - masked:] = [-1] * masked
        ids = torch.randint(0, 500, (steps,), generator=g).tolist()
        rows.append(md_ops.staged_row(slots[i], prefix, start, int(torch.randint(0, 7, (1,), generator=g)),
                                      prefix + 1, kv, ids))
        start += prefix + steps
    R = len(kinds)
    staged = torch.tensor(rows, dtype=torch.int64).reshape(R, md_ops.staged_width(steps))
    ids_src = torch.randint(500, 600, (ids_on_device,), generator=g) if ids_on_device else None
    n = R * steps
    outputs = [torch.full((n,), -7, dtype=torch.int64) for _ in range(4)]
    outputs += [torch.full((R + 1,), -7, dtype=torch.int32)]
    outputs += [torch.full((R,), -7, dtype=torch.int32) for _ in range(4)]
    outputs += [torch.ones(R, dtype=torch.bool), torch.full((R + 1,), -7, dtype=torch.int32),
                torch.full((start + 5,), -7, dtype=torch.int32)]
    args = [staged, ids_src, steps, PADDING_SLOT, req_to_token, *outputs]
    return [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]


def _literal(staged, ids_src, steps, padding_slot, req_to_token, *outputs):
    """What the op writes, request by request and token by token."""
    r2t = req_to_token.clone()
    ids, pos, ocl, logits, qsl, seq, pre, prompt, mamba, init, indptr, kv = [], [], [], [], [0], [], [], [], [], [], [0], []
    src = ids_src.tolist() if ids_src is not None else []
    for r, row in enumerate(staged.tolist()):
        slot, p, start, m, pl = row[:5]
        new, staged_ids = row[5: 5 + steps], row[5 + steps:]
        for j in range(steps):
            t = r * steps + j
            ids.append(src[t] if t < len(src) else staged_ids[j])
            pos.append(p + j)
            ocl.append(new[j])
            logits.append(t)
        qsl.append((r + 1) * steps)
        seq.append(p + steps)
        pre.append(p)
        prompt.append(pl)
        mamba.append(m)
        init.append(p > 0)
        assert len(kv) == start
        if slot >= 0:
            for j in range(steps):
                r2t[slot, p + j] = new[j] if new[j] >= 0 else padding_slot  # a masked token
            kv += r2t[slot, : p + steps].tolist()
        else:
            kv += [padding_slot] * steps
        indptr.append(start + p + steps)
    return r2t, [ids, pos, ocl, logits, qsl, seq, pre, prompt, mamba, init, indptr, kv]


def _assert_written(args, want_r2t, want):
    r2t, outputs = args[4], args[5:]
    assert torch.equal(r2t.cpu(), want_r2t)
    for name, got, w in zip(("input_ids", "positions", "out_cache_loc", "logits_indices", "query_start_loc",
                             "seq_lens", "prefix_lens", "prompt_lens", "mamba_cache_indices", "has_initial_state",
                             "kv_indptr"), outputs, want):
        assert got.tolist() == w, name
    kv = outputs[-1].cpu()
    assert kv[: len(want[-1])].tolist() == want[-1]
    assert (kv[len(want[-1]):] == -7).all()  # nothing past the step's entries


CASES = [
    ([5], 1, 0),
    ([0, 12, 3], 1, 3),  # device ids for every token
    ([4, None, 0, None], 1, 2),  # padding rows (also between real ones); ids of the first two tokens on the device
    ([40, 1], 1, 0),  # a cached length of several kv blocks would need BLOCK_KV; rows longer than one here
    ([2, 7, None, None], 3, 0),  # verify-like: 3 tokens per request
    ([None], 3, 0),
]


@pytest.mark.parametrize("kinds,steps,on_device", CASES)
@pytest.mark.parametrize("impl", ["op", "triton"])
def test_uniform_step_metadata_equals_literal_loop(kinds, steps, on_device, impl):
    args = _step(kinds, steps, ids_on_device=on_device)
    want_r2t, want = _literal(*args)
    (ops.uniform_step_metadata if impl == "op" else tmeta.uniform_step_metadata_triton)(*args)
    _assert_written(args, want_r2t, want)


def test_uniform_step_metadata_copies_long_prefixes_in_blocks(monkeypatch):
    """Cached lengths across several ``BLOCK_KV`` blocks of the kernel (shrunk to 8 here)."""
    monkeypatch.setattr(tmeta, "_BLOCK_KV", 8)
    args = _step([37, 8, 16, None], 1, width=64)
    want_r2t, want = _literal(*args)
    tmeta.uniform_step_metadata_triton(*args)
    _assert_written(args, want_r2t, want)


def test_uniform_step_metadata_no_rows():
    args = _step([], 1)
    ops.uniform_step_metadata(*args)
    assert args[9].tolist() == [0] and args[15].tolist() == [0]  # query_start_loc, kv_indptr


def test_uniform_step_metadata_rejects_bad_staging():
    def run(mutate, match, error=ValueError):
        args = _step([3, 2], 1)
        mutate(args)
        with pytest.raises(error, match=match):
            ops.uniform_step_metadata(*args)

    def repeat_slot(a):
        a[0][1, 0] = a[0][0, 0]

    def bad_start(a):
        a[0][1, 2] += 1

    def short_kv(a):
        a[16] = a[16][:5]

    def slot_out_of_range(a):
        a[0][0, 0] = 9

    def padding_with_prefix(a):
        a[0][1, 0] = -1

    def prefix_past_row(a):
        a[0][1, 1] = 48  # 48 + 1 tokens past a row of 48
        a[0][1, 2] = 4  # still consistent with row 0's end

    def wrong_width(a):
        a[0] = a[0][:, :-1]

    def wrong_dtype(a):
        a[6] = a[6].to(torch.int32)

    def too_many_ids(a):
        a[1] = torch.zeros(3, dtype=torch.int64)

    run(repeat_slot, "repeated request slots")
    run(bad_start, "kv_start")
    run(short_kv, "kv_indices")
    run(slot_out_of_range, "request slots", IndexError)
    run(padding_with_prefix, "0 for padding")
    run(prefix_past_row, "req_to_token row")
    run(wrong_width, "staged")
    run(wrong_dtype, "positions")
    run(too_many_ids, "ids_src")
    with pytest.raises(ValueError, match="steps"):
        ops.uniform_step_metadata(*_step([1], 1)[:2], 0, *_step([1], 1)[3:])


def test_uniform_step_metadata_opcheck():
    run_opcheck(ops.uniform_step_metadata.default, tuple(_step([4, None, 0], 1, ids_on_device=2)))
    run_opcheck(ops.uniform_step_metadata.default, tuple(_step([2, 7, None], 3)))


# --------------------------------------------------------------------------------------------
# argmax_rows
# --------------------------------------------------------------------------------------------


def _logits(B, V, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(B, V, generator=g) * 3).to(dtype)
    if B > 1 and V > 70:
        x[0, 5] = x[0, 66] = x[0].max() + 1  # a tie across blocks: the first index wins
        x[1, 3] = float("nan")
        x[1, 70] = float("nan")  # the first NaN wins
    if B > 2:
        x[2] = float("-inf")  # every entry -inf: index 0
    if B > 3:
        x[3, -1] = float("inf")
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B,V", [(1, 7), (5, 200), (4, 700)])
def test_argmax_rows_equals_torch_argmax(B, V, dtype, monkeypatch):
    monkeypatch.setattr(tsamp, "_BLOCK_V", 64)  # several blocks per row even for the small vocabularies
    x = _logits(B, V, dtype)
    want = x.argmax(dim=-1)
    assert torch.equal(ops.argmax_rows(x), want)
    assert torch.equal(tsamp.argmax_rows_triton(x), want)
    wide = torch.cat([x, _logits(B, 5, dtype, seed=1)], dim=1)[:, :V]  # strided rows
    assert torch.equal(tsamp.argmax_rows_triton(wide), want)


def test_argmax_rows_default_block_and_empty_batch():
    x = _logits(1, 4200, torch.bfloat16)  # two blocks of the default 4096
    assert torch.equal(tsamp.argmax_rows_triton(x), x.argmax(-1))
    empty = torch.zeros(0, 10)
    assert tsamp.argmax_rows_triton(empty).shape == (0,) and ops.argmax_rows(empty).shape == (0,)
    with pytest.raises(ValueError, match="empty"):
        ops.argmax_rows(torch.zeros(2, 0))
    with pytest.raises(ValueError, match="2 dims"):
        ops.argmax_rows(torch.zeros(3))


def test_argmax_rows_opcheck():
    run_opcheck(ops.argmax_rows.default, (_logits(3, 300, torch.bfloat16),))


# --------------------------------------------------------------------------------------------
# GPU: the registered CUDA kernels at model shapes
@pytest.mark.parametrize("impl", ["op", "triton"])
def test_uniform_step_metadata_masked_tokens_get_the_padding_slot(impl):
    """A real request's tokens of KV slot -1 (an MTP head's window rows past the valid ones): K/V
    not stored (out_cache_loc -1), the padding slot in req_to_token and kv_indices, never -1."""
    args = _step([3, None, 0, 6], 4, ids_on_device=0, masked=2)
    want_r2t, want = _literal(*args)
    (ops.uniform_step_metadata if impl == "op" else tmeta.uniform_step_metadata_triton)(*args)
    _assert_written(args, want_r2t, want)
    staged, r2t, ocl, kv = args[0], args[4], args[7], args[-1]
    assert ocl.view(4, 4)[:, 2:].eq(-1).all()
    for slot, p in ((int(staged[0, 0]), 3), (int(staged[3, 0]), 6)):
        assert r2t[slot, p + 2: p + 4].eq(PADDING_SLOT).all()
    assert kv[: len(want[-1])].ge(0).all()


# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.smoke
def test_cuda_uniform_step_metadata_at_serving_shapes():
    g = torch.Generator().manual_seed(3)
    for steps, R, masked in ((1, 1, 0), (1, 64, 0), (4, 16, 0), (4, 16, 3)):
        kinds = [int(torch.randint(0, 3000, (1,), generator=g)) for _ in range(R - 2)] + [None, None] if R > 2 else [2000]
        args = _step(kinds, steps, width=4096, num_rows=80, device="cuda", ids_on_device=0 if masked else R // 2,
                     masked=masked)
        want_r2t, want = _literal(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args])
        ops.uniform_step_metadata(*args)
        torch.cuda.synchronize()
        _assert_written(args, want_r2t, want)
    run_opcheck(ops.uniform_step_metadata.default, tuple(_step([5, None, 900], 2, width=1024, device="cuda")))


@pytest.mark.gpu
@pytest.mark.smoke
def test_cuda_argmax_rows_at_vocab_shapes_and_in_a_graph():
    for B in (1, 16, 64):
        x = _logits(B, 151936, torch.bfloat16, seed=B).cuda()
        assert torch.equal(ops.argmax_rows(x), x.argmax(-1))
    run_opcheck(ops.argmax_rows.default, (x,))
    static = x[:1].clone()
    out = ops.argmax_rows(static)  # warm
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.argmax_rows(static)
    for seed in (1, 2):
        static.copy_(_logits(1, 151936, torch.bfloat16, seed=seed + 10).cuda())
        graph.replay()
        assert torch.equal(out, static.argmax(-1))
