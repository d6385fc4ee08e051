"""Tensor parallelism with CUDA graphs on 2 (or 4) GPUs (NCCL): greedy tokens equal the single-GPU engine.

Every family with a sharding plan (``hybrid_compile/distributed/plans.py``) is served as a tiny
random-weight checkpoint, and Qwen3-Next (MoE) and NemotronH also at a mid size (hidden 1024,
8 layers; every other family too with ``HC_TP_GPU_ALL_MID=1``), with CUDA graphs on (the tiny
models in fp32: their random logits are so flat that bf16 rounding reorders more than the top
two; every MoE model, tiny or mid-size, in fp32 on our fused experts path, ``fused_moe=True``: in
bf16 a rounding of the router's input can swap an expert, which moves the logits far more than
any near-tie allowance; the mid-size models without experts in bf16):
``cuda_graphs=True`` (decode steps replay full graphs, prefill / mixed steps the pieces' graphs)
for every model, and ``"piecewise"`` alone (decode steps through the pieces' graphs too) for the
two mid-size models. Each case runs in one group of two
spawned ranks started the way torchrun starts them (rank r on GPU r; every rank calls
``hc.from_pretrained(dir, tensor_parallel_size=2)``, rank 0 drives), while this process serves
the same checkpoint on one GPU with the same options (the oracle). The two run on different
summation orders (the all-reduce adds the ranks' partial sums), so a divergence is accepted only
at a near tie of the fp32 model's top-2 logits (:func:`_assert_same_greedy`).

Every case takes the default all-reduce (``tensor_parallel_all_reduce="auto"``: the one-shot kernel
over symmetric memory up to 64 KiB, NCCL above) and checks that the one-shot kernel served it;
``mid_qwen3_5@nccl`` (Qwen3.5 dense, bf16) runs NCCL's alone.

Also checked: zero graph breaks and recompiles, full and piecewise graphs captured and replayed on
rank 0, one n-gram speculative case and one draft-tree case (top-k 2: tree mask and parents sent to
rank 1 with every verify graph's step) replaying full verify graphs, an FP8 checkpoint
(``qwen3_next_fp8@fp8_checkpoint``: each rank's e4m3 slices and block scales), MTP drafts from the checkpoint's
head (``@mtp``: Qwen3-Next MoE and Qwen3.5 with ``mtp.*`` tensors, the head sharded on every rank, its
steps replaying its piecewise graphs on every rank; ``@mtp_tree``: top-2 MTP draft trees;
``@mtp_token_map``: MTP drafts over a draft token map; run them
alone with ``-k mtp``), a draft model on rank 0 alone (``@draft_model`` / ``@draft_tree``: the checkpoint's
own weights as the draft, compiled with its own CUDA graphs), the prefix cache's host tier
(``qwen3_next_dense@host_tier``) and elastic pools (``@elastic``: memory moved to a small KV pool while
serving, every rank resizing and capturing its full graphs again), and no Triton kernel, Dynamo
graph or Inductor piece compiled after ``from_pretrained`` returned, on rank 0 (engine stats and
a Triton JIT hook) and on rank 1 (the same counters logged before every step command it receives,
compared at the command rank 0 had sent when its engine was ready and at the end).

Needs 2 CUDA devices (``multi_gpu`` marker; skipped with fewer). The module's tests share one
module fixture (one group of ranks), so they stay on one pytest-xdist worker
(``xdist_group``; ``scripts/gpu_tests.py`` runs ``--dist loadgroup``). A case takes 20-35 s on
2 H100s (compile, capture, warm-up; the first about 80 s with the imports), the mid-size ones
more, so the default set runs as two device commands of under 10 minutes each, then the other
mid-size families:

    python scripts/gpu_tests.py --workers 1 --time-limit 560 --out OUT/tp_a -- tests/test_tensor_parallel_gpu.py \
        -k "qwen3_next or qwen3_5 or nemotron_h"
    python scripts/gpu_tests.py --workers 1 --time-limit 560 --out OUT/tp_b -- tests/test_tensor_parallel_gpu.py \
        -k "not (qwen3_next or qwen3_5 or nemotron_h)"
    HC_TP_GPU_ALL_MID=1 python scripts/gpu_tests.py --workers 1 --time-limit 560 --out OUT/tp_mid \
        -- tests/test_tensor_parallel_gpu.py -k "mid_ and not mid_qwen3_next_moe and not mid_nemotron_h"

On a host with 4 GPUs the two halves run at once, each on its own pair of GPUs and each serving every
other case (``HC_TP_GPU_SHARD=i/n``: the cases at positions ``i, i + n, ...`` of the module's list;
each process's group sees only its ``CUDA_VISIBLE_DEVICES``):

    CUDA_VISIBLE_DEVICES=0,1 HC_TP_GPU_SHARD=0/2 python scripts/gpu_tests.py --workers 1 --time-limit 400 \
        --out OUT/tp_0 -- tests/test_tensor_parallel_gpu.py &
    CUDA_VISIBLE_DEVICES=2,3 HC_TP_GPU_SHARD=1/2 python scripts/gpu_tests.py --workers 1 --time-limit 400 \
        --out OUT/tp_1 -- tests/test_tensor_parallel_gpu.py &

With ``HC_TP_GPU_RANKS=4`` (4 devices) the group has 4 ranks and serves the CPU suite's 4-rank tiny
models (``FOUR_RANKS`` of ``tests/test_tensor_parallel.py``: the 2-rank ones' head counts do not all
divide by 4), their speculative and tree cases, and the two default mid-size models.
"""

