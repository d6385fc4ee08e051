"""The end-to-end benchmark script (benchmarks/e2e.py) runs end to end on CPU with --tiny.

One run covers every worker kind (device/roofline, the logits check, a transformers system, an
engine mode and a mode the engine cannot run here), every workload, the JSON, the table and
--resume. Numbers are not asserted (speed belongs to benchmarks); token counts, the logits check
and the rows' statuses are. The MoE reference models (``jamba``, ``kimi_linear``) get a run each
(check with greedy tokens, decode, prefill, and the rows that cannot run here), and their
full-size shapes are checked on the meta device.
"""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import e2e  # noqa: E402


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e") / "run.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "e2e.py"), "--tiny", "--device", "cpu", "--threads", "1",
           "--models", "qwen3_next", "--systems", "hf_eager,ours_eager,ours_cuda_graphs", "--no-plots",
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return cmd, out, proc.stdout


def test_tiny_run_measures_every_workload_of_each_system(tiny_run):
    _, out, stdout = tiny_run
    run = json.loads(out.read_text())
    s = e2e.settings_for(tiny=True, quick=False)
    assert run["env"]["status"] == "ok" and run["env"]["copy_bandwidth_GBps"] > 0
    roof = run["env"]["rooflines"]["qwen3_next"]
    assert roof["weight_bytes"] == 2 * roof["params"]  # bf16
    assert roof["roofline_ms_per_step"] > 0

    check = run["checks"]["qwen3_next"]
    assert check["passed"], check
    assert check["fp32"]["rel_diff"] <= e2e.FP32_RTOL and check["fp32"]["top1_equal"]

    results = run["results"]["qwen3_next"]
    hf, ours = results["hf_eager"], results["ours_eager"]
    # transformers' pure-torch path: no flash-linear-attention kernel anywhere
    assert hf["status"] == "ok" and not hf["kernel_packages"]["fla"]["available"]
    assert not any(str(v).startswith("fla.") for v in hf["hf_kernels"].values())
    assert ours["status"] == "ok" and ours["engine_config"]["compile"] is False
    prompts, out_lens = e2e.request_list(s, vocab=512)
    waves = e2e.shared_prefix_waves(s, vocab=512)
    for r in (hf, ours):
        w = r["workloads"]
        assert set(w) == {"decode", "prefill", "cb", "shared_prefix"}, w
        for b in s.decode_batches:
            d = w["decode"]["batches"][str(b)]
            assert d["decode_tokens"] == b * (s.decode_new - 1) and d["decode_tokens_per_s"] > 0
        assert [int(L) for L in w["prefill"]["lengths"]] == s.prefill_lens
        assert w["cb"]["requests"] == len(prompts) and w["cb"]["output_tokens"] == sum(out_lens)
        assert len(w["cb"]["ttft_s"]) == len(prompts) and w["cb"]["ttft_p99_s"] >= w["cb"]["ttft_p50_s"] > 0
        assert w["shared_prefix"]["requests"] == s.sp_groups * s.sp_per_group == sum(len(x) for x in waves)
    # waves share each group's system prompt
    assert all(wave[g][0][: s.sp_system] == waves[0][g][0][: s.sp_system] for wave in waves for g in range(s.sp_groups))
    # CUDA graphs cannot run on CPU: an "unsupported" row with the engine's message, not a crash
    graphs = results["ours_cuda_graphs"]
    assert graphs["status"] == "unsupported" and "CUDA" in graphs["message"]
    assert "unsupported" in stdout and "ours_eager" in stdout and "logits check: PASS" in stdout


