"""Real checkpoints and the command line: ``from_pretrained``, text in / text out, streaming,
accelerate device maps, and the ``generate`` / ``chat`` / ``bench`` subcommands.

Tiny random-weight checkpoints (a Qwen3-Next and a Mamba2, plus a Llama as the non-hybrid case)
are saved with ``save_pretrained`` (safetensors) together with a BPE tokenizer trained here
(:mod:`checkpoints`). The oracle is transformers' own greedy ``generate`` on the same checkpoint,
decoded with the same tokenizer. ``generate`` and ``chat`` run as real subprocesses
(``python -m hybrid_compile``), all started together with the module's first test; they run
while the in-process tests do, and the tests that check them come last.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import subprocess
import sys
import threading

import pytest
import torch

import hybrid_compile as hc
from checkout_env import checkout_env
from checkpoints import hf_chat, hf_text, load_hf, save_checkpoint
from engine_models import single_threaded
from hybrid_compile.cli import build_parser, main
from hybrid_compile.loading import CheckpointNotFoundError, TokenizerNotFoundError, UnsupportedModelError

ROOT = pathlib.Path(__file__).resolve().parents[1]
NEW = 12  # new tokens per prompt
SMALL = dict(max_running_requests=4, max_total_tokens=1024, mamba_cache_size=4, chunked_prefill_size=64)
SMALL_CLI = ["--device", "cpu", "--max-total-tokens", "1024", "--chunked-prefill-size", "64", "--no-progress"]
PROMPT = "Hello world! How are"
CHAT_LINES = ["hi there", "what is a state space layer?"]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    yield from single_threaded()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    return {
        "qwen": str(save_checkpoint(root / "qwen3_next", "qwen3_next", seed=0)),
        "mamba": str(save_checkpoint(root / "mamba2", "mamba2", seed=1)),
        "llama": str(save_checkpoint(root / "llama", "llama", seed=2)),
        "no_tok": str(save_checkpoint(root / "no_tokenizer", "qwen3_next", seed=0, tokenizer=False)),
    }


def _env() -> dict:
    return checkout_env(PYTHONIOENCODING="utf-8", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


class Run:
    """One ``python -m hybrid_compile ...`` subprocess, started at once, awaited on demand."""

    def __init__(self, args: list[str], stdin: str | None = None, launcher: tuple[str, ...] = ()) -> None:
        self.args = args
        self._stdin = stdin.encode() if stdin is not None else None
        self._proc = subprocess.Popen(
            [sys.executable, *launcher, "-m", "hybrid_compile", *args], env=_env(), cwd=ROOT,
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        self._result = None

    def result(self) -> tuple[int, str, str]:
        if self._result is None:
            out, err = self._proc.communicate(self._stdin, timeout=300)
            # bytes -> text without newline translation: generated text may hold any character
            self._result = (self._proc.returncode, out.decode("utf-8"), err.decode("utf-8", "replace"))
        return self._result


def _draft_self(ckpt) -> list[str]:
    """``--speculative-config`` with the Qwen3-Next checkpoint as its own draft model."""
    return ["--speculative-config", json.dumps({"method": "draft_model", "draft_model": ckpt["qwen"],
                                                "num_draft_tokens": 2})]


@pytest.fixture(scope="module", autouse=True)
def cli_runs(ckpt):
    """The subprocesses start with the module's first test and run beside the in-process ones;
    the tests that read their output come last in this file."""
    runs = {
        "generate": Run(["generate", "--model", ckpt["qwen"], "--prompt", PROMPT, "--max-new-tokens", str(NEW),
                         *SMALL_CLI]),
        "generate_stream": Run(["generate", "--model", ckpt["mamba"], "--prompt", PROMPT, "--max-new-tokens",
                                str(NEW), "--stream", "--threads", "1", *SMALL_CLI]),
        "chat": Run(["chat", "--model", ckpt["qwen"], "--max-new-tokens", str(NEW), *SMALL_CLI],
                    stdin="\n".join([CHAT_LINES[0], "", CHAT_LINES[1], "/exit", "never sent"]) + "\n"),
        "missing": Run(["generate", "--model", str(ROOT / "no" / "such" / "dir"), "--prompt", "x"]),
        # tensor parallelism from the command line: ranks spawned by the command, and every rank
        # running the command under torchrun (only rank 0 prints; the others follow and exit 0); both
        # with a draft model (the checkpoint itself: read on rank 0 only, torchrun's rank 1 keeps the path)
        "generate_tp_spawned": Run(["generate", "--model", ckpt["qwen"], "--prompt", PROMPT, "--max-new-tokens",
                                    str(NEW), "--tensor-parallel-size", "2", *_draft_self(ckpt), *SMALL_CLI]),
        "generate_tp_torchrun": Run(["generate", "--model", ckpt["qwen"], "--prompt", PROMPT, "--max-new-tokens",
                                     str(NEW), "--tensor-parallel-size", "2", *_draft_self(ckpt), *SMALL_CLI],
                                    launcher=("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")),
    }
    yield runs
    for run in runs.values():
        run.result()


def assert_clean_error(rc: int, err: str, *needles: str) -> None:
    assert rc != 0
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


# ---------------------------------------------------------------------------------------------
# the command line, in process
# ---------------------------------------------------------------------------------------------


def test_cli_non_hybrid_and_missing_tokenizer_errors(ckpt, capsys):
    assert main(["generate", "--model", ckpt["llama"], "--prompt", "x", "--no-progress"]) == 2
    assert_clean_error(2, capsys.readouterr().err, "'llama'", "supported model types", "qwen3_next", "mamba2")
    for command in (["generate", "--prompt", "x"], ["chat"]):
        assert main([command[0], "--model", ckpt["no_tok"], *command[1:], "--no-progress"]) == 2
        assert_clean_error(2, capsys.readouterr().err, "no tokenizer")
    assert main(["bench", "--model", ckpt["llama"], "--no-progress"]) == 2
    assert_clean_error(2, capsys.readouterr().err, "supported model types")


def test_cli_device_cuda_without_cuda_and_bench_numbers_are_one_clear_line(ckpt, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv in (["generate", "--model", ckpt["qwen"], "--prompt", "x"], ["chat", "--model", ckpt["qwen"]],
                 ["bench", "--model", ckpt["qwen"]], ["demo"], ["selfcheck"]):
        assert main([*argv, "--device", "cuda", *(["--no-progress"] if "--model" in argv else [])]) == 2
        assert_clean_error(2, capsys.readouterr().err, "--device cuda", "no CUDA device")
    monkeypatch.undo()
    # the user's numbers, not the warm-up's
    assert main(["bench", "--model", ckpt["no_tok"], "--num-prompts", "1", "--input-len", "500", "--output-len", "30",
                 *SMALL_CLI]) == 2
    assert_clean_error(2, capsys.readouterr().err, "--input-len 500 + --output-len 30", "max_new_tokens (30)")


def test_cli_bench_reports_prefill_and_decode_rates_and_writes_json(ckpt, tmp_path, capsys):
    path = tmp_path / "bench.json"
    # a checkpoint without tokenizer is fine: bench sends random token ids
    assert main(["bench", "--model", ckpt["no_tok"], "--num-prompts", "3", "--input-len", "20", "--output-len", "4",
                 "--max-running-requests", "2", "--json", str(path), *SMALL_CLI]) == 0
    out = capsys.readouterr().out
    assert "prefill" in out and "decode" in out and "tokens/s" in out
    result = json.loads(path.read_text())
    assert result["generated_tokens"] == 3 * 4
    assert result["prompt_tokens"] == 60
    assert result["prefill_tokens_per_s"] > 0 and result["decode_tokens_per_s"] > 0
    assert result["engine_stats"]["requests_finished"] >= 3
    assert "TTFT" in out and "TPOT" in out
    assert result["ttft_seconds"]["count"] == 3 and result["tpot_seconds"]["p50"] > 0


def test_cli_engine_options_reach_the_engine(ckpt, tmp_path, capsys):
    """--quantization, --kv-cache-dtype, --ssm-state-dtype, --compile and --speculative-config are
    honoured: the bench's engine stats show the FP8 layers, the pools' dtypes, no compile and the
    n-gram verify steps."""
    path = tmp_path / "bench.json"
    spec = json.dumps({"method": "ngram", "num_draft_tokens": 2})
    assert main(["bench", "--model", ckpt["no_tok"], "--num-prompts", "2", "--input-len", "12", "--output-len", "6",
                 "--quantization", "fp8", "--kv-cache-dtype", "fp8", "--ssm-state-dtype", "bfloat16",
                 "--compile", "off", "--cuda-graphs", "off", "--speculative-config", spec, "--json", str(path),
                 *SMALL_CLI]) == 0, capsys.readouterr().err
    assert re.search(r"drafts +ngram: \d+ verify steps, \d+ of \d+ drafts accepted", capsys.readouterr().out)
    stats = json.loads(path.read_text())["engine_stats"]
    assert stats["quantization"]["method"] == "fp8" and stats["quantization"]["fp8_weight_bytes"] > 0
    assert stats["memory"]["dtypes"] == {"kv": ["float8_e4m3fn"], "ssm": ["bfloat16"] * len(stats["memory"]["dtypes"]["ssm"])}
    assert stats["compile"]["enabled"] is False
    assert stats["speculative"]["method"] == "ngram" and stats["speculative"]["verify_steps"] > 0


def test_cli_host_tier_and_elastic_pools_reach_the_engine(ckpt, tmp_path, capsys):
    """--prefix-cache-host-tier / --prefix-cache-host-bytes (with a unit) / --elastic-pools are
    honoured (the bench's engine stats: a host tier of that size, elastic pools); the size alone, or
    a size that is no size, is one clear error."""
    path = tmp_path / "bench.json"
    assert main(["bench", "--model", ckpt["no_tok"], "--num-prompts", "2", "--input-len", "12", "--output-len", "4",
                 "--prefix-cache-host-tier", "--prefix-cache-host-bytes", "1.5MiB", "--elastic-pools",
                 "--json", str(path), *SMALL_CLI]) == 0, capsys.readouterr().err
    stats = json.loads(path.read_text())["engine_stats"]
    host = stats["prefix_cache"]["host_pool"]
    assert stats["prefix_cache"]["host_tier"] and 0.5 * 2**20 < host["bytes"] <= 1.5 * 2**20, host
    assert "to_kv" in stats["elastic_pools"], stats.get("elastic_pools")
    capsys.readouterr()
    assert main(["generate", "--model", ckpt["qwen"], "--prompt", PROMPT, "--max-new-tokens", "2",
                 "--prefix-cache-host-bytes", "8GiB", *SMALL_CLI]) == 2
    assert_clean_error(2, capsys.readouterr().err, "prefix_cache_host_bytes is set but prefix_cache_host_tier is False")
    with pytest.raises(SystemExit):
        main(["generate", "--model", ckpt["qwen"], "--prompt", PROMPT, "--prefix-cache-host-tier",
              "--prefix-cache-host-bytes", "lots", *SMALL_CLI])
    assert "not a size: 'lots'" in capsys.readouterr().err


def test_cli_speculative_draft_model_prints_transformers_greedy_text(ckpt, capsys):
    """--speculative-config with a draft model directory (the checkpoint itself): the draft model is
    loaded beside the target and the printed text is transformers' greedy text."""
    spec = json.dumps({"method": "draft_model", "draft_model": ckpt["qwen"], "num_draft_tokens": 3})
    assert main(["generate", "--model", ckpt["qwen"], "--prompt", PROMPT, "--max-new-tokens", str(NEW),
                 "--speculative-config", spec, *SMALL_CLI]) == 0
    assert capsys.readouterr().out == hf_text(ckpt["qwen"], PROMPT, NEW) + "\n"


@pytest.mark.parametrize("spec, needle", [
    ("{method: mtp}", "--speculative-config: not a JSON object"),
    ('["mtp"]', "--speculative-config: a JSON object of SpeculativeConfig fields"),
    ('{"method": "ngram", "draft_tokens": 2}', "unknown SpeculativeConfig field(s): draft_tokens"),
    ('{"method": "custom", "draft_source": "x"}', "draft_source (a Python object, method 'custom') cannot come"),
    ('{"method": "draft_model", "draft_model": "/no/such/dir"}', "draft_model '/no/such/dir'"),
    ('{"method": "draft_model"}', "method='draft_model' needs draft_model"),
    ('{"method": "mtp"}', "has no mtp.* tensors"),
])
def test_cli_speculative_config_errors_are_one_clear_line(ckpt, capsys, spec, needle):
    assert main(["generate", "--model", ckpt["qwen"], "--prompt", PROMPT, "--max-new-tokens", "2",
                 "--speculative-config", spec, *SMALL_CLI]) == 2
    assert_clean_error(2, capsys.readouterr().err, needle)


def test_bench_progress_advances_once_per_generated_token(qwen_engine):
    """bench's progress bar (cli._StepMeter) moves with every step by the tokens that step generated,
    not once at the end; the engine's own step is back in place afterwards."""
    from hybrid_compile.cli import _StepMeter

    class Bar:
        def __init__(self):
            self.updates = []

        def update(self, n):
            self.updates.append(n)

    bar = Bar()
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    with _StepMeter(qwen_engine, bar) as meter:
        out = qwen_engine.generate_batch(prompts, max_new_tokens=5, ignore_eos=True)
    assert "step" not in qwen_engine.__dict__
    assert sum(bar.updates) == sum(len(o) for o in out) == 10
    assert sum(1 for n in bar.updates if n) >= 5  # tokens arrive over (at least) 5 steps
    assert meter.prefill_steps >= 1 and meter.decode_steps >= 1 and meter.decode_tokens > 0


def test_every_subcommand_help_lists_each_option_with_its_default(monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # one line per option: no wrapping inside option names
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert {"demo", "selfcheck", "generate", "chat", "bench"} <= set(sub.choices)
    assert all(name in parser.format_help() for name in sub.choices)
    for name, p in sub.choices.items():
        text = " ".join(p.format_help().split())
        for action in p._actions:
            if action.dest == "help":
                continue
            for option in action.option_strings:
                assert option in text, (name, option)
            help_text = " ".join(action.help.split())
            if action.required:
                assert f"{help_text}" in text, (name, action.dest)
            else:
                assert f"{help_text} (default: {action.default})" in text, (name, action.dest)


# ---------------------------------------------------------------------------------------------
# from_pretrained + text in / text out
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen_engine(ckpt):
    engine = hc.from_pretrained(ckpt["qwen"], device="cpu", **SMALL)
    yield engine
    engine.close()


def test_from_pretrained_text_generate_and_batch_equal_transformers(ckpt, qwen_engine):
    engine = qwen_engine
    assert engine.tokenizer is not None and engine.device.type == "cpu"
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    prompts = [PROMPT, "The quick brown", chat]
    expected = [hf_text(ckpt["qwen"], p, NEW) for p in prompts]
    assert engine.generate_batch(prompts, max_new_tokens=NEW) == expected
    assert engine.generate(PROMPT, max_new_tokens=NEW) == expected[0]
    assert engine.generate(chat, max_new_tokens=NEW) == expected[2]
    assert engine.generate(prompts[:2], max_new_tokens=NEW) == expected[:2]
    # token ids in -> token ids out, on the same engine, also mixed with text
    ids = engine.tokenizer(PROMPT)["input_ids"]
    tokens, text = engine.generate_batch([ids, "The quick brown"], max_new_tokens=NEW)
    assert engine.decode(tokens) == expected[0] and text == expected[1]
    out = engine.generate(torch.tensor([ids]), max_new_tokens=NEW)
    assert isinstance(out, torch.Tensor) and engine.decode(out[0, len(ids):].tolist()) == expected[0]
    engine.clear_prefix_cache()  # on by default: it keeps the finished requests' slots
    engine.pools.check_all_free()


def test_streamers_print_exactly_the_returned_text(ckpt, qwen_engine, capsys):
    from transformers import TextIteratorStreamer, TextStreamer

    engine = qwen_engine
    capsys.readouterr()
    text = engine.generate(PROMPT, max_new_tokens=NEW,
                           streamer=TextStreamer(engine.tokenizer, skip_prompt=True, skip_special_tokens=True))
    assert capsys.readouterr().out == text + "\n"
    assert text == hf_text(ckpt["qwen"], PROMPT, NEW)

    chat = [{"role": "user", "content": "hi there"}]
    streamer = TextIteratorStreamer(engine.tokenizer, skip_prompt=True, skip_special_tokens=True, timeout=60)
    result = {}
    worker = threading.Thread(target=lambda: result.update(text=engine.generate(chat, max_new_tokens=NEW,
                                                                                 streamer=streamer)))
    worker.start()
    streamed = "".join(streamer)
    worker.join()
    assert streamed == result["text"] == hf_text(ckpt["qwen"], chat, NEW)
    with pytest.raises(ValueError, match="batch size 1"):
        engine.generate([PROMPT, PROMPT], streamer=streamer)


def test_eos_comes_from_the_generation_config_else_the_tokenizer(qwen_engine):
    engine = qwen_engine
    eos = engine.tokenizer.eos_token_id
    assert engine._params_for(engine._plan(), 1).eos_token_ids == (eos,)  # saved in the checkpoint's generation config
    saved = engine.model.generation_config.eos_token_id
    try:
        engine.model.generation_config.eos_token_id = None
        assert engine._params_for(engine._plan(), 1).eos_token_ids == (eos,)  # the tokenizer's
        assert engine._params_for(engine._plan(eos_token_id=[]), 1).eos_token_ids == ()
        engine.model.generation_config.eos_token_id = [5, 7]
        assert engine._params_for(engine._plan(), 1).eos_token_ids == (5, 7)
    finally:
        engine.model.generation_config.eos_token_id = saved


def test_mamba2_checkpoint_text_equals_transformers(ckpt):
    with hc.from_pretrained(ckpt["mamba"], device="cpu", dtype="float32", **SMALL) as engine:
        chat = [{"role": "user", "content": "hi there"}]
        assert engine.generate_batch([PROMPT, chat], max_new_tokens=NEW) == [
            hf_text(ckpt["mamba"], PROMPT, NEW), hf_text(ckpt["mamba"], chat, NEW)
        ]


def test_tokenizer_is_optional_and_settable(ckpt):
    model, tok = load_hf(ckpt["qwen"])
    expected = hf_text(ckpt["qwen"], PROMPT, NEW)
    with hc.wrap(model, **SMALL) as engine:
        assert engine.tokenizer is None
        with pytest.raises(ValueError, match="needs a tokenizer"):
            engine.generate(PROMPT, max_new_tokens=NEW)
        with pytest.raises(ValueError, match="needs a tokenizer"):
            engine.generate_batch([PROMPT], max_new_tokens=NEW)
        engine.tokenizer = tok
        assert engine.generate(PROMPT, max_new_tokens=NEW) == expected
    with hc.wrap(model, tokenizer=tok, **SMALL) as engine:
        assert engine.generate_batch([PROMPT], max_new_tokens=NEW) == [expected]
    # a checkpoint without tokenizer: none by default, one from another directory on request
    with hc.from_pretrained(ckpt["no_tok"], device="cpu", **SMALL) as engine:
        assert engine.tokenizer is None
    with hc.from_pretrained(ckpt["no_tok"], device="cpu", tokenizer=ckpt["qwen"], **SMALL) as engine:
        assert engine.generate(PROMPT, max_new_tokens=NEW) == expected


def test_from_pretrained_errors_are_clear(ckpt, tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        hc.from_pretrained(str(tmp_path / "missing"))
    with pytest.raises(CheckpointNotFoundError, match="no config.json"):
        hc.from_pretrained(str(tmp_path))
    with pytest.raises(UnsupportedModelError, match="'llama'.*supported model types: .*qwen3_next"):
        hc.from_pretrained(ckpt["llama"])
    with pytest.raises(TokenizerNotFoundError, match="no tokenizer"):
        hc.from_pretrained(ckpt["no_tok"], tokenizer="required")
    with pytest.raises(TypeError, match="unknown EngineConfig field"):
        hc.from_pretrained(ckpt["qwen"], max_runing_requests=2)
    # an extra key passed as a field: the error says where it goes
    with pytest.raises(TypeError, match=r"mtp_draft_graphs \(mtp_draft_graphs: a key of the `extra` field, e.g. "
                                        r"extra=\{'mtp_draft_graphs': ...\}\)"):
        hc.from_pretrained(ckpt["qwen"], mtp_draft_graphs=False)
    # EngineConfig.extra's keys are checked too (a typo or a field put in extra is never ignored),
    # from from_pretrained / wrap and from a HybridEngine built directly
    with pytest.raises(ValueError, match=r"unknown EngineConfig.extra key\(s\): 'fused_moe'; the keys are 'rewrite_passes'"):
        hc.from_pretrained(ckpt["qwen"], extra={"fused_moe": True})
    from hybrid_compile.engine.config import EngineConfig
    from hybrid_compile.engine.engine import HybridEngine

    with pytest.raises(ValueError, match=r"unknown EngineConfig.extra key\(s\): 'overlapp'"):
        HybridEngine(torch.nn.Linear(2, 2), EngineConfig(extra={"overlapp": False}))
    # and their values: a switch is a bool, not something that reads as one
    for extra, message in (({"overlap": "false"}, r"extra\['overlap'\] must be True or False, got 'false'"),
                           ({"skinny_matmuls": 1}, r"extra\['skinny_matmuls'\] must be True, False or None, got 1"),
                           ({"inductor_config": 3}, r"extra\['inductor_config'\] must be a dict"),
                           ({"memory_budget_bytes": 0}, r"extra\['memory_budget_bytes'\] must be a positive integer")):
        with pytest.raises(ValueError, match=message):
            EngineConfig.from_args(extra=extra)
    # a supported family the installed transformers lacks (LFM3 on transformers 5.17) says so
    (tmp_path / "lfm3").mkdir()
    (tmp_path / "lfm3" / "config.json").write_text('{"model_type": "lfm3"}')
    from transformers.models.auto import configuration_auto

    with pytest.MonkeyPatch.context() as mp:
        mp.delitem(configuration_auto.CONFIG_MAPPING_NAMES, "lfm3", raising=False)
        with pytest.raises(UnsupportedModelError, match=r"'lfm3' is a hybrid_compile family, but the installed transformers"):
            hc.from_pretrained(str(tmp_path / "lfm3"))
    # all of them are ValueErrors (wrap's own error for a non-hybrid model is one too)
    assert issubclass(UnsupportedModelError, ValueError) and issubclass(TokenizerNotFoundError, ValueError)


# ---------------------------------------------------------------------------------------------
# models placed by accelerate (device_map)
# ---------------------------------------------------------------------------------------------


def test_model_loaded_with_device_map_wraps_and_generates(ckpt):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt["qwen"], device_map="cpu")
    tok = load_hf(ckpt["qwen"])[1]
    with hc.wrap(model, tokenizer=tok, **SMALL) as engine:
        assert engine.generate(PROMPT, max_new_tokens=NEW) == hf_text(ckpt["qwen"], PROMPT, NEW)


def test_accelerate_hooks_on_every_module_wrap_generate_and_come_back_on_close(ckpt):
    from accelerate import dispatch_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt["qwen"])
    blocks = ["model.embed_tokens", "model.norm", "model.rotary_emb", "lm_head"]
    blocks += [f"model.layers.{i}" for i in range(model.config.num_hidden_layers)]
    model = dispatch_model(model, {name: "cpu" for name in blocks}, force_hooks=True)
    hooked = {name: m.forward for name, m in model.named_modules() if hasattr(m, "_hf_hook")}
    assert "model.layers.0.linear_attn" in hooked  # the mixer the engine patches has a hook
    tok = load_hf(ckpt["qwen"])[1]
    expected = hf_text(ckpt["qwen"], PROMPT, NEW)
    with hc.wrap(model, tokenizer=tok, **SMALL) as engine:
        assert engine.generate(PROMPT, max_new_tokens=NEW) == expected
    assert {name: m.forward for name, m in model.named_modules() if hasattr(m, "_hf_hook")} == hooked
    ids = torch.tensor([tok(PROMPT)["input_ids"]])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False)
    assert tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True) == expected