from __future__ import annotations

import json
import os
import pathlib
import time

import pytest
import torch

import hybrid_compile as hc

# ranks of the group: 2 by default; HC_TP_GPU_RANKS=4 serves the CPU suite's 4-rank models and the default
# mid-size ones over 4 GPUs instead (the 2-rank tiny models' head counts do not all divide by 4)
RANKS = int(os.environ.get("HC_TP_GPU_RANKS", "2"))

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multi_gpu,
    pytest.mark.xdist_group("multi_gpu"),
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < RANKS,
                       reason=f"tensor parallelism over NCCL needs {RANKS} CUDA devices"),
]

NEW = 8
OPTIONS = dict(dtype="bfloat16", device="cuda", max_total_tokens=2048, mamba_cache_size=16, max_running_requests=4,
               chunked_prefill_size=64, piecewise_cuda_graph_tokens=(4, 16, 68), tokenizer=False)
# batch 1 replays the bucket of 2. fp32 (MoE models on the fused experts path: :func:`_dtype_options`): a
# tiny random model's top logits lie within bf16's rounding of each other (an H100 run in bf16
# diverged on every family at tokens outside the fp32 top two)
TINY = dict(cuda_graphs=True, cuda_graph_batch_sizes=(2, 4), dtype="float32")
MID = dict(cuda_graph_batch_sizes=(1, 2, 4))  # batch 1: the graph compiled for one token
SPECULATIVE = {"method": "ngram", "num_draft_tokens": 2, "ngram_max": 3, "ngram_min": 1}
# a draft model on rank 0 alone ("self": the case's own checkpoint loaded as the draft, on the rank's GPU:
# _engine_options; its drafts are taken, so the verify graphs emit several tokens a step)
DRAFT_SELF = {"method": "draft_model", "draft_model": "self", "num_draft_tokens": 2}


# speculative decoding with the checkpoint's MTP head (tests/mtp_models.py writes its mtp.* tensors):
# case name -> the engine kind its head is written as (the 4-rank Qwen3-Next is a Qwen3-Next MoE)
MTP = {"method": "mtp", "num_draft_tokens": 2}
MTP_TREE = {"method": "mtp", "num_draft_tokens": 2, "topk": 2, "num_tree_nodes": 4}  # (tree verify graphs)
MTP_KINDS = {"qwen3_next_moe@mtp": "qwen3_next_moe", "qwen3_next_moe@mtp_tree": "qwen3_next_moe", "qwen3_5@mtp": "qwen3_5",
             "qwen3_next_4@mtp": "qwen3_next_moe", "qwen3_next_moe@mtp_token_map": "qwen3_next_moe"}


def _mtp_token_map() -> dict:
    """MTP drafts over every other id of the tiny Qwen3-Next's vocabulary: each rank's rows of the map
    from its vocab-parallel LM head, the logits gathered inside the head's graphs."""
    from engine_models import make_config

    return dict(MTP, draft_token_map=list(range(1, make_config("qwen3_next_moe").vocab_size, 2)))


def _tree_speculative() -> dict:
    """Draft trees (top-k 2, depth 2, 4 nodes) of a replay draft that knows no continuation: full
    trees of random tokens below 64 (every tiny vocabulary's), their paths seldom accepted; what
    is checked is the tree verify graphs' metadata on both ranks (greedy tokens as on one GPU)."""
    from hybrid_compile.engine.speculative import ReplayDraft

    return dict(method="custom", draft_source=ReplayDraft({}, q=0.5, vocab_size=64), num_draft_tokens=2, topk=2,
                num_tree_nodes=4)