def test_resume_keeps_finished_jobs(tiny_run):
    cmd, out, _ = tiny_run
    before = json.loads(out.read_text())
    proc = subprocess.run(cmd + ["--resume", "--workloads", "decode"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    after = json.loads(out.read_text())
    assert after["results"] == before["results"] and after["checks"] == before["checks"]
    assert after["env"] == before["env"]


def test_resume_runs_only_the_workloads_a_system_lacks(tiny_run, tmp_path):
    cmd, out, _ = tiny_run
    before = json.loads(out.read_text())
    partial = json.loads(out.read_text())
    del partial["results"]["qwen3_next"]["ours_eager"]["workloads"]["shared_prefix"]
    resumed = tmp_path / "resumed.json"
    resumed.write_text(json.dumps(partial))
    cmd = [c if c != str(out) else str(resumed) for c in cmd]
    proc = subprocess.run(cmd + ["--resume", "--workloads", "decode,shared_prefix"], capture_output=True, text=True,
                          timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    after = json.loads(resumed.read_text())["results"]["qwen3_next"]
    assert after["hf_eager"] == before["results"]["qwen3_next"]["hf_eager"]  # nothing missing: not rerun
    ours, ours_before = after["ours_eager"], before["results"]["qwen3_next"]["ours_eager"]
    assert ours["status"] == "ok" and set(ours["workloads"]) == set(ours_before["workloads"])
    for w in ("decode", "prefill", "cb"):  # kept as measured before
        assert ours["workloads"][w] == ours_before["workloads"][w]
    s = e2e.settings_for(tiny=True, quick=False)
    assert ours["workloads"]["shared_prefix"]["requests"] == s.sp_groups * s.sp_per_group  # measured now


def test_missing_workloads_and_merge_rules():
    earlier = dict(status="partial", job_wall_s=2.0,
                   workloads=dict(decode=dict(batches={}), cb=dict(status="error", error="x")))
    assert e2e.missing_workloads(earlier, "ours_eager", ["check", "decode", "cb", "prefill"]) == ["cb", "prefill"]
    # a mode measures only its own workloads
    assert e2e.missing_workloads({}, "ours_prefix_cache", list(e2e.WORKLOADS)) == ["cb", "shared_prefix"]
    new = dict(status="ok", job_wall_s=3.0, peak_memory_gib=1.0, workloads=dict(cb=dict(output_tokens=5)))
    merged = e2e.merge_result(earlier, new)
    assert merged["status"] == "ok" and merged["workloads"] == dict(decode=dict(batches={}), cb=dict(output_tokens=5))
    assert merged["job_wall_s"] == 5.0 and merged["peak_memory_gib"] == 1.0
    failed = e2e.merge_result(earlier, dict(status="timeout", job_wall_s=1.0, workloads={}))
    assert failed["status"] == "timeout" and failed["workloads"] == earlier["workloads"]
    still = e2e.merge_result(earlier, dict(status="ok", workloads=dict(prefill=dict(lengths={}))))
    assert still["status"] == "partial"  # cb's error remains
    assert e2e.merge_result(None, new) is new


@pytest.fixture(scope="module", params=["jamba", "kimi_linear"])
def moe_model_run(request, tmp_path_factory):
    """A tiny run of one MoE reference model: transformers eager, hf_fla (not available: no
    --fla-path, or no kernels for the family), our eager engine, our fused MoE experts and CUDA
    graphs (unsupported on CPU)."""
    out = tmp_path_factory.mktemp("e2e_moe") / f"{request.param}.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "e2e.py"), "--tiny", "--device", "cpu", "--threads", "1",
           "--models", request.param, "--systems", "hf_eager,hf_fla,ours_eager,ours_fused_moe,ours_cuda_graphs",
           "--workloads", "check,decode,prefill", "--ours-base", "ours_eager", "--no-plots", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return request.param, json.loads(out.read_text()), proc.stdout


def test_moe_reference_models_run_every_row(moe_model_run):
    model, run, stdout = moe_model_run
    s = e2e.settings_for(tiny=True, quick=False)
    import reference_models

    tiny = reference_models.REFERENCE_BUILDERS[model](device="meta", tiny=True)
    roof = run["env"]["rooflines"][model]
    assert roof["params"] == sum(p.numel() for p in tiny.parameters())
    assert roof["active_params"] == reference_models.active_params(tiny) < roof["params"]
    # bytes read at batch 1 (bf16 weights, a few kept in fp32 by transformers): every weight, the
    # routed experts' at top_k / num_experts, less the untied input embedding (a lookup reads one row)
    cfg = tiny.config
    share = cfg.num_experts_per_tok / (cfg.num_experts if model == "jamba" else cfg.num_local_experts)
    read = sum(p.numel() * p.element_size() * (share if ".experts." in n and "shared" not in n else 1)
               for n, p in tiny.named_parameters())
    emb = tiny.get_input_embeddings().weight
    assert roof["weight_bytes"] == round(read) - emb.numel() * emb.element_size()

    check = run["checks"][model]
    assert check["passed"], check
    greedy = check["greedy_fp32"]
    assert greedy["equal"] and len(greedy["hf"]) == e2e.CHECK_NEW_TOKENS, greedy  # ours = HF generate

    results = run["results"][model]
    for system in ("hf_eager", "ours_eager"):
        r = results[system]
        assert r["status"] == "ok", r
        dec = r["workloads"]["decode"]["batches"]
        for b in s.decode_batches:
            assert dec[str(b)]["decode_tokens"] == b * (s.decode_new - 1) and dec[str(b)]["decode_tokens_per_s"] > 0
        assert [int(L) for L in r["workloads"]["prefill"]["lengths"]] == s.prefill_lens
        assert all(v["ttft_s"] > 0 for v in r["workloads"]["prefill"]["lengths"].values())
    fused = results["ours_fused_moe"]  # on the base mode (--ours-base: eager ops) with our experts op
    assert fused["status"] == "ok" and fused["engine_config"]["fused_moe"] is True, fused
    assert fused["engine_config"]["compile"] is False
    assert fused["engine_stats"]["fused_moe_modules"] == (4 if model == "jamba" else 7)
    dec = fused["workloads"]["decode"]["batches"]
    assert all(dec[str(b)]["decode_tokens"] == b * (s.decode_new - 1) for b in s.decode_batches)
    fla = results["hf_fla"]
    assert fla["status"] == "unavailable"
    if model == "jamba":  # no fla kernels for Mamba1: said before any --fla-path is asked for
        assert "no kernels for jamba's mixers" in fla["message"] and "mamba-ssm" in fla["message"]
    else:  # transformers runs Kimi Delta Attention on fla's chunk_kda when it imports
        assert "--fla-path" in fla["message"]
    graphs = results["ours_cuda_graphs"]
    assert graphs["status"] == "unsupported" and "CUDA" in graphs["message"]
    assert f"{model} logits check: PASS" in stdout and "fp32 greedy tokens equal" in stdout
    assert "M active" in stdout


def test_reference_models_full_size_shapes_and_names():
    """Every reference model's name is its model type (hf_fla decides from the name before loading),
    and the MoE models have the released per-layer shapes at the stated parameter counts (the
    builders check total and active counts themselves; built on the meta device: no weights)."""
    import reference_models

    assert e2e.ALL_MODELS == tuple(reference_models.REFERENCE_BUILDERS)
    for name, build in reference_models.REFERENCE_BUILDERS.items():
        assert build(device="meta", tiny=True).config.model_type == name
    jamba = reference_models.build_jamba_reference(device="meta").config
    j = jamba
    assert (j.hidden_size, j.intermediate_size, j.num_experts, j.num_experts_per_tok) == (4096, 14336, 16, 2)
    assert (j.num_attention_heads, j.num_key_value_heads, j.mamba_d_state, j.mamba_dt_rank) == (32, 8, 16, 256)
    assert jamba.layers_block_type == ["mamba"] * 4 + ["attention"] + ["mamba"] * 3
    assert jamba.layers_num_experts == [1, 16] * 4 and jamba.vocab_size == 65536
    kimi = reference_models.build_kimi_linear_reference(device="meta")
    c = kimi.config
    assert (c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok) == (2304, 1024, 256, 8)
    mla = (c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim, c.q_lora_rank)
    assert mla == (512, 64, 128, 128, None)
    assert (c.linear_num_heads, c.linear_head_dim, c.vocab_size) == (32, 128, 163840)
    assert c.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 2
    assert c.mlp_layer_types == ["dense"] + ["sparse"] * 7
    # active parameters against an independent count: the routed experts' weights at top_k / E
    experts = sum(p.numel() for n, p in kimi.named_parameters() if ".mlp.experts." in n)
    total = sum(p.numel() for p in kimi.parameters())
    assert reference_models.active_params(kimi) == round(total - experts + experts * 8 / 256)


def test_unknown_system_is_rejected():
    with pytest.raises(SystemExit):
        e2e.parse_args(["--systems", "hf_eager,vllm"])


def test_host_overhead_op_dispatch_smoke(tmp_path):
    """benchmarks/host_overhead.py --op-dispatch: both registrations timed for every mutated-argument
    count, JSON written (no speed asserted)."""
    out = tmp_path / "dispatch.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "host_overhead.py"), "--device", "cpu", "--op-dispatch",
           "--calls", "20", "--repeats", "1", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["op_dispatch"]
    assert sorted(rows, key=int) == ["0", "1", "4", "13"]
    assert all(r["kernel_op"] > 0 and r["custom_op"] > 0 and r["ratio"] > 0 for r in rows.values())


def test_host_overhead_op_checks_smoke(tmp_path):
    """benchmarks/host_overhead.py --op-checks: every extend op's argument checks timed at the 80B
    shapes (the checks pass: a wrong shape would raise), JSON written (no speed asserted)."""
    out = tmp_path / "checks.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "host_overhead.py"), "--op-checks", "--calls", "20",
           "--repeats", "1", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["op_checks"]
    assert sorted(rows) == ["causal_conv1d_fn", "chunk_gated_delta_rule", "gdn_gating", "paged_attention_extend"]
    assert all(v > 0 for v in rows.values())


def test_sampling_penalties_benchmark_smoke(tmp_path):
    """benchmarks/sampling_penalties.py --tiny --device cpu: every mode measured, JSON written."""
    out = tmp_path / "penalties.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "sampling_penalties.py"), "--tiny", "--device", "cpu",
           "--threads", "1", "--batch", "2", "--prompt-len", "8", "--new-tokens", "6", "--repeats", "1",
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["modes"]) == {"plain", "penalties", "penalties_sampled"}
    for mode in result["modes"].values():
        assert mode["free_running_steps"] >= 2 and mode["synced_steps"] >= 1 and mode["median_step_ms"] > 0
        assert mode["free_running_ms_per_step_vs_plain"] > 0
    assert result["modes"]["penalties"]["overlapped_steps"] > 0  # penalties do not stop steps launched ahead


def test_serving_benchmark_tiny_runs_both_modes_at_the_same_load(tmp_path):
    """benchmarks/serving.py --tiny --engine-process: the in-process AsyncEngine and the HTTP server
    (a live ``hybrid-compile serve`` on 127.0.0.1, streamed to from 2 client processes whose records
    are merged), with its engine on a thread and in its own process, each serve every request of
    every rate, and report the ingest latency (send -> engine admission) and, for HTTP, its parts."""
    out = tmp_path / "serving.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "serving.py"), "--tiny", "--threads", "1", "--rates", "8,inf",
           "--num-requests", "4", "--output-len", "4", "--cache-dir", str(tmp_path / "models"), "--no-plots",
           "--client-processes", "2", "--engine-process", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads(out.read_text())
    assert set(run["results"]) == {"inprocess", "http", "http-process"}
    for mode, per_rate in run["results"].items():
        assert set(per_rate) == {"8", "inf"}, mode
        for r in per_rate.values():
            assert r["failed"] == 0 and r["requests"] == 4 and r["output_tokens"] == 4 * 4, (mode, r)
            # ingest: the client's send to the engine's admission (for HTTP from the server's timing log)
            for metric in ("ttft_s", "itl_s", "e2e_s", "ingest_s"):
                assert r[metric]["n"] > 0 and 0 < r[metric]["p50"] <= r[metric]["p99"], (mode, metric, r)
            assert r["ingest_s"]["p99"] < r["ttft_s"]["p99"], (mode, r)
    for r in run["results"]["http-process"].values():  # the engine process's CPU time counted apart
        assert r["host_cpu_s"]["engine_process"] > 0, r
    for r in [*run["results"]["http"].values(), *run["results"]["http-process"].values()]:
        # both client processes' CPU time counted
        assert r["client_cpu_s"] > 0, r
        # the server's view of TTFT lies inside the client's (arrival after the send, first token before its event)
        assert 0 < r["server_ttft_mean_s"] <= r["ttft_s"]["mean"], r
        # the way in and out, one value per request: send -> handler -> queued -> admitted; first token -> client
        assert set(r["ingest_breakdown_s"]) == {"send_to_handler", "handler_to_queued", "queued_to_admitted",
                                                "first_token_to_client"}, r
        for part in r["ingest_breakdown_s"].values():
            assert part["n"] == 4 and part["p50"] >= 0, r
        assert r["client_busy_fraction"] > 0, r  # (with the client's set-up: over 1 in a run this short)
    assert set(run["summary"]["http_vs_inprocess"]) == set(run["summary"]["http-process_vs_inprocess"]) == {"8", "inf"}
    assert "HTTP throughput" in proc.stdout and "HTTP, engine process throughput" in proc.stdout
    for http in ("http", "http-process"):  # the verdict at the server's own highest rate under the SLO
        best, at = run["summary"]["best_rate_under_slo"][http], run["summary"][f"{http}_at_its_slo_rate"]
        assert (at is None) == (best is None), run["summary"]
        if at:
            assert at["rate"] == best["rate"] and at["throughput_ratio"] == pytest.approx(
                best["output_throughput"] / run["results"]["inprocess"][best["rate"]]["output_throughput"])
            assert at["within_5_percent"] == (at["throughput_ratio"] >= 0.95)
    assert "way in, ms p50 / p99: send -> handler" in proc.stdout
    from importlib.util import find_spec  # which event loop the server had: recorded, not assumed
    assert (run["versions"]["uvloop"] is not None) == (find_spec("uvloop") is not None) and run["versions"]["uvicorn"]
    assert "server stack: uvicorn" in proc.stdout


def test_radix_eviction_benchmark_smoke(tmp_path):
    """benchmarks/radix_eviction.py on small trees: every policy and size measured, JSON written,
    the trees evicted as asked (check_invariants runs inside after the evictions)."""
    out = tmp_path / "radix_eviction.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "radix_eviction.py"), "--sizes", "100,400",
           "--evictions", "20", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["results"]) == {"lru", "marconi"}
    for rows in result["results"].values():
        assert set(rows) == {"100", "400"}
        for n, r in rows.items():
            assert r["nodes"] >= int(n) and r["evictions"] == min(20, int(n) // 10)
            assert r["kv_per_call_us"]["calls"] == r["evictions"] and r["kv_per_call_us"]["median"] > 0
            assert r["mamba_bulk_nodes"] == r["evictions"] and r["kv_bulk_nodes"] > 0
            assert r["nodes_after"] < r["nodes"]


def test_radix_commit_benchmark_smoke(tmp_path):
    """benchmarks/radix_commit.py on small pools: every (pool size, threads) row measured, each commit
    checked inside (the fresh sequence cached whole, the tree's invariants after), JSON written."""
    out = tmp_path / "radix_commit.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "radix_commit.py"), "--tokens", "64", "--slots", "200,1000",
           "--threads", "1,2", "--repeats", "3", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert [(r["kv_slots"] - 1, r["threads"]) for r in rows] == [(200, 1), (200, 2), (1000, 1), (1000, 2)]
    assert all(r["tokens"] == 64 and r["repeats"] == 3 and r["median_us"] > 0 for r in rows)


def test_radix_key_of_any_int_sequence():
    """The tree's key of a token sequence: plain ints as they are, numpy / bool ints and tensors as
    ints (one key for the same ids however they are given)."""
    import numpy as np
    import torch

    from hybrid_compile.cache import HybridRadixCache

    as_key = HybridRadixCache._as_key
    want = (3, 1, 0, 7)
    for ids in ([3, 1, 0, 7], (3, 1, 0, 7), np.array([3, 1, 0, 7]), torch.tensor([3, 1, 0, 7]),
                [np.int64(3), 1, False, 7]):
        key = as_key(None, ids)
        assert key == want and all(type(t) is int for t in key), (ids, key)


def test_speculative_benchmark_tree_rows_tiny(tmp_path):
    """benchmarks/speculative.py --trees runs on CPU with --tiny: draft-tree rows (top-k 2 and 4,
    depth 3, budgets 8 and 16) beside the chain rows at the same replay q; a budget over the full
    tree is skipped; an uncorrupted replay tree is accepted in full. ``--profile-steps``: each row's
    first batch profiled after its timed runs (decode steps of the baseline, verify steps of a source)."""
    out = tmp_path / "spec.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "speculative.py"), "--tiny", "--device", "cpu", "--batches", "1",
           "--draft-tokens", "3", "--qs", "0,0.5", "--sources", "replay", "--trees", "2x3x8,2x3x16,4x3x16",
           "--new-tokens", "8", "--profile-steps", "2", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "tree 2x3x16: skipped" in proc.stdout
    run = json.loads(out.read_text())["modes"]["eager"]
    rows = {(r["topk"], r["tree_nodes"], r["source"]): r for r in run["trees"]}
    assert set(rows) == {(k, n, f"tree_replay_q{q}") for k, n in ((2, 8), (4, 16)) for q in (0.0, 0.5)}
    for (k, n, source), r in rows.items():
        assert r["depth"] == 3 and r["replay_match_tokens"] == 8 and r["drafted"] == n * r["verified_requests"]
        if source == "tree_replay_q0.0":  # 7 tokens after the prefill's first: verify steps of 4, then the cut
            assert r["mean_acceptance_length"] == 3.5
    assert {r["source"] for r in run["speculative"]} == {"replay_q0.0", "replay_q0.5"}
    profiled = [run["baseline"]["1"]] + run["speculative"] + run["trees"]
    for r in profiled:
        prof = r["step_profile"]
        assert prof["steps"] >= 2 and prof["wall_ms_per_step"] > 0 and prof["top_host_ops"], prof
    # a tree's verify forward runs the recurrent update over its nodes (the custom op among the host ops)
    ops = {o["name"] for o in rows[(2, 8, "tree_replay_q0.0")]["step_profile"]["top_host_ops"]}
    assert any(name.startswith("hybrid_compile::") for name in ops), ops


def test_mixed_steps_benchmark_smoke(tmp_path):
    """benchmarks/mixed_steps.py --tiny --device cpu: prefill, decode and mixed step timed per case (the
    mixed step holds the decode rows, run as its DECODE part), the continuous-batching workload's
    counters and the timed forwards' split, JSON written (no speed asserted)."""
    out = tmp_path / "mixed.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "mixed_steps.py"), "--tiny", "--device", "cpu", "--prompts", "40",
           "--decodes", "2", "--repeats", "1", "--cb", "1", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    case = result["mixed"]["D2_P40"]
    assert case["mixed"]["mode"] == "extend" and case["mixed"]["tokens"] == 42 and case["mixed"]["decode_rows"] == 2
    assert case["decode"]["mode"] == "decode" and case["decode"]["requests"] == 2
    assert case["prefill"]["tokens"] == 40 and case["ratio"] > 0
    unsplit = result["mixed_unsplit"]["D2_P40"]["mixed"]
    assert unsplit["tokens"] == 42 and unsplit["decode_rows"] == 0  # the same step, decode rows in the extend paths
    run, split = result["continuous_batching"]
    assert run["requests"] == 10 and run["out_tok_s"] > 0 and run["mixed_steps"] > 0
    assert run["mixed_decode_rows"] >= run["mixed_steps"] and run["steps"] == run["extend_steps"] + run["decode_steps"]
    assert split["timed_forwards"]["extend"]["steps"] > 0 and split["timed_forwards"]["decode"]["steps"] > 0
