"""Tensor parallelism (hybrid_compile/distributed) on CPU with gloo: greedy tokens of a model served
over 2 or 4 ranks equal transformers' single-process ``generate`` token for token.

Most cases run in one group of spawned ranks started the way torchrun starts them (RANK /
WORLD_SIZE / MASTER_ADDR / MASTER_PORT in the environment; every rank calls
``hc.from_pretrained(dir, tensor_parallel_size=N)``, rank 0 drives the engine and writes its
outputs to a JSON file, the others follow inside the call), one engine after the other, so the
processes start once per group size. Every case runs with chunked prefill, more prompts than
running slots (requests join mid-way: mixed batches), the prefix cache on with prompts that
share prefixes and n-gram speculative decoding. Variants of some cases at 2 ranks: compiled (a
Mamba2 and a Gated DeltaNet model), ``n = 2`` sequences per prompt (forks copy the prompt's KV and
recurrent state on every rank) and a bf16 recurrent state (against the single-process engine with
the same setting, since HF keeps an fp32 state) and the fused MoE experts (``fused_moe=True``, Qwen3-Next MoE
and NemotronH), draft models on rank 0 alone (the target's own weights as a chain and a tree, an HF
Llama; against HF and the single-process engine's tokens and accepted drafts) and a draft model
that raises on rank 0 (the group serves on). The spawned path
(``from_pretrained`` starting its own ranks) is tested with a failure on rank 0, a failure on a
follower (torchrun-style), and each rank's peak host memory against the full model size. Also:
the group's collectives alone, eager and compiled with ``fullgraph=True``, against the sum and the
concatenation of the ranks' inputs; random-weight shards drawn per rank (``random_weights.json``, the benchmark's 80B shape) and the
CUDA-graph options checked before any process starts (the graphs themselves:
``tests/test_tensor_parallel_gpu.py``, 2 GPUs).
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time

import pytest
import torch
import transformers

import hybrid_compile as hc
from checkout_env import checkout_env
from hybrid_compile.distributed import ShardingError, TensorParallelError
from hybrid_compile.distributed.plans import plan_for
from hybrid_compile.models import family_of
import engine_models as em
from ports import free_port
import mamba1_models as m1
import mamba2_models as mm
import test_lfm2 as lfm2
from kimi_models import build_kimi_linear
from lfm3_models import build_lfm3
from minimax_models import BF16_INIT_STD, build_minimax
from recurrent_gemma_models import build_recurrent_gemma
from fp8_models import save_fp8_checkpoint
from test_elastic_pools import _flip_workload as flip_workload
from test_prefix_cache_host_tier import _waves as host_tier_waves

NEW = 6
OPTIONS = dict(device="cpu", max_total_tokens=512, mamba_cache_size=24, max_running_requests=2, chunked_prefill_size=32,
               speculative={"method": "ngram", "num_draft_tokens": 2, "ngram_max": 3, "ngram_min": 1})


def _qwen3_next_4(seed=0):
    """A Qwen3-Next MoE whose head counts split over 4 ranks (2 KV heads: replicated in pairs)."""
    cfg = em.make_config("qwen3_next_moe")
    cfg.num_attention_heads, cfg.linear_num_key_heads, cfg.linear_num_value_heads = 8, 4, 8
    return em.build_model("qwen3_next_moe", seed, config=cfg)


def _qwen3_next_fp8(seed=0):
    """A Qwen3-Next MoE whose every 2-rank shard boundary falls on a 128-row / 128-column FP8 block
    (head dims 128, expert widths 256): each rank's block-FP8 quantization of its shard is then the
    single process's, block for block."""
    cfg = em.make_config("qwen3_next_moe")
    cfg.hidden_size, cfg.head_dim, cfg.linear_key_head_dim, cfg.linear_value_head_dim = 128, 128, 128, 128
    cfg.intermediate_size = cfg.moe_intermediate_size = cfg.shared_expert_intermediate_size = 256
    # transformers' own init scale: with larger weights the logits are chaotic in the activations, and a
    # one-ulp difference of the ranks' summation order can move an activation across an e4m3 rounding
    # boundary and a greedy pick with it (tests/test_fp8_models.py serves its compiled case so too)
    cfg.initializer_range = 0.02
    return em.build_model("qwen3_next_moe", seed, config=cfg)


def _nemotron_h_4(seed=0):
    """A NemotronH whose Mamba2 B/C groups (4) and heads split over 4 ranks."""
    import transformers

    cfg = mm.build_nemotron_h(seed).config
    cfg = transformers.NemotronHConfig.from_dict({**cfg.to_dict(), "n_groups": 4})
    torch.manual_seed(seed)
    return mm._finish(transformers.NemotronHForCausalLM(cfg), seed, dt_bias=-1.5)


def _one_group(name: str):
    """A Mamba2-family model with one B/C group: B/C replicated, the gated norm reduced across ranks."""
    def build(seed=0):
        model = mm.BUILDERS[name](seed)
        cfg = model.config.to_dict()
        cfg["n_groups" if name == "mamba2" else "mamba_n_groups"] = 1
        torch.manual_seed(seed)
        return mm._finish(type(model)(type(model.config).from_dict(cfg)), seed)
    return build


def _lfm2(seed=0):
    """LFM2 with a conv bias (row-parallel out_proj bias: added once) and ``block_auto_adjust_ff_dim``
    (the MLP is 2/3 of intermediate_size 64, times 2, rounded up to a multiple of 16: 96, not 64)."""
    import transformers

    cfg = transformers.Lfm2Config(**lfm2._common(True), block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=2.0,
                                  block_multiple_of=16)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.Lfm2ForCausalLM(cfg).float().eval()
    model.generation_config.eos_token_id = None
    return model


MODELS = {
    "qwen3_next_moe": lambda: em.build_model("qwen3_next_moe"),
    "qwen3_next_dense": lambda: em.build_model("qwen3_next_dense"),
    "qwen3_5": lambda: em.build_model("qwen3_5"),
    "qwen3_5_moe": lambda: em.build_model("qwen3_5_moe"),
    "nemotron_h": mm.build_nemotron_h,
    "mamba2": mm.build_mamba2,
    "bamba": mm.build_bamba,
    "granitemoehybrid": mm.build_granitemoehybrid,
    "falcon_h1": mm.build_falcon_h1,
    "olmo_hybrid": lambda: em.build_model("olmo_hybrid"),
    "lfm2": _lfm2,
    "lfm2_moe": lambda: lfm2._build("lfm2_moe", 0),
    "zamba2": mm.build_zamba2,
    "mamba": m1.build_mamba,
    "falcon_mamba": m1.build_falcon_mamba,
    "jamba": m1.build_jamba,
    "zamba": m1.build_zamba,
    "recurrent_gemma": build_recurrent_gemma,
    "mamba2_one_group": _one_group("mamba2"),
    "bamba_one_group_4": _one_group("bamba"),
    "bamba_two_groups_4": mm.build_bamba,  # (2 B/C groups over 4 ranks: each on 2 ranks, its norm over them)
    "qwen3_next_4": _qwen3_next_4,
    "nemotron_h_4": _nemotron_h_4,
    "qwen3_next_fp8": _qwen3_next_fp8,
}
TWO_RANKS = ("qwen3_next_moe", "qwen3_next_dense", "qwen3_5", "qwen3_5_moe", "nemotron_h", "mamba2", "bamba",
             "granitemoehybrid", "falcon_h1", "mamba2_one_group", "olmo_hybrid",
             "lfm2", "lfm2_moe", "zamba2", "mamba", "falcon_mamba", "jamba", "zamba", "recurrent_gemma")
# lightning attention by heads (its norm over all heads reduced across the ranks), softmax attention, MoE
MODELS["minimax"] = build_minimax
MODELS["minimax_bf16"] = lambda: build_minimax(init_std=BF16_INIT_STD)  # (served in bf16: its docstring)
TWO_RANKS += ("minimax",)
if hasattr(transformers, "Lfm3ForCausalLM"):  # (transformers 5.17 has no LFM3)
    MODELS["lfm3"] = build_lfm3  # sliding + full attention with the per-head output gate, short convs
    TWO_RANKS += ("lfm3",)
if hasattr(transformers, "KimiLinearForCausalLM"):  # (transformers >= 5.17)
    # KDA + MLA (absorbed: the compressed KV row replicated on every rank) + MoE; compiled on its two-layer
    # form (KDA, MLA: half the Inductor pieces of the four-layer model) in VARIANTS
    MODELS["kimi_linear"] = build_kimi_linear
    MODELS["kimi_linear_2l"] = lambda: build_kimi_linear(0, None, ("linear_attention", "full_attention"))
    TWO_RANKS += ("kimi_linear",)
KIMI = pytest.mark.skipif("kimi_linear" not in MODELS,
                          reason=f"transformers {transformers.__version__} has no KimiLinearForCausalLM (added in 5.17)")