# a divergence from the single-GPU engine is accepted where TP's token's fp32 logit is this close to
# the top one (relative to the top logit, at least 1), by the case's dtype: weights and activations
# summed in another order. bf16 (the mid-size models): its 8-bit mantissa through every layer and the
# top-k routing (a rounding can swap an expert) moved a tiny Qwen3-Next MoE's pick 5.2% below its fp32
# top on 2 H200s when the tiny MoE models still ran in bf16
NEAR_TIE = {"float32": 0.05, "bfloat16": 0.10}


def _dtype_options(name: str, model, options: dict) -> dict:
    """The case's dtype (and ``fused_moe``): an FP8 checkpoint's float tensors in fp32, its experts on
    the FP8 experts path (``fused_moe`` is for float experts). A model with routed experts (tiny or mid-size) runs in
    fp32 on our fused experts path where every experts module takes it (transformers' fp32 experts
    forward syncs with the host, which CUDA-graph capture refuses). In bf16 the router's top-k makes
    TP and one GPU incomparable: their inputs differ by the all-reduce's summation order, a rounding
    can swap an expert, and the logits move by far more than a near tie (on 2 H200s the mid-size
    Qwen3-Next MoE picked, at its 4th new token, its fp32 token 20 % below the top; a tiny one in
    bf16 on 4 H100s, on one GPU alone, its fp32 third token, 22 % below). A model without experts:
    the options' dtype (the mid-size ones: bf16)."""
    from hybrid_compile.models.fused_experts import experts_modules, unsupported_reason

    if name.endswith("@fp8_checkpoint"):
        return {"dtype": "float32"}
    experts = experts_modules(model)
    if not experts:
        return {"dtype": options.get("dtype", OPTIONS["dtype"])}
    if all(unsupported_reason(m) is None for _, m in experts):
        return {"dtype": "float32", "fused_moe": True}
    return {"dtype": "bfloat16"}


CASE_SECONDS = 240  # the longest a case may take (the mid-size ones compile and capture most)
STACK_DUMP_SECONDS = 90  # a rank still in one case after this long logs its stacks (and again after as long)


# mid-size models: a tiny model's config widened to hidden 1024 and 8 layers. Head counts grow 4x,
# head dims and per-head state widths by the rest of the factor, so every width stays consistent
# (Mamba2: heads x head dim = expand x hidden; attention: heads x head dim = hidden). Mamba2 B/C groups
# grow 4x too (2 -> 8, as Nemotron-3-Nano's): a group count that 4 ranks divide.
MID_HIDDEN, MID_LAYERS = 1024, 8
_HEADS = ("num_attention_heads", "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads",
          "n_groups", "mamba_n_groups", "mamba_num_heads", "num_heads", "mamba_n_heads", "n_mamba_heads",
          "num_query_groups", "adapter_rank",
          "ssm_state_size", "state_size", "mamba_d_state", "chunk_size", "mamba_chunk_size")
_HEAD_DIMS = ("head_dim", "linear_key_head_dim", "linear_value_head_dim", "mamba_head_dim", "mamba_d_head",
              "mamba_headdim", "attention_head_dim", "kv_channels", "moe_intermediate_size",
              "shared_expert_intermediate_size", "moe_shared_expert_intermediate_size", "vocab_size")
_WIDTHS = ("hidden_size", "intermediate_size", "shared_intermediate_size", "attention_hidden_size", "mamba_d_ssm",
           "time_step_rank")
_LAYER_LISTS = ("layer_types", "layers_block_type")


