"""The end-to-end benchmark script (benchmarks/e2e.py) runs end to end on CPU with --tiny.

One run covers every worker kind (device/roofline, the logits check, a transformers system, an
engine mode and a mode the engine cannot run here), every workload, the JSON, the table and
--resume. Numbers are not asserted (speed belongs to benchmarks); token counts, the logits check
and the rows' statuses are.
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


def test_unknown_system_is_rejected():
    with pytest.raises(SystemExit):
        e2e.parse_args(["--systems", "hf_eager,vllm"])


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
    every rate."""
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
            for metric in ("ttft_s", "itl_s", "e2e_s"):
                assert r[metric]["n"] > 0 and 0 < r[metric]["p50"] <= r[metric]["p99"], (mode, metric, r)
    for r in run["results"]["http-process"].values():  # the engine process's CPU time counted apart
        assert r["host_cpu_s"]["engine_process"] > 0, r
    for r in [*run["results"]["http"].values(), *run["results"]["http-process"].values()]:
        # both client processes' CPU time counted
        assert r["client_cpu_s"] > 0, r
        # the server's view of TTFT lies inside the client's (arrival after the send, first token before its event)
        assert 0 < r["server_ttft_mean_s"] <= r["ttft_s"]["mean"], r
    assert set(run["summary"]["http_vs_inprocess"]) == set(run["summary"]["http-process_vs_inprocess"]) == {"8", "inf"}
    assert "HTTP throughput" in proc.stdout and "HTTP, engine process throughput" in proc.stdout


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


def test_speculative_benchmark_tree_rows_tiny(tmp_path):
    """benchmarks/speculative.py --trees runs on CPU with --tiny: draft-tree rows (top-k 2 and 4,
    depth 3, budgets 8 and 16) beside the chain rows at the same replay q; a budget over the full
    tree is skipped; an uncorrupted replay tree is accepted in full."""
    out = tmp_path / "spec.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "speculative.py"), "--tiny", "--device", "cpu", "--batches", "1",
           "--draft-tokens", "3", "--qs", "0,0.5", "--sources", "replay", "--trees", "2x3x8,2x3x16,4x3x16",
           "--new-tokens", "8", "--out", str(out)]
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
