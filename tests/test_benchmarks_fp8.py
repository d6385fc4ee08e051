"""benchmarks/fp8.py runs end to end on CPU with --tiny (bf16 then FP8 on the same toy model).

Speed is not asserted; the JSON's structure is, and that the FP8 run really served FP8 weights
(fewer weight bytes than the bf16 run of the same model)."""

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import transformers

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_tiny_cpu_run(tmp_path):
    out = tmp_path / "fp8.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "fp8.py"), "--tiny", "--device", "cpu", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads(out.read_text())
    assert run["env"]["tiny"] and run["env"]["quantize_seconds"] >= 0
    for mode in ("bf16", "fp8"):
        assert set(run[mode]["decode"]) == {"1", "2"} and set(run[mode]["prefill"]) == {"64"}
        # (a difference of two timings of a few toy steps: its sign is noise on a busy CPU)
        assert all(math.isfinite(v["ms_per_step"]) for v in run[mode]["decode"].values())
        prof = run[mode]["prefill_profile"]  # one engine step for the 64-token prompt, with its host ops
        assert prof["length"] == 64 and prof["steps"] == 1 and prof["wall_ms_per_step"] > 0 and prof["top_host_ops"]
        dec = run[mode]["decode_profile"]  # batch 1: a few decode steps
        assert dec["batch"] == 1 and dec["steps"] >= 1 and dec["wall_ms_per_step"] > 0
        # the wrap's phases and what it compiled (the 48-layer FP8 model's 155 s wrap had neither)
        startup = run[mode]["startup"]
        assert startup["total_s"] > 0 and startup["total_s"] <= run[mode]["wrap_seconds"] + 1e-6
        assert {"pools_s", "patch_s", "compile_s", "capture_s", "warmup_s"} <= set(startup) and startup["pools_s"] > 0
        assert isinstance(run[mode]["startup_work"], dict)
    assert run["fp8"]["weight_bytes"] < run["bf16"]["weight_bytes"]
    assert "decode batch 1: fp8 " in proc.stdout and "kernels" not in run  # the kernel table needs CUDA
    assert "fp8: wrap " in proc.stdout