def _widened(config):
    """``config`` (a tiny model's) at hidden :data:`MID_HIDDEN` and :data:`MID_LAYERS` layers (its
    layer pattern repeated)."""
    d = config.to_dict()
    factor = MID_HIDDEN // d["hidden_size"]
    assert factor * d["hidden_size"] == MID_HIDDEN and factor % 4 == 0, d["hidden_size"]
    for keys, times in ((_HEADS, 4), (_HEAD_DIMS, factor // 4), (_WIDTHS, factor)):
        for k in keys:
            if isinstance(d.get(k), int) and not isinstance(d[k], bool):
                d[k] *= times
    d["num_hidden_layers"] = MID_LAYERS
    for k in _LAYER_LISTS:
        if d.get(k):
            d[k] = [d[k][i % len(d[k])] for i in range(MID_LAYERS)]
    if d.get("mlp_only_layers"):
        d["mlp_only_layers"] = list(range(MID_LAYERS))
    if d.get("hybrid_layer_ids") is not None:
        d["hybrid_layer_ids"] = [i for i, t in enumerate(d["layers_block_type"]) if t == "hybrid"]
    d["max_position_embeddings"] = max(d.get("max_position_embeddings") or 0, 4096)
    return type(config).from_dict(d)


def _mid(name: str):
    """The tiny model ``name`` of the CPU tests widened (:func:`_widened`), random weights (std 0.05)."""
    def build():
        from test_tensor_parallel import MODELS

        tiny = MODELS[name]()
        config = _widened(tiny.config)
        config.initializer_range = 0.05
        return _seeded(type(tiny), config)
    return build


def _seeded(model_class, config, seed: int = 0):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config).float().eval()
    model.generation_config.do_sample = False
    model.generation_config.eos_token_id = None
    return model


# every family at mid size (qwen3_next_dense: hidden 48 does not widen to 1024; the MoE one covers its class).
# By default two of them (GDN + MoE, Mamba2 + MoE + MLP: also with piecewise graphs alone and the graph of one
# token), so that one run of the module stays within about 8 minutes on 2 H100s; HC_TP_GPU_ALL_MID=1 serves
# the others too (about 6 minutes more: run them on their own, -k as in the module docstring).
MID_FAMILIES = ("qwen3_next_moe", "nemotron_h", "qwen3_5", "qwen3_5_moe", "mamba2", "bamba", "granitemoehybrid",
                "falcon_h1", "olmo_hybrid", "lfm2", "lfm2_moe", "zamba2")
MID_DEFAULT = MID_FAMILIES[:2]
ALL_MID = os.environ.get("HC_TP_GPU_ALL_MID") == "1"


def _cases() -> list[tuple[str, object, dict]]:
    """(case name, model builder, engine options) of every case."""
    from test_tensor_parallel import FOUR_RANKS, MODELS, TWO_RANKS

    tiny, spec = (TWO_RANKS, "qwen3_next_moe") if RANKS == 2 else (FOUR_RANKS, "qwen3_next_4")
    cases = [(name, MODELS[name], dict(TINY)) for name in tiny]
    cases.append((f"{spec}@speculative", MODELS[spec], dict(TINY, speculative=SPECULATIVE)))
    cases.append((f"{spec}@tree", MODELS[spec], dict(TINY, speculative=_tree_speculative())))
    # MTP drafts: the head sharded on every rank, its steps (piecewise graphs) replayed by the followers
    for name in (spec, "qwen3_5") if RANKS == 2 else (spec,):
        cases.append((f"{name}@mtp", MODELS[name], dict(TINY, speculative=MTP)))
    if RANKS == 2:  # MTP draft trees: the head's top-2 chain, verified through the tree verify graphs
        cases.append((f"{spec}@mtp_tree", MODELS[spec], dict(TINY, speculative=MTP_TREE)))
        cases.append((f"{spec}@mtp_token_map", MODELS[spec], dict(TINY, speculative=_mtp_token_map())))
        # a draft model (compiled, its own CUDA graphs) on rank 0 alone, as a chain and as a tree
        cases.append(("qwen3_next_dense@draft_model", MODELS["qwen3_next_dense"], dict(TINY, speculative=DRAFT_SELF)))
        cases.append(("qwen3_next_dense@draft_tree", MODELS["qwen3_next_dense"],
                      dict(TINY, speculative=dict(DRAFT_SELF, topk=2))))
        # an FP8 checkpoint (block scales on 128 x 128 blocks the ranks' shards fall on): each rank reads
        # its e4m3 slices; FP8 GEMVs, cuBLAS's block-scaled GEMM and the FP8 experts inside the graphs
        cases.append(("qwen3_next_fp8@fp8_checkpoint", MODELS["qwen3_next_fp8"], dict(TINY)))
        # the prefix cache's host tier (every copy to the host and back mirrored on the followers) and elastic
        # pools (a KV pool too small for the second round: memory moved to it, every rank resizing in step
        # and capturing its full graphs again, the NCCL all-reduces inside)
        cases.append(("qwen3_next_dense@host_tier", MODELS["qwen3_next_dense"],
                      dict(TINY, prefix_cache_host_tier=True, prefix_cache_host_bytes=8 << 20)))
        cases.append(("qwen3_next_dense@elastic", MODELS["qwen3_next_dense"],
                      dict(TINY, elastic_pools=True, max_total_tokens=160)))
    for name in MID_DEFAULT:
        cases.append((f"mid_{name}", _mid(name), dict(MID, cuda_graphs=True)))
        cases.append((f"mid_{name}@piecewise", _mid(name), dict(cuda_graphs="piecewise")))
    # every other case takes the default all-reduce ("auto": the one-shot kernel up to 64 KiB); this one NCCL's,
    # on a model without experts, so that bf16 (what the mid-size MoE ones are not served in) is compared too
    cases.append(("mid_qwen3_5@nccl", _mid("qwen3_5"), dict(MID, cuda_graphs=True, tensor_parallel_all_reduce="nccl")))
    if ALL_MID:
        cases += [(f"mid_{name}", _mid(name), dict(TINY)) for name in MID_FAMILIES if name not in MID_DEFAULT]
    return cases


def _shard(names: list[str]) -> list[str]:
    """The cases of this process's shard (``HC_TP_GPU_SHARD=i/n``: every n-th from the i-th), or all."""
    spec = os.environ.get("HC_TP_GPU_SHARD")
    if not spec:
        return names
    try:
        index, count = (int(v) for v in spec.split("/"))
    except ValueError:
        index, count = -1, 0
    if not 0 <= index < count:
        raise ValueError(f"HC_TP_GPU_SHARD must be 'i/n' with 0 <= i < n, got {spec!r}")
    return names[index::count]


CASE_NAMES = _shard([c[0] for c in _cases()])
CASES = CASE_NAMES + ([] if ALL_MID else [
    pytest.param(f"mid_{n}", marks=pytest.mark.skip(reason="the other mid-size families run with HC_TP_GPU_ALL_MID=1"))
    for n in MID_FAMILIES if n not in MID_DEFAULT])


def _prompts(vocab: int) -> list[list[list[int]]]:
    """Rounds of prompts: one prompt (batch 1), then six of varied lengths over 4 running slots
    (requests join mid-way: mixed steps, decode batches of 1..4), then a repetitive one (n-gram drafts)."""
    from engine_models import random_prompts

    varied = random_prompts([70, 5, 33, 1, 129, 17], vocab, seed=3)
    return [[varied[1]], varied, [[3, 4, 5, 3, 4, 5, 3, 4, 5, 3]]]


def _compile_counts(triton) -> dict:
    """Dynamo graphs, Inductor compiles (FX graph cache lookups: hits, misses and bypasses) and our
    Triton kernels' JIT compiles so far in this process."""
    from torch._dynamo.utils import counters

    inductor = sum(counters["inductor"][k] for k in ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass"))
    return dict(dynamo_graphs=counters["stats"]["unique_graphs"], inductor=inductor, triton=triton.total)


def _triton_compiles():
    from hybrid_compile.compilation.compile_counts import TritonCompiles

    return TritonCompiles()


def _engine_options(case: dict, device: str) -> dict:
    """The case's engine options, a ``"self"`` draft model (:data:`DRAFT_SELF`) loaded from the case's
    checkpoint onto ``device`` in the case's dtype."""
    options = dict(case["options"])
    spec = options.get("speculative")
    if isinstance(spec, dict) and spec.get("draft_model") == "self":
        import transformers

        draft = transformers.AutoModelForCausalLM.from_pretrained(case["dir"], dtype=getattr(torch, options["dtype"]))
        options["speculative"] = dict(spec, draft_model=draft.to(device).eval())
    return options


def _serve(engine, rounds) -> list:
    return [engine.generate_batch(batch, max_new_tokens=NEW) for batch in rounds]


def _case_file(root, rank: int, name: str) -> pathlib.Path:
    return pathlib.Path(root) / f"rank{rank}_{name.replace('@', '_')}.json"


def _write(path: pathlib.Path, result: dict) -> None:
    """Write ``result`` whole or not at all (the test process polls for the file)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.rename(path)


def _rank_log(root, rank: int) -> pathlib.Path:
    return pathlib.Path(root) / f"rank{rank}.log"


def _rank_main(rank: int, size: int, cases: list[dict], result_dir: str) -> None:
    """One torchrun-style rank: serve every case in turn, writing each case's result as it ends.
    Rank 0 drives and records tokens and stats; rank 1 logs its compile counters before each
    command it receives (its engine is inside ``from_pretrained``). Progress lines go to
    :func:`_rank_log`, and so do the rank's Python stacks every :data:`STACK_DUMP_SECONDS` a case
    runs (a hung rank shows where it waits) and at a crash."""
    import faulthandler

    progress = open(_rank_log(result_dir, rank), "a", buffering=1)
    # a crash (a rank died of SIGSEGV once in three runs of the mid-size cases on 2 H100s, on a fresh machine)
    # leaves every thread's Python stack in the log
    faulthandler.enable(file=progress, all_threads=True)

    def note(what: str) -> None:
        progress.write(f"{time.strftime('%H:%M:%S')} {what}\n")

    torch.set_num_threads(2)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    from hybrid_compile.distributed import step as tp_step

    with _triton_compiles() as triton:
        log: list[dict] = []
        receive = tp_step._receive

        def logged_receive(tp):
            log.append(_compile_counts(triton))
            return receive(tp)

        tp_step._receive = logged_receive
        for case in cases:
            os.environ["MASTER_PORT"] = str(case["port"])
            log.clear()
            t0 = time.perf_counter()
            note(f"{case['name']}: start")
            faulthandler.dump_traceback_later(STACK_DUMP_SECONDS, repeat=True, file=progress)
            try:
                engine = hc.from_pretrained(case["dir"], tensor_parallel_size=size,
                                            **_engine_options(case, f"cuda:{rank}"))
                if rank != 0:
                    assert engine is None
                    result = dict(log=list(log))
                else:
                    ready = dict(_compile_counts(triton), compile=engine.stats()["compile"],
                                 commands=engine.stats()["tensor_parallel"]["commands_broadcast"])
                    outputs = _serve(engine, case["rounds"])
                    stats = engine.stats()
                    head = engine.speculative.source.runner if engine.mtp_head is not None else None
                    head_stats = head.compile_stats() if head is not None else None  # (close drops its graphs)
                    engine.close()
                    result = dict(outputs=outputs, seconds=time.perf_counter() - t0, ready=ready,
                                  end=_compile_counts(triton), compile=stats["compile"],
                                  all_reduce=stats["tensor_parallel"]["all_reduce"]["mode"],
                                  speculative=stats.get("speculative"), startup=stats["startup"],
                                  moe=_moe_paths(stats),
                                  mtp_compile=head_stats)
            except Exception as e:  # noqa: BLE001 (recorded for the test to report; the next case goes on)
                result = dict(error=f"{type(e).__name__}: {e}")
            faulthandler.cancel_dump_traceback_later()
            note(f"{case['name']}: {'error ' + result['error'][:200] if 'error' in result else 'done'} "
                 f"({time.perf_counter() - t0:.1f} s)")
            _write(_case_file(result_dir, rank, case["name"]), result)


def _selected(request) -> set[str] | None:
    """The case names of this module's tests pytest selected (``-k``), or None (all)."""
    names = {item.callspec.params["name"] for item in request.session.items
             if item.path == request.path and "name" in getattr(getattr(item, "callspec", None), "params", {})
             and not item.get_closest_marker("skip")}
    return names or None


class _Group:
    """The spawned ranks (:data:`RANKS`) serving every case in turn (started once), each case's results as its files
    appear (a time-limited run keeps the cases done so far), and this process's single-GPU oracle
    of a case, computed while the ranks serve the next ones."""

    def __init__(self, root: pathlib.Path, cases: list[dict]) -> None:
        self.root, self.cases = root, {c["name"]: c for c in cases}
        self.last_result = time.time()  # a case gets CASE_SECONDS from the previous one's result
        self.ctx = torch.multiprocessing.start_processes(_rank_main, args=(RANKS, cases, str(root)), nprocs=RANKS,
                                                         join=False, start_method="spawn")
        self.failure: str | None = None

    def _alive(self) -> bool:
        """False once both ranks have exited; a rank's failure fails the calling test (with its traceback)."""
        if self.failure is None:
            try:
                if self.ctx.join(timeout=0):
                    return False
            except (torch.multiprocessing.ProcessRaisedException, torch.multiprocessing.ProcessExitedException) as e:
                self.failure = str(e)
        if self.failure is not None:
            pytest.fail(f"a tensor-parallel rank failed: {self.failure}; the ranks' logs end:\n{self.log_tails()}")
        return True

    def tp(self, name: str) -> list[dict]:
        """Every rank's results of case ``name`` (waiting for them)."""
        paths = [_case_file(self.root, r, name) for r in range(RANKS)]
        while not all(p.exists() for p in paths):
            if not self._alive() and not all(p.exists() for p in paths):
                pytest.fail(f"the ranks exited without a result for {name}")
            if time.time() > self.last_result + CASE_SECONDS:
                pytest.fail(f"no tensor-parallel result for {name} within {CASE_SECONDS} s of the previous "
                            f"case's; the ranks' logs end:\n{self.log_tails()}")
            time.sleep(0.5)
        self.last_result = max(self.last_result, max(p.stat().st_mtime for p in paths))
        return [json.loads(p.read_text()) for p in paths]

    def log_tails(self, chars: int = 6000) -> str:
        tails = []
        for r in range(RANKS):
            p = _rank_log(self.root, r)
            text = p.read_text(errors="replace") if p.exists() else "(no log)"
            tails.append(f"--- rank {r} ---\n{text[-chars:]}")
        return "\n".join(tails)

    def single(self, name: str):
        """The case's tokens on one GPU with the same options (the oracle), or its error; the
        oracle's MoE paths (experts modules and routers on our fused ops) go to ``case["single_moe"]``."""
        case = self.cases[name]
        if "single" not in case:
            try:
                engine = hc.from_pretrained(case["dir"], **_engine_options(case, "cuda"))
                try:
                    case["single"] = _serve(engine, case["rounds"])
                    case["single_moe"] = _moe_paths(engine.stats())
                finally:
                    engine.close()
            except Exception as e:  # noqa: BLE001 (reported by the case's tests)
                case["single"] = f"{type(e).__name__}: {e}"
        return case["single"]

    def close(self) -> None:
        for p in self.ctx.processes:
            p.join(max(1.0, self.last_result + CASE_SECONDS - time.time()))
        codes = [p.exitcode for p in self.ctx.processes]
        for p in self.ctx.processes:
            if p.is_alive():
                p.terminate()
        assert codes == [0] * RANKS, f"ranks exited with {codes}"


@pytest.fixture(scope="module")
def served(request, tmp_path_factory):
    """The selected cases' models and checkpoints, served at TP :data:`RANKS` by one :class:`_Group`."""
    from ports import free_port

    root = tmp_path_factory.mktemp("tp_gpu")
    cases, models, skipped, failed = [], {}, {}, {}
    selected = _selected(request)
    for name, build, options in _cases():
        if selected is not None and name not in selected:
            continue
        try:
            model = build()
        except pytest.skip.Exception as e:  # a family this transformers lacks
            skipped[name] = str(e)
            continue
        except Exception as e:  # noqa: BLE001 (the case's tests fail with it; the others go on)
            failed[name] = f"building the model: {type(e).__name__}: {e}"
            continue
        d = root / name.replace("@", "_")
        if not d.exists():
            if name in MTP_KINDS:  # (the model and its mtp.* tensors)
                from mtp_models import write_mtp_checkpoint

                write_mtp_checkpoint(MTP_KINDS[name], 0, str(d), model=model)
            elif name.endswith("@fp8_checkpoint"):
                from fp8_models import save_fp8_checkpoint

                save_fp8_checkpoint(model, d)
            else:
                model.save_pretrained(d)
        vocab = model.config.get_text_config().vocab_size
        models[name] = model
        cases.append(dict(name=name, dir=str(d), rounds=_prompts(vocab), port=free_port(),
                          options={**OPTIONS, **options, **_dtype_options(name, model, options)}))
    group = _Group(root, cases)
    yield dict(group=group, models=models, skipped=skipped, failed=failed)
    group.close()


def _assert_same_greedy(model, prompt: list[int], got: list[int], expected: list[int], what: str,
                        near_tie: float) -> None:
    """``got`` (TP) == ``expected`` (one GPU), except a first divergence where the fp32 model's
    logit (CPU, HF forward) of the token TP picked is within ``near_tie`` (:data:`NEAR_TIE`, relative to
    the top logit, at least 1) of the top logit or of the single-GPU pick's logit, whichever is lower: in
    bf16 the single-GPU engine itself can pick below the fp32 top (a mid-size Qwen3-Next MoE on one
    H100 picked its fp32 second token, 12.5 % below the top, and TP 4 the third, 1 % below that), and
    TP is held to be as good as it. Tokens after the divergence are not compared."""
    from engine_models import first_divergence, hf_next_logits

    i = first_divergence(got, expected)
    if i is None:
        return
    assert i < min(len(got), len(expected)), f"{what}: lengths differ:\n  TP{RANKS} {got}\n  1 GPU {expected}"
    logits = hf_next_logits(model, prompt + expected[:i])
    top = torch.topk(logits, 3)
    bar = min(float(top.values[0]), float(logits[expected[i]]))
    gap = bar - float(logits[got[i]])
    assert gap <= near_tie * max(1.0, float(top.values[0].abs())), (
        f"{what}: TP {RANKS} diverges from the single-GPU engine at new token {i} (TP {got[i]}, fp32 logit "
        f"{float(logits[got[i]]):.4f}; 1 GPU {expected[i]}, fp32 logit {float(logits[expected[i]]):.4f}; fp32 top-3 "
        f"logits {top.values.tolist()} at {top.indices.tolist()}):\n  TP{RANKS}   {got}\n  1 GPU {expected}"
    )


def _moe_paths(stats: dict) -> dict:
    """An engine's MoE paths from its ``stats()``: experts modules and routers on our fused ops."""
    return {k: stats[k] for k in ("fused_moe_modules", "fused_moe_routers")}


def _result(served, name: str) -> tuple[dict, dict]:
    """Rank 0's results of case ``name`` and the followers' (a list)."""
    if name in served["skipped"]:
        pytest.skip(served["skipped"][name])
    assert name not in served["failed"], served["failed"].get(name)
    results = served["group"].tp(name)
    for rank, r in enumerate(results):
        assert "error" not in r, f"{name} at TP {RANKS} (rank {rank}): {r['error']}"
    return results[0], results[1:]


@pytest.mark.parametrize("name", CASES)
def test_tp2_graphs_match_single_gpu(served, name):
    if name in served["models"]:
        single = served["group"].single(name)  # (first: the ranks serve meanwhile)
        assert not isinstance(single, str), f"{name} on one GPU: {single}"
    r, _ = _result(served, name)
    case, model = served["group"].cases[name], served["models"][name]
    for batch, got, want in zip(case["rounds"], r["outputs"], single):
        for prompt, g, w in zip(batch, got, want):
            _assert_same_greedy(model, prompt, g, w, f"{name} (prompt of {len(prompt)})",
                                NEAR_TIE[case["options"]["dtype"]])
    c = r["compile"]
    assert c["graph_breaks"] == 0 and c["recompiles"] == 0, c
    # each rank resolves fused_moe as one GPU does (the fused routers before FP8 experts too)
    assert r["moe"] == case["single_moe"], (r["moe"], case["single_moe"])
    # the all-reduces: the one-shot kernel by default (these hosts' GPUs reach each other), NCCL where asked
    assert r["all_reduce"] == case["options"].get("tensor_parallel_all_reduce", "one_shot").replace("auto", "one_shot")
    mode = case["options"]["cuda_graphs"]
    if "speculative" in case["options"]:  # (every decode step is a verify step)
        assert r["speculative"]["verify_steps"] > 0 and c["verify_graph_replays"] > 0, (r["speculative"], c)
    elif mode is True:
        assert c["cuda_graph_replays"] > 0 and c["full_graphs"] > 0, c
    assert c["piecewise_replays"] > 0 and c["piecewise_graphs"] > 0, c


@pytest.mark.parametrize("name", CASES)
def test_tp2_no_compiles_after_from_pretrained(served, name):
    """No Dynamo graph, Inductor piece or Triton kernel compiled while serving, on any rank."""
    r, followers = _result(served, name)
    ready, end = dict(r["ready"]), r["end"]
    commands = ready.pop("commands")
    compiled = ready.pop("compile")
    assert end == ready, f"rank 0 compiled while serving: {ready} -> {end}"
    assert r["compile"]["pieces"] == compiled["pieces"] and r["compile"]["graphs"] == compiled["graphs"]
    for rank, follower in enumerate(followers, 1):
        log = follower["log"]
        assert len(log) > commands, f"rank {rank} received {len(log)} commands, rank 0 had sent {commands} at start-up"
        assert log[-1] == log[commands], f"rank {rank} compiled while serving: {log[commands]} -> {log[-1]}"


@pytest.mark.parametrize("name", [n for n in CASE_NAMES if n in MTP_KINDS])
def test_tp2_mtp_head_replays_its_graphs(served, name):
    """MTP drafts at TP: rank 0's head ran compiled with no graph break, its prefill steps replaying its
    piecewise CUDA graphs; a chain's every proposal replayed a whole-proposal graph (the proposal graphs,
    on by default: each rank captured them at start-up and replays rank 0's proposals, ``PROPOSAL``;
    their tokens are checked above, their compiles in test_tp2_no_compiles_after_from_pretrained), a
    tree's ran its steps one by one; chains of drafts were proposed and verified."""
    r, _ = _result(served, name)
    head, spec = r["mtp_compile"], r["speculative"]
    assert head is not None and head["graph_breaks"] == 0 and head["recompiles"] == 0, head
    assert head["piecewise_graphs"] > 0 and head["piecewise_replays"] > 0, head
    assert spec["method"] == "mtp" and spec["verify_steps"] > 0, spec
    source = spec["draft_source"]
    assert source["head_decode_steps"] > 0 and source["window_steps"] > 0, source
    if name.endswith("@mtp_tree"):
        assert source["mtp_graph_replays"] == 0, source
    else:
        assert source["mtp_graph_replays"] > 0, source
        assert spec["device_draft_steps"] > 0, spec


@pytest.mark.parametrize("name", [n for n in CASE_NAMES if n.endswith("@elastic")])
def test_tp2_elastic_pools_capture_their_graphs_again(served, name):
    """Elastic pools at TP: memory moved between the pools while serving (its tokens are checked
    against one GPU's above, its compiles in test_tp2_no_compiles_after_from_pretrained), and the full
    graphs were captured again over the new pools (on every rank: rank 1's replays pair with rank 0's)."""
    r, _ = _result(served, name)
    assert r["compile"]["full_graph_recaptures"] > 0, r["compile"]