def test_offloaded_weights_are_rejected_clearly(ckpt, tmp_path):
    from accelerate import dispatch_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt["qwen"])
    device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    device_map.update({f"model.layers.{i}": "disk" if i == 1 else "cpu" for i in range(3)})
    model = dispatch_model(model, device_map, offload_dir=str(tmp_path / "offload"))
    with pytest.raises(ValueError, match="meta device.*one device"):
        hc.wrap(model, **SMALL)


# ---------------------------------------------------------------------------------------------
# the command line, as subprocesses
# ---------------------------------------------------------------------------------------------


def test_cli_generate_prints_transformers_greedy_text(ckpt, cli_runs):
    rc, out, err = cli_runs["generate"].result()
    assert rc == 0, err
    assert out == hf_text(ckpt["qwen"], PROMPT, NEW) + "\n"


def test_cli_generate_stream_on_a_mamba2_checkpoint(ckpt, cli_runs):
    rc, out, err = cli_runs["generate_stream"].result()
    assert rc == 0, err
    assert out == hf_text(ckpt["mamba"], PROMPT, NEW) + "\n"


def test_cli_chat_over_stdin_replies_like_transformers_and_stops_at_exit(ckpt, cli_runs):
    rc, out, err = cli_runs["chat"].result()
    assert rc == 0, err
    replies = hf_chat(ckpt["qwen"], CHAT_LINES, NEW)
    assert len(set(replies)) == 2  # the second turn sees the first: a different prompt
    assert out == "".join(r + "\n" for r in replies)