def test_tiny_cpu_run_hf_experts_then_fp8(tmp_path):
    """``--modes bf16_hf_experts,fp8``: the bf16 engine on transformers' experts path, then the model
    quantized and the FP8 engine compared with it; a list out of order refused."""
    out = tmp_path / "fp8.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "fp8.py"), "--tiny", "--device", "cpu", "--modes",
           "bf16_hf_experts,fp8", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads(out.read_text())
    assert "bf16" not in run and set(run["fp8"]["decode"]) == {"1", "2"} and run["env"]["quantize_seconds"] >= 0
    assert run["bf16_hf_experts"]["engine"] == {"fused_moe": False} and run["fp8"]["engine"] == {}
    assert set(run["bf16_hf_experts"]["decode"]) == {"1", "2"} and "decode batch 1: fp8 " in proc.stdout
    bad = subprocess.run(cmd[:-2] + ["--modes", "fp8,bf16"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode != 0 and "--modes must be" in bad.stderr


@pytest.mark.parametrize("family", ["qwen3_next", "minimax"])
def test_fp8_state_accuracy_tiny_cpu_run(tmp_path, family):
    """benchmarks/fp8_state_accuracy.py --tiny: every mode teacher-forced on the reference's tokens;
    the fp8 state is further from the fp32-state engine than the bf16 state, and its pools smaller."""
    if family == "minimax" and not hasattr(transformers, "MiniMaxForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no MiniMaxForCausalLM")
    out = tmp_path / "acc.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "fp8_state_accuracy.py"), "--tiny", "--device", "cpu",
           "--tokens", "12", "--family", family, "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads(out.read_text())
    modes = run["modes"]
    assert set(modes) == {"bf16_state", "fp8_state", "fp8_kv_cache", "fp8_state_and_kv_cache"}
    assert all(m["steps"] == 12 for m in modes.values())
    assert 0 < modes["bf16_state"]["rel_max_error"]["mean"] < modes["fp8_state"]["rel_max_error"]["mean"] < 0.1
    assert modes["fp8_state"]["bytes"]["per_mamba_slot"] < modes["bf16_state"]["bytes"]["per_mamba_slot"]
    assert modes["fp8_kv_cache"]["bytes"]["per_token"] < run["reference"]["bytes"]["per_token"]
    assert modes["fp8_state"]["dtypes"]["ssm"] == ["float8_e4m3fn"]


def test_decode_sweep_tiny_under_the_interpreter(tmp_path):
    """``--sweep --tiny``: every candidate (old and new tensor-core decode, the GEMV default and grid,
    the bf16 baselines) checked against its reference inside the script (exit 1 on a wrong one),
    the current default and the best named per case."""
    from hybrid_compile.ops.triton.fp8 import use_gemv

    out = tmp_path / "sweep.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "fp8.py"), "--sweep", "--tiny", "--device", "cpu", "--iters", "1",
           "--gemv-grid", '{"block_n": [16], "block_k": [128], "warps": [4], "stages": [1]}', "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads(out.read_text())
    assert run["wrong"] == [] and run["env"]["tiny"] is True
    # --gemv-grid's tiles, and at one row (the GEMV quantizing its own activation) each tile's twin that
    # runs after the quantize kernel, both checked against the reference
    one_row = run["dense"][0]["times"]
    assert "ms" in one_row["gemv[16, 128, 4, 1]"] and "ms" in one_row["gemv_sepq[16, 128, 4, 1]"], sorted(one_row)
    assert not any("[8, 128" in label for label in one_row)  # the default grid's tile: --gemv-grid replaced it
    assert [(c["shape"], c["rows"]) for c in run["dense"]] == [("tiny", 1), ("tiny", 5)]
    assert [c["tokens"] for c in run["experts"]] == [1, 5]
    for case in run["dense"] + run["experts"]:
        t = case["times"]
        assert {"tc_old", "tc", "gemv", "gemv[16, 128, 4, 1]"} <= set(t), sorted(t)
        bf16 = "bf16_mm" if case["kind"] == "dense" else "bf16_grouped"
        assert all("ms" in t[k] for k in ("tc_old", "tc", "gemv", bf16))
        experts = 4 if case["kind"] == "experts" else None  # the tiny experts: 4
        assert case["current"] == ("gemv" if use_gemv(case["rows"], experts) else "tc")
        assert case["best_fp8"] in t and case["best_over_current"] >= 1.0
    assert "best" in proc.stdout and "current" in proc.stdout


def test_sweep_at_a_tensor_parallel_rank_s_shapes(tmp_path):
    """``--sweep --tp 2``: a rank's shards (column-parallel projections and the experts' gate_up halve
    their output rows, row-parallel ones and the experts' down_proj their input columns);
    ``--sweep-only`` / ``--sweep-rows`` narrow the run, which still checks the row-pair GEMV."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import fp8 as bench

    lin, exp = bench.tp_slices(bench.SWEEP_LINEAR_SHAPES, bench.EXPERT_SHAPES, 2)
    assert dict((name, (n, k)) for name, n, k in lin) == {
        "gdn in_proj_qkvz": (6144, 2048), "gdn out_proj": (2048, 2048), "attn q_proj": (4096, 2048),
        "attn o_proj": (2048, 2048), "shared expert gate_up": (512, 2048), "shared expert down": (2048, 256),
        "attn k/v_proj": (256, 2048)}
    assert exp == [("experts gate_up", 512, 512, 2048), ("experts down", 512, 2048, 256)]
    out = tmp_path / "sweep.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "fp8.py"), "--sweep", "--tiny", "--device", "cpu", "--iters", "1",
           "--tp", "2", "--sweep-only", "experts", "--sweep-rows", "3", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads(out.read_text())
    assert run["wrong"] == [] and run["dense"] == [] and run["env"]["tp"] == 2
    [case] = run["experts"]
    assert (case["n"], case["k"], case["tokens"]) == (8, 160, 3)  # the tiny experts' gate_up (16 rows) halved
    assert "ms" in case["times"]["gemv_2rows"]
    # the gate_up call as the experts forward makes it (rows gathered, silu_and_mul fused), checked and timed
    assert "ms" in case["routed"]["fp8"] and "ms" in case["routed"]["bf16"]
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fp8.py"), "--tp", "2"], capture_output=True,
                         text=True, cwd=ROOT)
    assert bad.returncode != 0 and "options of --sweep" in bad.stderr
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fp8.py"), "--sweep", "--gemv-grid",
                          '{"block_n": [8]}'], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode != 0 and "--gemv-grid wants" in bad.stderr


def test_prefill_sweep_tiny_under_the_interpreter(tmp_path):
    """``--sweep --prefill --tiny``: the tensor-core GEMM's default and its tile grid (GROUP_M 1 and 2)
    checked against the reference inside the script, no GEMV; compute rates recorded."""
    out = tmp_path / "sweep.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "fp8.py"), "--sweep", "--prefill", "--tiny", "--device", "cpu",
           "--iters", "1", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads(out.read_text())
    assert run["wrong"] == [] and run["env"]["prefill"] is True
    assert [c["rows"] for c in run["dense"]] == [20] and [c["tokens"] for c in run["experts"]] == [20]
    for case in run["dense"] + run["experts"]:
        t = case["times"]
        assert {"tc", "tc[16, 16, 4, 1, 1]", "tc[16, 16, 4, 1, 2]"} <= set(t), sorted(t)
        assert not any(k.startswith("gemv") or k == "tc_old" for k in t)
        assert case["current"] == "tc" and all(v["tflops"] > 0 for v in t.values() if "ms" in v)


def test_build_quantized_never_holds_the_bf16_model(tmp_path):
    """``build_quantized``: every decoder layer's projections and experts in FP8 with finite weights and
    block scales, embeddings / norms / LM head in bf16 as the model's own init draws them (their std
    and the rotary frequencies as a model built the usual way), and the FP8 engine serves it."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import fp8 as fp8_bench
    from reference_models import _build

    from hybrid_compile.quantization import has_fp8_layers
    from hybrid_compile.quantization.fp8_modules import Fp8Experts, Fp8Linear

    config = fp8_bench.qwen3_next_80b_config(4, tiny=True)
    model = fp8_bench.build_quantized(config, torch.device("cpu"), seed=0)
    usual = _build(transformers.Qwen3NextForCausalLM, config, torch.bfloat16, torch.device("cpu"), seed=0)
    assert has_fp8_layers(model)
    for layer in model.model.layers:
        kinds = {type(m) for m in layer.modules()}
        assert Fp8Linear in kinds and Fp8Experts in kinds
        assert not any(isinstance(m, torch.nn.Linear) and m.weight.numel() >= 128 * 128 for m in layer.modules())
    assert all(torch.isfinite(p.float()).all() for p in model.parameters())
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        got, want = model.get_parameter(name), usual.get_parameter(name)
        assert got.dtype == torch.bfloat16 and abs(got.float().std() - want.float().std()) < 0.2 * want.float().std()
    assert torch.equal(model.model.rotary_emb.inv_freq, usual.model.rotary_emb.inv_freq)

    cmd = [sys.executable, str(ROOT / "benchmarks" / "fp8.py"), "--tiny", "--device", "cpu", "--build-quantized"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "--build-quantized" in proc.stderr  # refused beside a bf16 engine
    out = tmp_path / "fp8.json"
    proc = subprocess.run(cmd + ["--modes", "fp8", "--out", str(out)], capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads(out.read_text())
    assert run["env"]["build_quantized"] and "bf16" not in run and set(run["fp8"]["decode"]) == {"1", "2"}
