"""The one-shot all-reduce op (``hybrid_compile::tp_all_reduce`` over symmetric memory,
``hybrid_compile/distributed/one_shot.py``) on 2 GPUs against NCCL's own all-reduce.

Two spawned ranks (NCCL, rank r on GPU r) map the op's buffer and all-reduce tensors that take each
of the op's paths: bf16 and fp32 tensors that fit the buffer (the one-shot kernel), one past it, one
whose bytes are not whole 16-byte vectors and an fp16 one (NCCL in the op). Each result must equal
``torch.distributed.all_reduce`` of the same inputs bit for bit (two ranks: one addition either
way), eagerly and replayed from a CUDA graph that captured the op (the decode graphs' case, with new
inputs copied in before the replay). Also opcheck on CUDA. The CPU suite covers the rule and the
op's gloo path (``tests/test_tensor_parallel.py::test_one_shot_all_reduce_option`` and
``::test_collectives_trace_into_one_graph``).
"""

from __future__ import annotations

import json

import pytest
import torch

from ports import free_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multi_gpu,
    pytest.mark.xdist_group("multi_gpu"),  # (with the tensor-parallel GPU tests: one multi-GPU group at a time)
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="the one-shot all-reduce needs 2 CUDA devices"),
]

# (name, shape, dtype, takes the one-shot kernel)
CASES = [
    ("bf16_decode_row", (1, 2048), torch.bfloat16, True),
    ("bf16_batch16", (16, 2048), torch.bfloat16, True),  # 64 KiB: the buffer's size
    ("fp32_norm_stats", (8, 4), torch.float32, True),
    ("bf16_past_the_buffer", (64, 2048), torch.bfloat16, False),
    ("bf16_odd_bytes", (3, 5), torch.bfloat16, False),
    ("fp16", (4, 2048), torch.float16, False),
]


def _rank_main(rank: int, port: int, result_path: str) -> None:
    import datetime

    import torch.distributed as dist

    from hybrid_compile.distributed import one_shot

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("nccl", store=store, rank=rank, world_size=2, device_id=device)
    group = dist.group.WORLD.group_name
    results = {}
    try:
        one_shot.enable(group, device)
        op = torch.ops.hybrid_compile.tp_all_reduce
        buffer = one_shot.buffer(group)
        for i, (name, shape, dtype, one) in enumerate(CASES):
            gen = torch.Generator(device=device).manual_seed(100 * i + rank)
            x = torch.randn(shape, generator=gen, device=device).to(dtype)
            want = x.clone()
            dist.all_reduce(want)
            eager = op(x, group)
            # captured in a CUDA graph, then replayed on new inputs copied into the captured one
            static = torch.zeros_like(x)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                op(static, group)  # warm-up on the capture stream
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = op(static, group)
            static.copy_(x)
            graph.replay()
            torch.cuda.synchronize()
            results[name] = dict(rule=one_shot.takes_one_shot(x, buffer) == one, eager=torch.equal(eager, want),
                                 graph=torch.equal(out, want))
            # (a graph that captured NCCL work must be gone before destroy_process_group, which
            # otherwise waits on it forever: the engine drops its graphs first for the same reason)
            del graph, out
        del buffer  # (the symmetric memory goes with the group's last reference, in disable below)
        torch.library.opcheck(op.default, (torch.randn(4, 256, device=device, dtype=torch.bfloat16), group))
        results["opcheck"] = True
        if rank == 0:  # (written before the teardown)
            with open(result_path, "w") as f:
                json.dump(results, f)
    finally:
        one_shot.disable(group)
        torch.cuda.synchronize()
        dist.destroy_process_group()


def test_one_shot_op_equals_nccl_eager_and_in_cuda_graphs(tmp_path):
    path = str(tmp_path / "one_shot.json")
    torch.multiprocessing.start_processes(_rank_main, args=(free_port(), path), nprocs=2, start_method="spawn")
    with open(path) as f:
        got = json.load(f)
    want = {name: dict(rule=True, eager=True, graph=True) for name, *_ in CASES}
    assert got == {**want, "opcheck": True}, got


def test_second_engine_of_a_process_keeps_nccl_and_serves(tmp_path):
    """A second tensor-parallel engine in one process (the first closed; its followers new processes):
    rank 0 mapped a symmetric buffer before and the new ranks did not, and torch numbers those
    exchanges per process, so "auto" serves on NCCL (stats say why) with the first engine's tokens,
    and an explicit "one_shot" is one error at start-up (it waited 300 s for the store, then failed)."""
    import hybrid_compile as hc
    from test_tensor_parallel import MODELS

    d = tmp_path / "ckpt"
    MODELS["qwen3_next_dense"]().save_pretrained(d)
    options = dict(tensor_parallel_size=2, device="cuda", dtype="bfloat16", tokenizer=False, compile=False)
    prompt = [[3, 14, 15, 9, 2, 6]]
    first = hc.from_pretrained(str(d), **options)
    try:
        assert first.stats()["tensor_parallel"]["all_reduce"]["mode"] == "one_shot"
        want = first.generate_batch(prompt, max_new_tokens=4)
    finally:
        first.close()
    second = hc.from_pretrained(str(d), **options)
    try:
        ar = second.stats()["tensor_parallel"]["all_reduce"]
        assert ar["mode"] == "nccl" and "per process" in ar["one_shot_unpaired"], ar
        assert second.generate_batch(prompt, max_new_tokens=4) == want
    finally:
        second.close()
    with pytest.raises(Exception, match="tensor_parallel_all_reduce='one_shot' cannot run here: the ranks' processes"):
        hc.from_pretrained(str(d), tensor_parallel_all_reduce="one_shot", **options)