FOUR_RANKS = ("qwen3_next_4", "nemotron_h_4", "bamba_one_group_4", "bamba_two_groups_4")
FOUR_RANKS += ("minimax",)  # one lightning head per rank, its norm over 4 ranks; 2 KV heads replicated in pairs
COMPILED = "mamba2"  # served compiled (torch.compile with our backend) at 2 ranks
# variants at 2 ranks: (case name, checkpoint, engine options, sequences per prompt)
VARIANTS = (
    ("qwen3_next_dense@compiled", "qwen3_next_dense", dict(compile=True), 1),
    ("qwen3_next_moe@n2", "qwen3_next_moe", {}, 2),
    ("nemotron_h@bf16_state", "nemotron_h", dict(ssm_state_dtype="bfloat16"), 1),
    ("qwen3_next_moe@warmup", "qwen3_next_moe", dict(warmup_kernels=True), 1),
    # the fused MoE experts path (EngineConfig.fused_moe) on each rank's slice of the experts
    ("qwen3_next_moe@fused_moe", "qwen3_next_moe", dict(fused_moe=True), 1),
    ("nemotron_h@fused_moe", "nemotron_h", dict(fused_moe=True), 1),
    ("minimax@bf16", "minimax_bf16", dict(dtype="bfloat16"), 1),
    # block-FP8 projections and experts, each rank quantizing its own shard before the collectives go in
    ("qwen3_next_fp8@fp8", "qwen3_next_fp8", dict(quantization="fp8"), 1),
    # the same model's FP8 checkpoint: each rank reads its e4m3 slices and their block scales
    ("qwen3_next_fp8@checkpoint", "qwen3_next_fp8_checkpoint", dict(dtype="float32"), 1),
) + ((("kimi_linear@compiled", "kimi_linear_2l", dict(compile=True), 1),) if "kimi_linear" in MODELS else ())


def _vocab(model) -> int:
    return model.config.get_text_config().vocab_size


def _rounds(model) -> tuple[list[list[list[int]]], list[list[list[int]]]]:
    """Two rounds of prompts and their HF greedy tokens: a 70-token prompt and a short one, then
    an extension of the first one's whole sequence (a prefix-cache hit on the finished request's
    state) and a repetitive prompt (n-gram drafts get accepted)."""
    a, c = em.random_prompts([70, 5], _vocab(model), seed=3)
    first = [a, c]
    expected = [[em.hf_greedy(model, p, NEW) for p in first]]
    second = [a + expected[0][0] + [5, 6, 7], [3, 4, 5, 3, 4, 5, 3, 4, 5, 3]]
    expected.append([em.hf_greedy(model, p, NEW) for p in second])
    return [first, second], expected


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each model saved with save_pretrained, and its HF greedy tokens for every prompt."""
    out = {}
    for name, build in MODELS.items():
        model = build()
        model.generation_config.do_sample = False
        d = tmp_path_factory.mktemp(name)
        model.save_pretrained(d)
        rounds, expected = _rounds(model)
        out[name] = dict(dir=str(d), model=model, rounds=rounds, expected=expected)
    fp8 = out["qwen3_next_fp8"]
    out["qwen3_next_fp8_checkpoint"] = dict(fp8, dir=str(save_fp8_checkpoint(
        fp8["model"], tmp_path_factory.mktemp("qwen3_next_fp8_checkpoint"))))
    return out


def rank_cases(rank: int, size: int, cases: list[dict]):
    """The torchrun-style environment of one spawned rank, then each case of ``cases`` in turn with
    its rendezvous port set (``_run_group`` gives each case a free port)."""
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    for case in cases:
        os.environ["MASTER_PORT"] = str(case["port"])
        yield case


def finish_rank(rank: int, results: dict, result_path: str) -> None:
    """A spawned rank's last call after a complete run: rank 0 writes its results, then the process
    ends without the interpreter's teardown, where gloo's threads can abort a complete run
    ("terminate called without an active exception"; README, Tensor parallelism, known issue) and
    turn its exit code non-zero. (A rank that raises never gets here: its exit code says so.)"""
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump(results, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _serve_through_a_draft_fault(engine, case: dict, params) -> list:
    """Rank 0: the case's rounds, step by step, while the draft model's second decoder layer raises
    once, at its third call (a half-run draft forward); the step's error is recorded in
    ``case["raised"]`` and the engine serves on."""
    calls, raised = [0], case.setdefault("raised", [])

    def fault(module, args, output):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("injected fault in the draft model")

    hook = case["options"]["speculative"]["draft_model"].model.layers[1].register_forward_hook(fault)
    outputs = []
    try:
        for batch in case["rounds"]:
            rids = [engine.add_request(p, params) for p in batch]
            while engine.has_unfinished():
                try:
                    engine.step()
                except RuntimeError as e:
                    raised.append(str(e))
                    if len(raised) > 1:  # (one fault was injected: the engine must serve on after it)
                        raise
            outputs.append([engine.pop_finished(rid).output for rid in rids])
    finally:
        hook.remove()
    return outputs


def _rank_main(rank: int, size: int, cases: list[dict], result_path: str) -> None:
    """One torchrun-style rank: serve every case in turn (rank 0 drives and records)."""
    results = {}
    for case in rank_cases(rank, size, cases):
        if case.get("fail_rank") == rank:  # a fault on this rank: its third GDN mixer call raises
            from hybrid_compile.models import gated_deltanet

            real, calls = gated_deltanet.gdn_mixer_forward, [0]

            def failing(self, *args, **kwargs):
                calls[0] += 1
                if calls[0] == 3:
                    raise RuntimeError("injected fault in the GDN mixer")
                return real(self, *args, **kwargs)

            gated_deltanet.gdn_mixer_forward = failing
        t0 = time.perf_counter()
        engine = hc.from_pretrained(case["dir"], tensor_parallel_size=size, **case["options"])
        if rank != 0:
            assert engine is None
            continue
        try:
            params = hc.SamplingParams(max_new_tokens=NEW, n=case.get("n", 1))
            if case.get("draft_fault"):
                outputs = _serve_through_a_draft_fault(engine, case, params)
            else:
                outputs = [engine.generate_batch(batch, params=params) for batch in case["rounds"]]
        except Exception as e:  # noqa: BLE001 (recorded for the test to check)
            results[case["name"]] = dict(error=f"{type(e).__name__}: {e}")
            break
        stats = engine.stats()
        engine.close()
        results[case["name"]] = dict(
            outputs=outputs, seconds=time.perf_counter() - t0, prefix_hits=stats["prefix_cache"]["admitted_hit_tokens"],
            verify_steps=stats["speculative"]["verify_steps"], accepted=stats["speculative"]["accepted"],
            compile=stats["compile"], tp=stats["tensor_parallel"], pools_used=engine.pools.used_counts(),
            startup=stats["startup"], fused_moe_modules=stats["fused_moe_modules"],
            fused_moe_routers=stats["fused_moe_routers"], folded_shared_experts=stats["folded_shared_experts"],
            kv_heads=[a.num_kv_heads for a in engine.layout.attention], conv_dims=[m.conv_dim for m in engine.layout.mamba],
            state_shapes=[list(m.state_shape) for m in engine.layout.mamba], raised=case.get("raised", []),
            prefix_cache={k: v for k, v in stats["prefix_cache"].items() if k.startswith("host")},
            elastic=stats.get("elastic_pools"), retractions=stats["retractions"],
        )
    finish_rank(rank, results, result_path)


def _run_group(size: int, cases: list[dict], tmp_path, expect_failure: bool = False,
               main=None) -> tuple[dict, list[int]]:
    """Serve ``cases`` in one group of ``size`` spawned ranks, each running ``main(rank, size, cases,
    result_path)`` (default :func:`_rank_main`); returns rank 0's results and the exit codes."""
    for case in cases:
        case["port"] = free_port()
    path = str(tmp_path / f"results_{size}.json")
    ctx = torch.multiprocessing.start_processes(main or _rank_main, args=(size, cases, path), nprocs=size,
                                                join=False, start_method="spawn")
    deadline = time.time() + 600
    for p in ctx.processes:
        p.join(max(1.0, deadline - time.time()))
    codes = [p.exitcode for p in ctx.processes]
    for p in ctx.processes:
        if p.is_alive():
            p.terminate()
    if not expect_failure:
        assert codes == [0] * size, f"ranks exited with {codes}"
    with open(path) as f:
        results = json.load(f)
    print({name: round(r.get("seconds", 0), 1) for name, r in results.items()})  # (pytest -s: time per case)
    return results, codes


def _case(checkpoints, name, checkpoint=None, n=1, rounds=None, **options) -> dict:
    """A case of the checkpoint ``checkpoint`` (default: ``name``) over its own rounds (or ``rounds``)."""
    ck = checkpoints[checkpoint or name]
    return dict(name=name, dir=ck["dir"], rounds=ck["rounds"] if rounds is None else rounds, n=n,
                options={**OPTIONS, **options})


def _tree_case(checkpoints, name: str, ck: str) -> dict:
    """A draft-tree variant (top-k 2, depth 3, 6 nodes): a replay tree of HF's greedy tokens whose
    accepted paths leave the first-child chain (tree mask, parents and path KV moves on every rank)."""
    from hybrid_compile.engine.speculative import ReplayDraft

    c = checkpoints[ck]
    conts = {tuple(p): e for batch, exp in zip(c["rounds"], c["expected"]) for p, e in zip(batch, exp)}
    spec = dict(method="custom", num_draft_tokens=3, topk=2, num_tree_nodes=6,
                draft_source=ReplayDraft(conts, q=0.5, vocab_size=_vocab(c["model"]), seed=1))
    return _case(checkpoints, name, ck, speculative=spec)


