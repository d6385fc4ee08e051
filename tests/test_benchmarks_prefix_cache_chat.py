"""benchmarks/prefix_cache.py --chat runs end to end on CPU with --tiny (the chat phase alone).

Speed is not asserted (a few toy steps on a busy CPU); the behaviour is: the prefix set is about
``--chat-cache-ratio`` times the device KV pool, the host tier serves hits that the device alone
lost (so its token hit rate is higher than lru's), its load backs are timed, and in fp32 on the CPU
every system answers the same greedy tokens."""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmarks/ as a package (the gpu test imports it)


def test_chat_phase_tiny_cpu_run(tmp_path):
    out = tmp_path / "chat.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "prefix_cache.py"), "--tiny", "--chat", "--no-shared-prefix",
           "--no-pressure", "--systems", "no_cache", "lru", "lru_host", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads(out.read_text())
    assert "shared_prefix" in run and not run["shared_prefix"] and not run["pressure"]
    chat = run["chat"]
    w = chat["workload"]
    assert abs(w["cache_ratio"] - 4.0) < 0.05 and w["requests"] == w["conversations"] * w["turns"]
    assert run["capacity"] == {"max_total_tokens": w["kv_tokens"], "mamba_cache_size": w["mamba_slots"]}
    assert chat["outputs_equal"] is True  # fp32 on the CPU: the cache changes no greedy token
    systems = chat["systems"]
    assert set(systems) == {"no_cache", "lru", "lru_host"}
    for r in systems.values():
        assert r["requests"] == w["requests"] and r["ttft_requests"] == w["requests"] - w["conversations"]
        assert r["p50_ttft_s"] <= r["p99_ttft_s"] and r["mean_ttft_s"] > 0 and r["output_tokens_per_s"] > 0
    lru, host = systems["lru"]["cache"], systems["lru_host"]["cache"]
    assert "cache" not in systems["no_cache"]
    assert lru["host_hit_tokens"] == 0 and lru["kv_evicted_tokens"] > 0  # the device alone loses the prefixes
    assert host["host_hits"] > 0 and host["host_hit_tokens"] > 0 and host["host_evicted_tokens"] == 0
    assert host["token_hit_rate"] > lru["token_hit_rate"] + 0.3, (host, lru)
    lb = systems["lru_host"]["load_back"]
    assert lb["loads"] > 0 and lb["bytes"] > 0 and lb["seconds"] > 0 and lb["gb_s"] > 0
    assert lb["host_to_device_copy_gb_s"] == run["load_back"]["lru_host"]["host_to_device_copy_gb_s"]
    assert "load_back" not in systems["lru"]
    assert chat["ttft_ratio_lru_over_lru_host"] == systems["lru"]["mean_ttft_s"] / systems["lru_host"]["mean_ttft_s"]
    assert "multi-turn chat" in proc.stdout and "WARNING" not in proc.stdout


@pytest.mark.gpu
def test_chat_phase_on_cuda_times_the_load_backs():
    """On CUDA (pinned host tier, writes on the side stream, loads timed by CUDA events): the chat
    phase's host tier hits, every load back is timed on the device, and the greedy answers equal
    those of lru without the tier (fp32 toy model, eager engines)."""
    import torch

    import hybrid_compile as hc
    from benchmarks import prefix_cache as bench
    from benchmarks.reference_models import build_qwen3_next_reference

    model = build_qwen3_next_reference(torch.float32, "cuda", seed=0, tiny=True)
    vocab = model.config.vocab_size
    args = bench.parse_args(["--tiny", "--chat", "--no-shared-prefix", "--no-pressure", "--eager"])
    chat = bench.chat_workload(args, vocab)
    results, outputs = {}, {}
    for system in ("lru", "lru_host"):
        engine = hc.wrap(model, **bench.engine_config(system, args, bench.engine_capacity(args, vocab)))
        try:
            results[system], outputs[system] = bench.chat_phase(engine, chat, args.output_len)
        finally:
            engine.close()
    host = results["lru_host"]
    assert host["cache"]["host_hit_tokens"] > 0 and host["cache"]["token_hit_rate"] > results["lru"]["cache"][
        "token_hit_rate"]
    lb = host["load_back"]
    assert lb["loads"] > 0 and lb["bytes"] > 0 and lb["seconds"] > 0 and lb["gb_s"] > 0, lb
    assert outputs["lru"] == outputs["lru_host"]