@pytest.mark.parametrize("launch", ["spawned", "torchrun"])
def test_cli_generate_with_tensor_parallelism_prints_transformers_greedy_text_once(ckpt, cli_runs, launch):
    rc, out, err = cli_runs[f"generate_tp_{launch}"].result()
    assert out == hf_text(ckpt["qwen"], PROMPT, NEW) + "\n", err
    if rc != 0 and launch == "torchrun" and _aborted_at_exit(err):
        # Known, open: about 1 torchrun run in 40 on this CPU machine, a rank aborts in C++ while
        # the interpreter exits, after the run completed and the groups were destroyed (gloo,
        # "terminate called without an active exception"). Reported as an expected failure, so
        # it stays visible without failing CI; any other failure fails the test.
        pytest.xfail("a rank aborted at interpreter exit after a complete run (known gloo teardown issue)")
    assert rc == 0, err


def _aborted_at_exit(err: str) -> bool:
    """torchrun's report of a run whose only failure is a rank's SIGABRT from std::terminate
    (the other rank then stopped by torchrun with SIGTERM)."""
    codes = set(re.findall(r"exitcode\s*:\s*(-?\d+)", err))
    rank_errors = re.search(r"\[rank\d+\]:.*(Traceback|Error)|^error: ", err, flags=re.M)
    return "terminate called without an active exception" in err and codes <= {"-6", "-15"} and "-6" in codes \
        and rank_errors is None


def test_cli_missing_directory_is_one_clear_line(cli_runs):
    rc, out, err = cli_runs["missing"].result()
    assert_clean_error(rc, err, "does not exist")
    assert out == ""