def _llama_draft(vocab: int):
    """A tiny random Llama with the target's vocabulary: a draft model outside our families (HF's own
    forward and KV cache on rank 0, ``drafts.HFDraftModel``)."""
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, pad_token_id=None, bos_token_id=None,
                                   eos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        return transformers.LlamaForCausalLM(cfg).float().eval()


def _draft_model_cases(checkpoints) -> list[dict]:
    """Speculative method "draft_model" at 2 ranks, the draft model on rank 0 alone: the target's own
    weights as the draft (a chain, every draft right but at a chunk's edge), the same as a tree
    (top-k 2, depth 2) and an HF Llama draft (mostly wrong drafts: the verify's rejections)."""
    own = checkpoints["qwen3_next_dense"]["model"]
    nemotron = checkpoints["nemotron_h"]["model"]
    return [
        _case(checkpoints, "qwen3_next_dense@draft_model", "qwen3_next_dense",
              speculative=dict(method="draft_model", draft_model=own, num_draft_tokens=2)),
        _case(checkpoints, "qwen3_next_dense@draft_tree", "qwen3_next_dense",
              speculative=dict(method="draft_model", draft_model=own, num_draft_tokens=2, topk=2)),
        _case(checkpoints, "nemotron_h@hf_draft", "nemotron_h",
              speculative=dict(method="draft_model", draft_model=_llama_draft(_vocab(nemotron)), num_draft_tokens=2)),
        dict(_case(checkpoints, "qwen3_next_dense@draft_fault", "qwen3_next_dense",
                   speculative=dict(method="draft_model", draft_model=copy.deepcopy(own), num_draft_tokens=2)),
             draft_fault=True),
    ]


def _host_tier_case(checkpoints) -> dict:
    """test_prefix_cache_host_tier's workload on its small pools: the device evicts the first prompt
    groups' shared prefixes to the host tier and the last wave hits them there."""
    options = dict(max_total_tokens=320, mamba_cache_size=8, chunked_prefill_size=128, prefix_cache_host_tier=True,
                   prefix_cache_host_bytes=8 << 20)  # (the engine's: 4 MiB a rank)
    ck = checkpoints["qwen3_next_dense"]
    return _case(checkpoints, "qwen3_next_dense@host_tier", "qwen3_next_dense", rounds=host_tier_waves(_vocab(ck["model"])),
                 **options)


def _elastic_phases(vocab: int) -> list[list[list[int]]]:
    """test_elastic_pools' chats (state-bound), then its long documents that outgrow the KV pool."""
    return [prompts for prompts, _ in flip_workload(vocab)]


def _elastic_case(checkpoints) -> dict:
    options = dict(max_running_requests=8, max_total_tokens=112, mamba_cache_size=32, chunked_prefill_size=64,
                   elastic_pools=True)
    ck = checkpoints["qwen3_next_dense"]
    return _case(checkpoints, "qwen3_next_dense@elastic", "qwen3_next_dense", rounds=_elastic_phases(_vocab(ck["model"])),
                 **options)


@pytest.fixture(scope="module")
def two_ranks(checkpoints, tmp_path_factory):
    cases = [_case(checkpoints, n, compile=(n == COMPILED)) for n in TWO_RANKS]
    cases += [_case(checkpoints, name, ck, n, **opts) for name, ck, opts, n in VARIANTS]
    cases.append(_tree_case(checkpoints, "qwen3_next_moe@tree", "qwen3_next_moe"))
    cases += _draft_model_cases(checkpoints)
    cases.append(_host_tier_case(checkpoints))
    cases.append(_elastic_case(checkpoints))
    return _run_group(2, cases, tmp_path_factory.mktemp("tp2"))[0]


@pytest.fixture(scope="module")
def four_ranks(checkpoints, tmp_path_factory):
    cases = [_case(checkpoints, n) for n in FOUR_RANKS]
    return _run_group(4, cases, tmp_path_factory.mktemp("tp4"))[0]


def _check(checkpoints, results, name, checkpoint=None, expected=None) -> dict:
    """The case's tokens equal HF greedy (or ``expected``); with n > 1 every sequence does."""
    r = results[name]
    ck = checkpoints[checkpoint or name]
    for batch, got, want in zip(ck["rounds"], r["outputs"], expected or ck["expected"]):
        for prompt, g, w in zip(batch, got, want):
            for seq in (g if g and isinstance(g[0], list) else [g]):
                em.assert_greedy_equal(ck["model"], prompt, seq, w, what=f"{name} tensor-parallel")
    assert r["prefix_hits"] > 0, "round two's prompts extend round one's: the prefix cache must hit"
    assert r["verify_steps"] > 0
    assert not any(r["pools_used"].values()), r["pools_used"]  # after close: every slot back
    return r


@pytest.mark.parametrize("name", TWO_RANKS)
def test_two_ranks_match_hf(checkpoints, two_ranks, name):
    r = _check(checkpoints, two_ranks, name)
    assert r["tp"]["size"] == 2 and r["tp"]["commands_broadcast"] > 0
    ranks = r["tp"]["ranks"]
    assert len(ranks) == 2 and all(x["shard_bytes"] < 0.75 * x["full_model_bytes"] for x in ranks)
    assert all(x["served_bytes"] == x["shard_bytes"] for x in ranks)  # (served as loaded: no quantization)
    # the pools hold the rank's heads and conv channels: half the single-process layout's (one KV
    # head is replicated; one Mamba2 B/C group too, so that case's conv is checked by its tokens)
    model = checkpoints[name]["model"]
    full = family_of(model).layout(model, kv_dtype=torch.float32, conv_dtype=torch.float32, ssm_dtype=torch.float32)
    assert r["kv_heads"] == [a.num_kv_heads // 2 if a.num_kv_heads % 2 == 0 else 1 for a in full.attention]
    if name == "minimax":  # no conv (a 1-wide placeholder): the lightning state [H, D, D] holds the rank's heads
        assert r["state_shapes"] == [[m.state_shape[0] // 2, *m.state_shape[1:]] for m in full.mamba]
    elif name != "mamba2_one_group":
        assert r["conv_dims"] == [m.conv_dim // 2 for m in full.mamba]


def test_draft_tree_two_ranks_match_hf(checkpoints, two_ranks):
    """Speculative draft trees under tensor parallelism: the tree metadata travel with the step."""
    _check(checkpoints, two_ranks, "qwen3_next_moe@tree", "qwen3_next_moe")


@pytest.mark.parametrize("name", ["qwen3_next_dense@draft_model", "qwen3_next_dense@draft_tree", "nemotron_h@hf_draft"])
def test_draft_model_two_ranks_match_hf(checkpoints, two_ranks, name):
    """A draft model under tensor parallelism runs on rank 0 alone (the other ranks' draft source never
    proposes: it would raise); its drafts reach rank 1 as the verify steps' input ids."""
    checkpoint, _ = name.split("@")
    r = _check(checkpoints, two_ranks, name, checkpoint)
    # the single-process engine with the same draft model: the same drafts taken in the same verify steps
    case = next(c for c in _draft_model_cases(checkpoints) if c["name"] == name)
    with hc.from_pretrained(case["dir"], **case["options"]) as engine:
        outputs = [engine.generate_batch(batch, max_new_tokens=NEW) for batch in case["rounds"]]
        spec = engine.stats()["speculative"]
    assert outputs == r["outputs"]
    assert (r["verify_steps"], r["accepted"]) == (spec["verify_steps"], spec["accepted"])
    if checkpoint == "qwen3_next_dense":  # the target's own weights: drafts taken (a random Llama's: rejected)
        assert r["accepted"] >= 2 * r["verify_steps"], (r["accepted"], r["verify_steps"])


def test_draft_model_fault_on_rank0_leaves_the_group_serving(checkpoints, two_ranks):
    """A draft model that raises half-way through a forward on rank 0 (before anything of the step
    reached rank 1): that step's call raises the very error, the group is not torn down, and every
    request of both rounds ends with HF's greedy tokens (the draft side forgets the requests it was
    proposing for and recomputes them)."""
    r = _check(checkpoints, two_ranks, "qwen3_next_dense@draft_fault", "qwen3_next_dense")
    assert r["raised"] == ["injected fault in the draft model"], r["raised"]
    assert r["tp"]["commands_broadcast"] > 0


def _check_workload(model, r: dict, rounds, what: str) -> dict:
    """A case served over its own workload ``rounds``: no error, every output HF's greedy tokens."""
    assert "error" not in r, r
    for batch, got in zip(rounds, r["outputs"], strict=True):
        for prompt, g in zip(batch, got, strict=True):
            em.assert_greedy_equal(model, prompt, g, em.hf_greedy(model, prompt, NEW), what=f"{what} over 2 ranks")
    return r


def test_host_tier_two_ranks_match_hf(checkpoints, two_ranks):
    """The prefix cache's host tier under tensor parallelism: rank 0's cache evicts nodes to the host
    and loads them back on a hit, every rank copying its shard's slots to and from the same host
    positions (``HOST_WRITE`` / ``HOST_LOAD``); greedy tokens equal HF's, the tier written and hit."""
    model = checkpoints["qwen3_next_dense"]["model"]
    r = _check_workload(model, two_ranks["qwen3_next_dense@host_tier"], host_tier_waves(_vocab(model)), "host tier")
    st = r["prefix_cache"]
    assert st["host_tier"] and st["host_written_tokens"] > 0 and st["host_hits"] > 0 and st["host_loaded_tokens"] > 0, st
    assert st["host_pool"]["load_bytes"] > 0 and st["host_pool"]["kv_tokens"] > 0
    assert not any(r["pools_used"].values()), r["pools_used"]


def test_elastic_pools_two_ranks_match_hf(checkpoints, two_ranks):
    """Elastic pools under tensor parallelism: rank 0's scheduler moves memory from the Mamba pool to
    the KV pool when the long documents arrive, the other ranks resize in step (``RESIZE``); greedy
    tokens equal HF's and every slot is back after close."""
    model = checkpoints["qwen3_next_dense"]["model"]
    r = _check_workload(model, two_ranks["qwen3_next_dense@elastic"], _elastic_phases(_vocab(model)), "elastic pools")
    assert r["elastic"]["to_kv"] > 0 and r["elastic"]["kv_tokens"] > 112, r["elastic"]
    assert not any(r["pools_used"].values()), r["pools_used"]


def test_kernel_warm_up_runs_on_every_rank(checkpoints, two_ranks):
    """warmup_kernels=True (the default on CUDA): rank 0's warm-up steps reach rank 1 once it
    follows, after the start-up collectives (a step sent before them deadlocked both ranks), and
    the warm-up leaves no trace in the tokens."""
    r = _check(checkpoints, two_ranks, "qwen3_next_moe@warmup", "qwen3_next_moe")
    assert r["startup"]["warmup_s"] > 0, r["startup"]


def test_compiled_two_ranks_zero_graph_breaks(two_ranks):
    c = two_ranks[COMPILED]["compile"]
    assert c["enabled"] and c["graph_breaks"] == 0 and c["recompiles"] == 0 and c["graphs"] >= 1


def test_compiled_gated_deltanet_two_ranks_zero_graph_breaks(checkpoints, two_ranks):
    r = _check(checkpoints, two_ranks, "qwen3_next_dense@compiled", "qwen3_next_dense")
    c = r["compile"]
    assert c["enabled"] and c["graph_breaks"] == 0 and c["recompiles"] == 0 and c["graphs"] >= 1


@KIMI
def test_compiled_kimi_linear_two_ranks_zero_graph_breaks(checkpoints, two_ranks):
    """Kimi-Linear (KDA + MLA + MoE) compiled over 2 ranks: HF's tokens, one graph."""
    r = _check(checkpoints, two_ranks, "kimi_linear@compiled", "kimi_linear_2l")
    c = r["compile"]
    assert c["enabled"] and c["graph_breaks"] == 0 and c["recompiles"] == 0 and c["graphs"] >= 1
    assert c["split_ops_seen"] == {"hybrid_compile::kda_layer": 1, "hybrid_compile::mla_layer": 1}, c


@KIMI
def test_kimi_linear_shards_split_heads_and_replicate_the_latent(checkpoints):
    """Each rank's Kimi-Linear shard, loaded from the checkpoint's own layout (``q_conv1d`` /
    ``k_conv1d`` / ``v_conv1d``, per-expert ``w1`` / ``w3`` / ``w2`` under ``block_sparse_moe``):
    KDA and MLA parameters hold the rank's heads (the ranks' parts concatenate to the whole tensor),
    the latent projections and norms are whole on both ranks, and the rank's KV pool layout keeps
    the whole compressed row (latent + rope key, one KV head) while its conv holds half the channels."""
    from hybrid_compile.distributed.loading import load_shard
    from kimi_models import KV_RANK, ROPE

    ck = checkpoints["kimi_linear"]
    full = dict(ck["model"].named_parameters())
    cfg = ck["model"].config
    shards = []
    for rank in (0, 1):
        local, _ = load_shard(ck["dir"], cfg, plan_for(cfg, 2, rank), torch.float32, torch.device("cpu"))
        shards.append(dict(local.named_parameters()))
    kda, mla = "model.layers.0.self_attn.", "model.layers.1.self_attn."
    split = {kda + "q_proj.weight": 0, kda + "v_proj.weight": 0, kda + "forget_gate.f_b_proj.weight": 0,
             kda + "forget_gate.dt_bias": 0, kda + "forget_gate.A_log": 2, kda + "b_proj.weight": 0,
             kda + "g_b_proj.weight": 0, kda + "o_proj.weight": 1, mla + "q_proj.weight": 0,
             mla + "kv_b_proj.weight": 0, mla + "o_proj.weight": 1, "model.layers.1.mlp.experts.down_proj": 2}
    for name, dim in split.items():
        assert torch.equal(torch.cat([s[name] for s in shards], dim), full[name]), name
    conv = kda + "conv1d.weight"  # channels [q | k | v], each split by heads
    assert torch.equal(torch.cat([s[conv].view(3, -1, 4) for s in shards], 1), full[conv].view(3, -1, 4))
    for name in (mla + "kv_a_proj_with_mqa.weight", mla + "kv_a_layernorm.weight", kda + "forget_gate.f_a_proj.weight",
                 kda + "g_a_proj.weight", kda + "o_norm.weight", "model.layers.1.mlp.gate.weight"):
        assert all(torch.equal(s[name], full[name]) for s in shards), name
    lay = family_of(local).layout(local, kv_dtype=torch.float32, conv_dtype=torch.float32, ssm_dtype=torch.float32)
    assert [(a.num_kv_heads, a.k_shape, a.v_from_k) for a in lay.attention] == [(1, (1, KV_RANK + ROPE), True)] * 2
    assert [m.conv_dim for m in lay.mamba] == [3 * 16] * 2 and lay.mamba[0].state_shape == (1, 16, 16)


@pytest.mark.parametrize("name", ["qwen3_next_moe@fused_moe", "nemotron_h@fused_moe"])
def test_fused_moe_two_ranks_match_hf(checkpoints, two_ranks, name):
    """The fused experts (gated silu; relu2 without a gate) over a rank's half of the intermediate dim, the
    fused routers (softmax; NemotronH's sigmoid group-limited one) replicated;
    Qwen3-Next's shared expert folded into its routed experts inside the block's all-reduce (a rank's
    slices of both have one width)."""
    r = _check(checkpoints, two_ranks, name, name.split("@")[0])
    assert r["fused_moe_modules"] > 0
    assert r["fused_moe_routers"] > 0  # (NemotronH's: the sigmoid group-limited router op)
    assert (r["folded_shared_experts"] > 0) == name.startswith("qwen3_next")  # (NemotronH: no gated shared expert)


def test_two_sequences_per_prompt_fork_on_every_rank(checkpoints, two_ranks):
    """n = 2 (greedy): both sequences of each prompt equal HF greedy, so the fork's copies of the
    prompt's KV and recurrent state reached rank 1 too."""
    r = _check(checkpoints, two_ranks, "qwen3_next_moe@n2", "qwen3_next_moe")
    assert all(len(per_prompt) == 2 for batch in r["outputs"] for per_prompt in batch)


def test_bf16_recurrent_state_equals_the_single_process_engine(checkpoints, two_ranks):
    """ssm_state_dtype="bfloat16" over 2 ranks gives the single-process engine's tokens (the same
    state rounding, on each rank's own heads)."""
    ck = checkpoints["nemotron_h"]
    opts = {k: v for k, v in OPTIONS.items() if k != "device"}
    engine = hc.wrap(ck["model"], ssm_state_dtype="bfloat16", **opts)
    try:
        single = [engine.generate_batch(batch, max_new_tokens=NEW) for batch in ck["rounds"]]
    finally:
        engine.close()
    assert two_ranks["nemotron_h@bf16_state"]["outputs"] == single


def test_minimax_bf16_two_ranks_equal_the_single_process_engine(checkpoints, two_ranks):
    """MiniMax in bf16 over 2 ranks (lightning heads, their norm reduced across the ranks, the rebuilt
    decay slopes in the layer's dtype, the experts' halves) gives the single-process bf16 engine's
    tokens, and both give HF's fp32 greedy tokens (the model's weights keep bf16 rounding below its
    top-2 gaps: ``BF16_INIT_STD`` in tests/minimax_models.py)."""
    ck = checkpoints["minimax_bf16"]
    opts = {**OPTIONS, "dtype": "bfloat16"}
    engine = hc.from_pretrained(ck["dir"], **opts)
    try:
        single = [engine.generate_batch(batch, max_new_tokens=NEW) for batch in ck["rounds"]]
    finally:
        engine.close()
    tp = two_ranks["minimax@bf16"]
    assert "error" not in tp, tp
    assert tp["outputs"] == single
    _check(checkpoints, two_ranks, "minimax@bf16", "minimax_bf16")


@pytest.mark.parametrize("name", FOUR_RANKS)
def test_four_ranks_match_hf(checkpoints, four_ranks, name):
    r = _check(checkpoints, four_ranks, name)
    assert r["tp"]["size"] == 4


def _collectives_main(rank: int, port: int, result_path: str) -> None:
    """One gloo rank: the group's all-reduce and last-dim all-gather, eager and compiled with
    fullgraph=True (no graph break), against the sum and the concatenation of every rank's input."""
    import torch.distributed as dist

    from hybrid_compile.distributed.group import TensorParallelGroup

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tp = TensorParallelGroup(rank, 2, torch.device("cpu"), dist.group.WORLD, dist.group.WORLD, None)
    inputs = [torch.arange(24.0).view(2, 3, 4) + 100 * r for r in range(2)]
    got = {}
    for mode in ("eager", "compiled", "op eager", "op compiled"):
        # "op": the all-reduce through the one-shot op (hybrid_compile::tp_all_reduce), here on its gloo
        # path (no symmetric buffer on CPU; its one-shot kernel: tests/test_tensor_parallel_gpu.py)
        tp.one_shot = mode.startswith("op")
        reduce, gather = tp.all_reduce, tp.all_gather_last
        if mode.endswith("compiled"):  # aot_eager: Dynamo and AOT tracing, no Inductor codegen (fast)
            torch._dynamo.reset()
            reduce, gather = (torch.compile(f, fullgraph=True, backend="aot_eager") for f in (reduce, gather))
        got[mode] = dict(reduce=torch.equal(reduce(inputs[rank] * 1), sum(inputs)),
                         gather=torch.equal(gather(inputs[rank][:, 1:]), torch.cat([x[:, 1:] for x in inputs], -1)))
    # the op's registration (schema, fake, dispatch) by opcheck; every rank runs the same calls
    torch.library.opcheck(torch.ops.hybrid_compile.tp_all_reduce.default, (inputs[rank][:, 1:], tp.group_name))
    got["opcheck"] = True
    dist.barrier()
    dist.destroy_process_group()
    finish_rank(rank, got, result_path)


def test_collectives_trace_into_one_graph(tmp_path):
    """The model's collectives trace with no graph break (torch 2.11's ``funcol.all_gather_tensor``
    on the last dim broke the graph in ``_maybe_view_chunk_cat``) and give the sum / the columns of
    every rank in rank order (a non-contiguous input included), eagerly and compiled; so does the
    all-reduce through the one-shot op (its gloo path), which passes opcheck."""
    path = str(tmp_path / "collectives.json")
    torch.multiprocessing.start_processes(_collectives_main, args=(free_port(), path), nprocs=2, start_method="spawn")
    with open(path) as f:
        got = json.load(f)
    modes = ("eager", "compiled", "op eager", "op compiled")
    assert got == {**{m: dict(reduce=True, gather=True) for m in modes}, "opcheck": True}, got


def test_fp8_quantization_two_ranks_equal_the_single_process_engine(checkpoints, two_ranks):
    """quantization="fp8" over 2 ranks: each rank quantizes its shard before the collectives go in
    (quantizing after them dropped the row-parallel projections' all-reduces). On a model whose shard
    boundaries fall on the 128 x 128 blocks the ranks' FP8 weights are the single process's block for
    block, so the greedy tokens equal the single-process FP8 engine's."""
    from hybrid_compile.quantization import has_fp8_layers

    ck = checkpoints["qwen3_next_fp8"]
    opts = {k: v for k, v in OPTIONS.items() if k != "device"}
    with hc.from_pretrained(ck["dir"], device="cpu", quantization="fp8", **opts) as engine:
        assert has_fp8_layers(engine.model)
        single = [engine.generate_batch(batch, max_new_tokens=NEW) for batch in ck["rounds"]]
    assert two_ranks["qwen3_next_fp8@fp8"]["outputs"] == single
    # each rank reports its weights as served: the e4m3 shard and its scales, under 0.6x the fp32 shard it loaded
    ranks = two_ranks["qwen3_next_fp8@fp8"]["tp"]["ranks"]
    assert all(0 < r["served_bytes"] < 0.6 * r["shard_bytes"] for r in ranks), ranks


def test_fp8_checkpoint_two_ranks_equal_the_single_process_engine(checkpoints, two_ranks):
    """An FP8 checkpoint at tensor_parallel_size=2: each rank reads its e4m3 slices and the block scales
    over them (no float copy), so the ranks serve the single-process FP8 engine's greedy tokens."""
    ck = checkpoints["qwen3_next_fp8_checkpoint"]
    opts = {k: v for k, v in OPTIONS.items() if k != "device"}
    # (float32 on both sides: the checkpoint's float tensors and config are bfloat16, whose rounding of the
    # ranks' partial sums, in another order than one process's, moved a near-tied greedy pick)
    with hc.from_pretrained(ck["dir"], device="cpu", dtype="float32", **opts) as engine:
        single = [engine.generate_batch(batch, max_new_tokens=NEW) for batch in ck["rounds"]]
    assert two_ranks["qwen3_next_fp8@checkpoint"]["outputs"] == single


def test_fp8_checkpoint_shards_are_the_single_process_blocks(checkpoints):
    """Each rank's FP8 projection and experts weights and block scales are the single-process FP8
    model's, sliced on whole 128 x 128 blocks along the plan's split (column-parallel: rows;
    row-parallel: columns); the checkpoint's float tensors (norms, routers) stay float."""
    from hybrid_compile.distributed.loading import load_shard
    from hybrid_compile.quantization import Fp8Experts, Fp8Linear, load_quantized_model

    d = checkpoints["qwen3_next_fp8_checkpoint"]["dir"]
    config = transformers.AutoConfig.from_pretrained(d)
    single = load_quantized_model(d, config, device="cpu", dtype=torch.float32)
    whole = dict(single.named_parameters())
    ranks = [load_shard(d, config, plan_for(config, 2, r), torch.float32, torch.device("cpu"))[0] for r in range(2)]
    fp8_names = [n for n, m in single.named_modules() if isinstance(m, (Fp8Linear, Fp8Experts))]
    assert fp8_names and all(type(r.get_submodule(n)) is type(single.get_submodule(n)) for r in ranks for n in fp8_names)
    for name in ("model.layers.0.linear_attn.in_proj_qkvz", "model.layers.1.self_attn.o_proj",
                 "model.layers.0.mlp.experts"):
        for pname, full in single.get_submodule(name).named_parameters():
            parts = [dict(r.get_submodule(name).named_parameters())[pname] for r in ranks]
            assert parts[0].dtype == full.dtype
            # the local tensors of both ranks hold every entry of the full one exactly once
            assert sum(p.numel() for p in parts) == full.numel(), (name, pname)
            assert sorted(torch.cat([p.float().flatten() for p in parts]).tolist()) == \
                sorted(full.float().flatten().tolist()), (name, pname)
    o = "model.layers.1.self_attn.o_proj"  # row-parallel: each rank the columns (and scale columns) of its heads
    for r, rank in enumerate(ranks):
        local = rank.get_submodule(o)
        k = local.in_features
        assert torch.equal(local.weight.float(), whole[f"{o}.weight"][:, r * k:(r + 1) * k].float())
        assert torch.equal(local.weight_scale_inv, whole[f"{o}.weight_scale_inv"][:, r * k // 128:(r + 1) * k // 128])
        assert rank.get_submodule("model.layers.0.mlp.gate").weight.dtype == torch.float32


def test_fp8_checkpoint_off_the_blocks_is_one_clear_error(tmp_path):
    """An FP8 checkpoint whose shards would cut its 128 x 128 scale blocks (the tiny Qwen3-Next MoE:
    64-wide heads) cannot be split: the shard loader names the tensor, the rank and the blocks."""
    from hybrid_compile.distributed.loading import load_shard

    model = em.build_model("qwen3_next_moe", 0)
    d = save_fp8_checkpoint(model, tmp_path / "fp8")
    config = transformers.AutoConfig.from_pretrained(d)
    with pytest.raises(ValueError, match=r"rank 0 of 2 would hold entries .* of FP8 checkpoint tensor .*"
                                         r"do not start and end on its 128 x 128 scale blocks"):
        load_shard(str(d), config, plan_for(config, 2, 0), torch.float32, torch.device("cpu"))


def test_follower_config_keeps_the_draft_model_on_rank0(checkpoints):
    """The other ranks' configuration under method "draft_model": the same verify shape (drafts per
    step, a tree's nodes), no draft model (it is not sent to their processes), a source that raises
    if ever asked; every other configuration passes unchanged."""
    from hybrid_compile.distributed.runtime import LeaderDrafts, follower_config
    from hybrid_compile.engine import EngineConfig

    model = checkpoints["qwen3_next_dense"]["model"]
    for spec in (dict(method="draft_model", draft_model=model, num_draft_tokens=3),
                 dict(method="draft_model", draft_model=model, num_draft_tokens=2, topk=3),
                 dict(method="draft_model", draft_model=model, num_draft_tokens=3, topk=2, num_tree_nodes=4)):
        config = EngineConfig.from_args(device="cpu", speculative=spec)
        follower = follower_config(config).speculative
        assert follower.draft_model is None and isinstance(follower.draft_source, LeaderDrafts)
        assert (follower.draft_nodes, follower.num_draft_tokens, follower.topk) == (
            config.speculative.draft_nodes, config.speculative.num_draft_tokens, config.speculative.topk)
        with pytest.raises(RuntimeError, match="a follower rank never proposes"):
            follower.draft_source.propose_tree([], 2, 2, 4)
    ngram = EngineConfig.from_args(device="cpu", speculative=OPTIONS["speculative"])
    assert follower_config(ngram) is ngram


def test_mtp_draft_graphs_that_cannot_run_fail_before_launch(checkpoints):
    """The MTP proposal graphs asked for (``extra["mtp_draft_graphs"]=True``) where they cannot run (CPU
    ranks: no full CUDA graphs): the single-process engine's error naming the option, raised before any
    rank process starts (the proposal graphs at TP: tests/test_tensor_parallel_mtp.py's
    ``@proposal_graphs`` case, and on GPUs tests/test_tensor_parallel_gpu.py's MTP cases)."""
    d = checkpoints["qwen3_next_dense"]["dir"]
    with pytest.raises(ValueError, match=r"extra\['mtp_draft_graphs'\]=True needs the engine's full CUDA graphs"):
        hc.from_pretrained(d, tensor_parallel_size=2, device="cpu", extra={"mtp_draft_graphs": True},
                           speculative={"method": "mtp", "num_draft_tokens": 2})


def test_one_shot_all_reduce_option(checkpoints):
    """``tensor_parallel_all_reduce``: an explicit "one_shot" where it cannot run (CPU ranks, a group
    size its kernel lacks, fp16, ranks whose processes mapped different numbers of buffers before) or
    without tensor parallelism raises one error naming the option;
    "auto" keeps NCCL (gloo) there. The op's size and dtype rule picks the one-shot kernel only for
    bf16 / fp32 tensors that fit the buffer in whole 16-byte vectors (the kernel itself:
    tests/test_tensor_parallel_gpu.py, the ``@one_shot`` cases)."""
    from hybrid_compile.distributed import one_shot

    d = checkpoints["qwen3_next_dense"]["dir"]
    with pytest.raises(ValueError, match="tensor_parallel_all_reduce='one_shot' cannot run here: symmetric memory "
                                         "needs CUDA devices"):
        hc.from_pretrained(d, tensor_parallel_size=2, device="cpu", tensor_parallel_all_reduce="one_shot")
    with pytest.raises(ValueError, match="tensor_parallel_all_reduce='one_shot' applies to tensor parallelism"):
        hc.wrap(checkpoints["qwen3_next_dense"]["model"], tensor_parallel_all_reduce="one_shot")
    with pytest.raises(ValueError, match="tensor_parallel_all_reduce must be one of auto, nccl, one_shot"):
        hc.wrap(checkpoints["qwen3_next_dense"]["model"], tensor_parallel_all_reduce="custom")
    cuda = torch.device("cuda")
    assert not one_shot.resolve("auto", torch.device("cpu"), 2, torch.bfloat16)
    assert not one_shot.resolve("nccl", cuda, 2, torch.bfloat16)
    assert not one_shot.resolve("auto", cuda, 3, torch.bfloat16)
    with pytest.raises(ValueError, match="built for 2, 4 or 8 ranks, not 3"):
        one_shot.resolve("one_shot", cuda, 3, torch.bfloat16)
    with pytest.raises(ValueError, match="sums bfloat16 and float32 tensors, not torch.float16"):
        one_shot.resolve("one_shot", cuda, 2, torch.float16)
    # a failed mapping (here: no such group) is one error naming the option that avoids it
    before = one_shot.mappings()
    with pytest.raises(RuntimeError, match="symmetric memory failed on cpu .*tensor_parallel_all_reduce='nccl'"):
        one_shot.enable("no such group", torch.device("cpu"))
    assert one_shot.mappings() == before + 1  # (counted as torch's exchanges are: per process, tried or not)
    # ranks pair up only with as many mappings before each (a second engine's rank 0 and new followers do not)
    assert one_shot.unpaired_reason([0, 0]) is None and one_shot.unpaired_reason([2, 2, 2, 2]) is None
    assert "mapped [1, 0] symmetric buffers before" in one_shot.unpaired_reason([1, 0])
    buffer = torch.empty(64, dtype=torch.uint8)
    takes = one_shot.takes_one_shot
    assert takes(torch.ones(8, dtype=torch.bfloat16), buffer) and takes(torch.ones(2, 8), buffer)
    assert not takes(torch.ones(3, dtype=torch.bfloat16), buffer)  # 6 bytes: not whole vectors
    assert not takes(torch.ones(40, dtype=torch.bfloat16), buffer)  # 80 bytes: above the buffer
    assert not takes(torch.ones(8, dtype=torch.float16), buffer)
    assert not takes(torch.ones(8, dtype=torch.bfloat16), None)  # no buffer (NCCL chosen, or CPU)


def test_indivisible_heads_fail_before_loading(checkpoints, tmp_path):
    d = checkpoints["qwen3_next_moe"]["dir"]  # 2 linear key heads
    with pytest.raises(ShardingError, match="linear_num_key_heads=2.*does not divide by 4"):
        hc.from_pretrained(d, tensor_parallel_size=4, device="cpu")
    model = checkpoints["olmo_hybrid"]["model"]  # 2 KV heads: its cross-rank k_norm needs them split
    with pytest.raises(ShardingError, match="num_key_value_heads=2.*does not divide by 4"):
        hc.from_pretrained(checkpoints["olmo_hybrid"]["dir"], tensor_parallel_size=4, device="cpu")
    with pytest.raises(ShardingError, match="num_key_value_heads=2.*does not divide by 4"):
        hc.wrap(model, tensor_parallel_size=4)  # (before the model is saved for the ranks)
    lfm = copy.deepcopy(checkpoints["lfm2"]["model"].config)  # a dense MLP 66 wide: the plan refuses 4 ranks
    lfm.block_auto_adjust_ff_dim, lfm.intermediate_size = False, 66
    with pytest.raises(ShardingError, match="lfm2 has the feed-forward width=66, which does not divide by 4"):
        plan_for(lfm, 4)
    granite = copy.deepcopy(checkpoints["granitemoehybrid"]["model"].config)  # experts 65 wide: named by its field
    granite.intermediate_size = 65
    assert granite.num_local_experts > 1
    with pytest.raises(ShardingError, match="granitemoehybrid has intermediate_size=65, which does not divide by 2"):
        plan_for(granite, 2)
    bamba = copy.deepcopy(checkpoints["bamba"]["model"].config)  # 2 B/C groups: over 4 ranks each on two of them
    assert bamba.mamba_n_groups == 2
    plan = plan_for(bamba, 4, 3)
    assert [(w, g, r) for _, w, g, r in plan.cross_rank_norms] == [(bamba.mamba_n_heads * bamba.mamba_d_head // 2, True, 2)]
    bamba.mamba_n_groups, bamba.mamba_n_heads = 3, 6
    with pytest.raises(ShardingError, match="n_groups=3 Mamba2 B/C groups: neither a multiple nor a divisor of 2"):
        plan_for(bamba, 2)
    with pytest.raises(ShardingError, match="zamba2 has the Mamba2 head count=8, which does not divide by 3"):
        hc.from_pretrained(checkpoints["zamba2"]["dir"], tensor_parallel_size=3, device="cpu")
    if "kimi_linear" in MODELS:  # 2 KDA heads, 4 MLA heads: one error naming the count, before any weight is read
        with pytest.raises(ShardingError, match="kimi_linear has linear_num_heads=2, which does not divide by 4"):
            hc.from_pretrained(checkpoints["kimi_linear"]["dir"], tensor_parallel_size=4, device="cpu")
        kimi = copy.deepcopy(checkpoints["kimi_linear"]["model"].config)
        kimi.linear_num_heads = 6
        with pytest.raises(ShardingError, match="kimi_linear has num_attention_heads=4, which does not divide by 3"):
            plan_for(kimi, 3)
    import transformers

    with pytest.raises(ShardingError, match="'llama' has no tensor-parallel sharding plan"):
        plan_for(transformers.LlamaConfig(), 2)


def test_wrap_serves_a_model_in_memory_over_two_ranks(checkpoints, tmp_path, monkeypatch):
    """``hc.wrap(model, tensor_parallel_size=2)``: the model saved once for the ranks (rank 1 spawned
    here), each loading its shard; greedy tokens equal HF's over two rounds (prefix-cache hits, n-gram
    drafts); the save is gone once the engine is up; the model in this process is untouched."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # (where the save goes)
    ck = checkpoints["qwen3_next_moe"]
    model = ck["model"]
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    opts = {k: v for k, v in OPTIONS.items() if k != "device"}  # (the ranks run where the weights are: the CPU)
    engine = hc.wrap(model, tensor_parallel_size=2, **opts)
    try:
        assert not any(tmp_path.iterdir()), list(tmp_path.iterdir())
        outputs = [engine.generate_batch(batch, max_new_tokens=NEW) for batch in ck["rounds"]]
        stats = engine.stats()
    finally:
        engine.close()
    for batch, got, want in zip(ck["rounds"], outputs, ck["expected"]):
        for prompt, g, w in zip(batch, got, want):
            em.assert_greedy_equal(model, prompt, g, w, what="wrap over 2 ranks")
    tp = stats["tensor_parallel"]
    assert tp["size"] == 2 and tp["saved_checkpoint_s"] > 0 and tp["commands_broadcast"] > 0
    assert all(r["shard_bytes"] < 0.75 * r["full_model_bytes"] for r in tp["ranks"]), tp["ranks"]
    assert stats["prefix_cache"]["admitted_hit_tokens"] > 0 and stats["speculative"]["verify_steps"] > 0
    state = model.state_dict()
    assert state.keys() == weights.keys() and all(torch.equal(state[k], v) for k, v in weights.items())
    assert em.hf_greedy(model, ck["rounds"][0][1], NEW) == ck["expected"][0][1]  # (not patched: HF's forward)


def test_wrap_over_ranks_refuses_what_it_cannot_serve(checkpoints, tmp_path, monkeypatch):
    """Each refusal is one clear error before anything is saved or started."""
    import tempfile

    from hybrid_compile.quantization import quantize_model

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    model = checkpoints["qwen3_next_dense"]["model"]
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        hc.wrap(model, tensor_parallel_size=0)
    with pytest.raises(ValueError, match="tensor_parallel_timeout.*is for tensor_parallel_size > 1"):
        hc.wrap(model, tensor_parallel_timeout=5.0)
    fp8 = copy.deepcopy(model)
    assert quantize_model(fp8) > 0
    with pytest.raises(ValueError, match="holds FP8 layers; wrap the float model with quantization='fp8'"):
        hc.wrap(fp8, tensor_parallel_size=2)
    with pytest.raises(TypeError, match="unknown EngineConfig field.*max_total_tokenz"):
        hc.wrap(model, tensor_parallel_size=2, max_total_tokenz=5)

    def failing_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(model, "save_pretrained", failing_save)
    with pytest.raises(OSError, match="disk full"):  # (the half-written save is removed)
        hc.wrap(model, tensor_parallel_size=2)
    assert not any(tmp_path.iterdir())


_WRAP_UNDER_TORCHRUN = """
import json, os, sys, tempfile
import transformers
import hybrid_compile as hc
ckpt, prompts, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype="float32").eval()  # every rank's, in memory
engine = hc.wrap(model, tensor_parallel_size=2, max_total_tokens=512, mamba_cache_size=24, max_running_requests=2,
                 chunked_prefill_size=32)
if engine is not None:
    outputs = engine.generate_batch(prompts, max_new_tokens=%d)
    saved = engine.stats()["tensor_parallel"]["saved_checkpoint_s"]
    left = [d for d in os.listdir(tempfile.gettempdir()) if d.startswith("hybrid_compile_tp_")]
    engine.close()
    json.dump(dict(outputs=outputs, saved=saved, left=left, rank=os.environ["RANK"]), open(out, "w"))
""" % NEW


def test_wrap_under_torchrun_serves_rank0s_model(checkpoints, tmp_path):
    """Under torchrun every rank calls ``hc.wrap(model, tensor_parallel_size=2)`` with its model in
    memory: rank 0 saves its model once and publishes the directory in the group's store, both ranks
    load their shards from it, rank 0 removes it once both hold them; rank 0 gets the engine (HF's
    greedy tokens), rank 1 follows inside the call."""
    import subprocess

    ck = checkpoints["qwen3_next_moe"]
    script, out, tmp = tmp_path / "wrap_torchrun.py", tmp_path / "out.json", tmp_path / "tmp"
    tmp.mkdir()
    script.write_text(_WRAP_UNDER_TORCHRUN)
    prompts = ck["rounds"][0]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
           ck["dir"], json.dumps(prompts), str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                       env=checkout_env(OMP_NUM_THREADS="1", TMPDIR=str(tmp)))
    assert out.exists(), p.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["rank"] == "0" and result["saved"] > 0 and result["left"] == [], result
    for prompt, g, w in zip(prompts, result["outputs"], ck["expected"][0]):
        em.assert_greedy_equal(ck["model"], prompt, g, w, what="wrap under torchrun")
    assert not any(tmp.glob("hybrid_compile_tp_*"))
    if p.returncode != 0:
        from test_loading_cli import _aborted_at_exit

        if _aborted_at_exit(p.stderr):  # (the known gloo teardown abort: see that test module)
            pytest.xfail("a rank aborted at interpreter exit after a complete run (known gloo teardown issue)")
    assert p.returncode == 0, p.stderr[-4000:]


def test_spawned_ranks_memory_and_failure_on_rank0(tmp_path, monkeypatch, capsys):
    """from_pretrained spawns rank 1 itself; each rank's peak host memory while loading stays near its
    shard (about half the model); rank 0's start-up phases (its shard's load included) are timed and
    shown with progress=True; a fault on rank 0 (the user's process) ends rank 1 too and reaches the
    caller unchanged."""
    import transformers

    cfg = em.make_config("qwen3_5")
    cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size = 8192, 256, 512
    model = transformers.Qwen3_5ForCausalLM(cfg).float().eval()
    model.save_pretrained(tmp_path)
    prompt = em.random_prompts([9], 8192, seed=5)[0]
    expected = em.hf_greedy(model, prompt, NEW)
    opts = {k: v for k, v in OPTIONS.items() if k != "speculative"}
    engine = hc.from_pretrained(tmp_path, tensor_parallel_size=2, progress=True, **opts)
    try:
        startup = engine.stats()["startup"]
        assert min(startup["load_s"], startup["pools_s"], startup["patch_s"]) > 0, startup
        assert sum(v for k, v in startup.items() if k != "total_s") <= startup["total_s"], startup
        err = capsys.readouterr().err.replace("\r", "\n")
        assert "(rank 0 of 2)" in err and ", load]" in err and "3/3 phases" in err and ", ready]" in err, err
        assert engine.generate_batch([prompt], max_new_tokens=NEW) == [expected]
        ranks = engine.stats()["tensor_parallel"]["ranks"]
        full = ranks[0]["full_model_bytes"]
        for r in ranks:
            assert 0.45 * full < r["shard_bytes"] < 0.6 * full
            assert r["peak_host_bytes"] < 0.75 * full, ranks
        processes = list(engine._processes)
        from hybrid_compile.models import gated_deltanet

        def failing(self, *args, **kwargs):
            raise ValueError("injected fault on rank 0")

        for m in engine.model.modules():
            if "forward" in m.__dict__ and getattr(m.__dict__["forward"], "__func__", None) is gated_deltanet.gdn_mixer_forward:
                m.forward = failing.__get__(m)
        t0 = time.perf_counter()
        with pytest.raises(ValueError, match="injected fault on rank 0"):
            engine.generate_batch([prompt], max_new_tokens=NEW)
        for p in processes:
            p.join(30)
            assert p.exitcode not in (None, 0)
        assert time.perf_counter() - t0 < 60
        with pytest.raises(TensorParallelError, match="failed earlier"):
            engine.generate_batch([prompt], max_new_tokens=NEW)
    finally:
        engine.close()


_TWO_ENGINES = """
import json, os, sys, time
import hybrid_compile as hc
ckpt, prompts, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
outputs = []
for i in range(2):
    if i == 1 and os.environ["RANK"] == "0":
        time.sleep(3)  # rank 1 reaches the second rendezvous first
    engine = hc.from_pretrained(ckpt, tensor_parallel_size=2, device="cpu", tokenizer=False)
    if engine is not None:
        outputs.append(engine.generate_batch(prompts, max_new_tokens=%d))
        engine.close()
if outputs:
    json.dump(outputs, open(out, "w"))
""" % NEW


def test_torchrun_process_serves_a_second_engine(checkpoints, tmp_path):
    """Under torchrun, a process that closes its engine and opens another (every rank the same):
    the second rendezvous waits for every rank (it once went ahead on the first one's keys in
    torchrun's store and hung), and both engines give HF's greedy tokens."""
    import subprocess
    import sys

    ck = checkpoints["qwen3_next_moe"]
    script, out = tmp_path / "two_engines.py", tmp_path / "out.json"
    script.write_text(_TWO_ENGINES)
    prompts = ck["rounds"][0]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
           ck["dir"], json.dumps(prompts), str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=checkout_env(OMP_NUM_THREADS="1"))
    assert out.exists(), p.stderr[-4000:]
    outputs = json.loads(out.read_text())
    assert len(outputs) == 2
    for got in outputs:
        for prompt, g, w in zip(prompts, got, ck["expected"][0]):
            em.assert_greedy_equal(ck["model"], prompt, g, w, what="a torchrun engine")
    if p.returncode != 0:
        from test_loading_cli import _aborted_at_exit

        if _aborted_at_exit(p.stderr):  # (the known gloo teardown abort: see that test module)
            pytest.xfail("a rank aborted at interpreter exit after a complete run (known gloo teardown issue)")
    assert p.returncode == 0, p.stderr[-4000:]


def test_follower_failure_reaches_rank0(checkpoints, tmp_path):
    """A fault on rank 1 ends rank 1 with it; rank 0's generate raises TensorParallelError naming
    rank 1 and its error (no hang)."""
    case = dict(_case(checkpoints, "qwen3_next_moe"), fail_rank=1)
    t0 = time.perf_counter()
    results, codes = _run_group(2, [case], tmp_path, expect_failure=True)
    assert time.perf_counter() - t0 < 120
    err = results["qwen3_next_moe"]["error"]
    assert err.startswith("TensorParallelError") and "rank 1" in err and "injected fault in the GDN mixer" in err
    assert codes[0] == 0 and codes[1] != 0


def test_benchmark_smoke_run(tmp_path):
    """benchmarks/tensor_parallel.py --device cpu --tiny at TP 1 and 2: every measurement present."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "tp.json"
    cmd = [sys.executable, os.path.join(root, "benchmarks", "tensor_parallel.py"), "--device", "cpu", "--tiny",
           "--tp", "1,2", "--batches", "1,2", "--prefill", "24", "--prompt-len", "8", "--new-tokens", "3",
           "--workdir", str(tmp_path / "ckpt"), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=root,
                          env=checkout_env(OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads(out.read_text())
    tp1, tp2 = run["results"]
    assert (tp1["tp"], tp2["tp"]) == (1, 2) and tp1["all_reduce"] is None
    for r in (tp1, tp2):
        assert set(r["decode"]) == {"1", "2"} and r["decode"]["2"]["decode_tokens"] == 2 * 2
        assert r["prefill"]["24"]["tokens_per_s"] > 0
    assert tp2["all_reduce"]["all_reduce_calls"] > 0 and tp2["all_reduce"]["all_reduce_ms_per_step"] > 0
    # rank 0's host side per step: the all-reduces' waits among its ops
    host = tp2["all_reduce"]["top_host_ops"]
    assert host and all(o["ms_per_step"] > 0 for o in host) and any("all_reduce" in o["name"] or "allreduce" in o["name"]
                                                                    or "wait_tensor" in o["name"] for o in host)
    assert len(tp2["tensor_parallel"]["ranks"]) == 2
    assert tp2["tensor_parallel"]["all_reduce"] == {"mode": "gloo"}  # ("auto" on CPU ranks)
    # the prefill's own profile: its steps (24 tokens in one chunk), all-reduces and host ops
    pre = tp2["prefill_profile"]
    assert pre["length"] == 24 and pre["steps"] >= 1 and pre["all_reduce_calls"] > 0 and pre["top_host_ops"]
    assert set(run["scaling"]["2"]) == {"decode_1", "decode_2", "prefill_24"}


def test_random_weights_draw_each_rank_shard(tmp_path):
    """A directory of config.json + random_weights.json (benchmarks of shapes too large for disk):
    each rank's shard is drawn slice by slice in the local model's shapes, the same values on every
    load, norms 1; the single-process path refuses such a directory."""
    from hybrid_compile.distributed.loading import RANDOM_WEIGHTS, load_shard
    from hybrid_compile.loading import LoadError

    cfg = em.make_config("qwen3_next_moe")
    cfg.save_pretrained(tmp_path)
    (tmp_path / RANDOM_WEIGHTS).write_text(json.dumps({"seed": 3, "std": 0.5}))
    full = em.build_model("qwen3_next_moe", config=cfg)
    for rank in (0, 1):
        plan = plan_for(cfg, 2, rank)
        model, report = load_shard(str(tmp_path), cfg, plan, torch.float32, torch.device("cpu"))
        again, _ = load_shard(str(tmp_path), cfg, plan, torch.float32, torch.device("cpu"))
        local = {n: p for n, p in again.named_parameters()}
        for name, p in model.named_parameters():
            assert torch.equal(p, local[name]), name
            if name.endswith("norm.weight"):
                assert torch.all(p == 1), name
            elif p.numel() > 16:
                assert 0.3 < float(p.std()) < 0.7, (name, float(p.std()))
        expert = model.model.layers[0].mlp.experts.gate_up_proj
        assert expert.shape[-2:] != full.model.layers[0].mlp.experts.gate_up_proj.shape[-2:]  # split
        assert report.shard_bytes < 0.75 * report.full_model_bytes
        assert model.model.embed_tokens.weight.shape[0] == plan.slice_of("model.embed_tokens.weight").pad_rows
    with pytest.raises(LoadError, match="random_weights.json"):
        hc.from_pretrained(str(tmp_path), device="cpu")


def test_cuda_graph_options_checked_before_any_process_starts(tmp_path, monkeypatch):
    """CUDA graphs work under tensor parallelism on CUDA (tests/test_tensor_parallel_gpu.py); an explicit
    ``cuda_graphs`` on CPU (gloo) raises as without TP, and so does a blocking NCCL wait (a capture
    cannot hold it), before any process starts or any weight is read."""
    from hybrid_compile.distributed.loading import RANDOM_WEIGHTS

    em.make_config("qwen3_next_moe").save_pretrained(tmp_path)
    (tmp_path / RANDOM_WEIGHTS).write_text("{}")
    for mode in (True, "full", "piecewise"):
        with pytest.raises(ValueError, match="needs a CUDA device"):
            hc.from_pretrained(str(tmp_path), tensor_parallel_size=2, device="cpu", cuda_graphs=mode)
    if torch.cuda.device_count() < 2:  # graphs are not refused on CUDA: the GPU count is checked next
        with pytest.raises(ValueError, match="tensor_parallel_size=2 needs 2 GPUs"):
            hc.from_pretrained(str(tmp_path), tensor_parallel_size=2, device="cuda", cuda_graphs=True)
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")
    with pytest.raises(ValueError, match="TORCH_NCCL_BLOCKING_WAIT=1"):
        hc.from_pretrained(str(tmp_path), tensor_parallel_size=2, device="cuda")


class _TableGroup:
    """A 4-rank group stand-in for one rank: the all-reduce of a norm's sum of squares returns the sum
    over the ranks of ``table`` (every rank's own sum, known to the test); of a norm's per-span columns
    (this rank's sum in its span's column, zeros elsewhere) each column's span's sum."""

    size = 4

    def __init__(self, rank: int, table: list[torch.Tensor]):
        self.rank, self.table = rank, table

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        spans = x.shape[-1]
        per = self.size // spans
        assert torch.equal(x[..., self.rank // per:self.rank // per + 1], self.table[self.rank])  # its own sum
        return torch.cat([sum(self.table[k * per:(k + 1) * per]) for k in range(spans)], dim=-1)


@pytest.mark.parametrize("grouped", [True, False])
def test_group_norm_on_two_of_four_ranks_follows_the_built_norm(grouped):
    """Bamba's 2 B/C groups over 4 ranks: each group's gated norm spans 2 ranks when the built norm
    normalises per group (transformers 5.24's ``group_size``), but every rank when it ignores the groups
    (5.17's norm, no ``group_size``: the whole width, as one GPU computes it). Each rank's output
    equals its channels of the norm over the whole width (HF's grouped norm, or the whole-width mean)."""
    from hybrid_compile.distributed.runtime import _install_layer_collectives

    config = mm.build_bamba().config
    width = config.mamba_n_heads * config.mamba_d_head  # 64 channels, 16 on each of the 4 ranks
    plan = plan_for(config, 4, 1)
    assert [(w, ranks) for _, w, _, ranks in plan.cross_rank_norms] == [(width // 2, 2)]
    torch.manual_seed(0)
    y, gate = torch.randn(3, width), torch.randn(3, width) * 3
    y[:, width // 2:] *= 4  # the groups' scales differ: a per-group mean is not the whole width's
    h = y * torch.nn.functional.silu(gate)
    bamba_norm = transformers.models.bamba.modeling_bamba.BambaRMSNormGated
    if grouped:
        want = bamba_norm(width, width // 2)(y, gate)
    else:
        want = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    local = width // 4
    table = [h[:, r * local:(r + 1) * local].pow(2).sum(-1, keepdim=True) for r in range(4)]
    for rank in range(4):
        norm = bamba_norm(local, local)
        if not grouped:
            del norm.group_size  # (5.17's class: no groups)
        _install_layer_collectives([("model.layers.0.mamba.norm", norm)], plan, _TableGroup(rank, table))
        cols = slice(rank * local, (rank + 1) * local)
        torch.testing.assert_close(norm(y[:, cols], gate[:, cols]), want[:, cols])


def test_rank0_broadcasts_none_of_its_graph_recaptures(monkeypatch):
    """Elastic pools under CUDA graphs: after ``RESIZE`` every rank captures its full graphs again by
    itself, so rank 0's capture runs (model calls, pool moves) are not sent (a follower inside its own
    capture would never receive them: on 2 x H200 rank 0 then waited in the broadcast and rank 1 in its
    capture's synchronize). The broadcast is on again afterwards, also when the capture fails."""
    from types import SimpleNamespace

    from hybrid_compile.distributed.runtime import TensorParallelEngine
    from hybrid_compile.engine import HybridEngine

    class Broadcaster:
        resized = None

        def resize(self, kv_pages, mamba_slots):
            self.resized = (kv_pages, mamba_slots)

    eng = TensorParallelEngine.__new__(TensorParallelEngine)
    eng._broadcaster = Broadcaster()
    eng.runner = SimpleNamespace(step_observer=None)
    eng.pools = SimpleNamespace(kv=SimpleNamespace(observer=None, allocator=SimpleNamespace(num_pages=7)),
                                mamba=SimpleNamespace(observer=None, total=lambda: 3))
    eng.host_pool = SimpleNamespace(observer=None)
    eng.speculative = eng.mtp_head = None
    eng._broadcast(True)
    observers = lambda: (eng.runner.step_observer, eng.pools.kv.observer, eng.pools.mamba.observer,  # noqa: E731
                         eng.host_pool.observer)
    assert observers() == (eng._broadcaster,) * 4
    seen = []

    def capture(self, fail=False):
        seen.append(observers())
        if fail:
            raise RuntimeError("capture failed")

    monkeypatch.setattr(HybridEngine, "pools_resized", capture)
    eng.pools_resized()
    assert eng._broadcaster.resized == (7, 3) and seen == [(None,) * 4]
    assert observers() == (eng._broadcaster,) * 4
    monkeypatch.setattr(HybridEngine, "pools_resized", lambda self: capture(self, fail=True))
    with pytest.raises(RuntimeError, match="capture failed"):
        eng.pools_resized()
    assert observers() == (eng._broadcaster,) * 4
