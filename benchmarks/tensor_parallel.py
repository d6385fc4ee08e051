"""Tensor-parallel scaling: the same checkpoint served at TP 1 / 2 / 4 (hybrid_compile.distributed).

For each tensor-parallel size: decode tokens/s at batch 1 / 16 / 64 (requests of ``--prompt-len``
tokens, ``--new-tokens`` each; only the steps after every request's first token are timed),
prefill tokens/s of one prompt of 4k and 32k tokens, the time rank 0 spends in all-reduces per
decode step (torch.profiler over a few decode steps: gloo / NCCL / one-shot all-reduce events, and
rank 0's host ops with the most own CPU time per step; the same for one prompt of the shortest
prefill length, ``prefill_profile``), each rank's
shard and peak memory while loading, and the scaling efficiency
``tok/s(TP n) / (n * tok/s(TP 1))`` of every measurement.

The model is a checkpoint directory (``--model DIR``) or random weights of a shape (``--shape``):
``qwen3_next_80b`` (the Qwen3-Next-80B-A3B shape: 48 layers, 512 experts, top-10, bf16: ~160 GB,
~75 GiB per rank at TP 2), ``reference`` (the 1.9 B reference Qwen3-Next of the other benchmarks);
``--tiny`` is a toy Qwen3-Next for CPU smoke runs (``--device cpu --tiny``). Random weights come
two ways (``--weights``): ``random`` (the default for ``qwen3_next_80b``) writes only
``config.json`` and ``random_weights.json`` to ``--workdir`` and every rank draws its own shard
directly on its GPU (``hybrid_compile/distributed/loading.py``: nothing of the model touches disk
or host memory; TP 1 needs real weights, so sizes > 1 only); ``checkpoint`` writes a safetensors
checkpoint once, tensor by tensor from a meta-device model (disk, not memory).

Memory at TP 2: the 80B shape's weights take ~75 GiB per rank, so 2 H200s (141 GB each) serve it
whole; on 2 H100s (80 GB) ``--layers 36`` (~56 GiB per rank) leaves room for the pools (half the
free memory, ``memory_fraction``), the activations and the graphs.

``--mtp K`` serves with speculative decoding by a random MTP head (``speculative={"method": "mtp",
"num_draft_tokens": K}``, Qwen3-Next / Qwen3.5 shapes): its ``mtp.*`` tensors are written once to
``<checkpoint>_mtp/mtp.safetensors`` (``reference_models.save_random_mtp_head``) and every rank loads
its shard of them (``mtp_checkpoint``). A random head's drafts are all but never accepted, so the
decode rows then measure what drafting costs under tensor parallelism (acceptance length ~1: the
head's window and chain steps, each replayed by every rank, plus the verify step); the JSON keeps
each size's ``speculative`` stats. ``--mtp-baseline`` also serves each size without speculative
decoding (on CUDA in a process of its own, as the sizes) and keeps, per batch, ``mtp_vs_plain``: the
tok/s ratio, a verify cycle's and a plain decode step's milliseconds and their ratio
(``cycle_vs_decode_step``: a head accepting L tokens a cycle decodes at about L / that ratio times
the plain rate).

On CUDA each of several ``--tp`` sizes runs in a process of its own (this script again with that size):
a second tensor-parallel engine of one process serves its all-reduces on NCCL (its rank 0 mapped
a symmetric buffer for the first, its new ranks did not), so the sizes would not be measured alike.

``--cuda-graphs`` sets the engine's ``cuda_graphs`` (``auto``: its default, both kinds on CUDA;
``full`` / ``piecewise`` / ``false``): under tensor parallelism every rank captures the same graphs
with the NCCL all-reduces inside them.

    python benchmarks/tensor_parallel.py --shape qwen3_next_80b --tp 2 --cuda-graphs true --out tp80b.json
    python benchmarks/tensor_parallel.py --shape reference --weights checkpoint --tp 1,2,4 --workdir /data/ckpt
    python benchmarks/tensor_parallel.py --shape qwen3_next_80b --tp 2 --mtp 3 --mtp-baseline --batches 1,16 --out tp80b_mtp.json
    python benchmarks/tensor_parallel.py --device cpu --tiny --tp 1,2     # smoke run

Prints a table and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # the repository's, installed or not
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchmarks.profiling import decode_profile, prefill_profile  # noqa: E402
from reference_models import (qwen3_next_reference_config, random_token_prompts, save_random_mtp_head,  # noqa: E402
                              sync_device)


def qwen3_next_80b_config():
    """The Qwen3-Next-80B-A3B shape (random weights)."""
    import transformers

    return transformers.Qwen3NextConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=5120, num_hidden_layers=48,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 12, num_attention_heads=16,
        num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=512,
        num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512, decoder_sparse_step=1,
        mlp_only_layers=[], norm_topk_prob=True, tie_word_embeddings=False, max_position_embeddings=65536,
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )


def qwen3_5_moe_35b_config():
    """The Qwen3.5-35B-A3B shape: transformers' ``Qwen3_5MoeTextConfig`` defaults (40 layers, 3 GDN
    to 1 attention, 256 experts, top-8, hidden 2048, vocab 248,320)."""
    import transformers

    return transformers.Qwen3_5MoeTextConfig(tie_word_embeddings=False, max_position_embeddings=65536,
                                             pad_token_id=None, bos_token_id=None, eos_token_id=None)


def nemotron3_nano_30b_config():
    """A Nemotron-3-Nano-30B-A3B-like NemotronH shape: 52 layers (23 Mamba2, 23 MoE, 6 attention),
    hidden 2688, Mamba2 64 heads x 64 (state 128, 8 groups), attention 32 heads / 2 KV heads x 128,
    128 routed experts (top-6, width 1856) and a shared one (3712), vocab 131,072."""
    import transformers

    return transformers.NemotronHConfig(
        vocab_size=131072, hidden_size=2688, intermediate_size=1856, mamba_num_heads=64, mamba_head_dim=64,
        ssm_state_size=128, n_groups=8, chunk_size=128, conv_kernel=4, num_attention_heads=32, num_key_value_heads=2,
        head_dim=128, hybrid_override_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
        n_routed_experts=128, n_shared_experts=1, num_experts_per_tok=6, moe_intermediate_size=1856,
        moe_shared_expert_intermediate_size=3712, mlp_hidden_act="relu2", tie_word_embeddings=False,
        max_position_embeddings=65536, pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )


# --shape: random-weight shapes (every rank draws its own shard) and the 1.9 B reference (a checkpoint)
SHAPES = {"qwen3_next_80b": qwen3_next_80b_config, "qwen3_5_moe_35b": qwen3_5_moe_35b_config,
          "nemotron3_nano_30b": nemotron3_nano_30b_config, "reference": qwen3_next_reference_config}


def tiny_config():
    cfg = qwen3_next_reference_config(tiny=True)
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.linear_num_key_heads, cfg.linear_num_value_heads = 4, 2, 4, 4
    cfg.tie_word_embeddings = False
    return cfg


def write_random_checkpoint(config, path: str, dtype: torch.dtype, seed: int = 0, shard_bytes: int = 4 << 30) -> None:
    """A safetensors checkpoint of ``config`` with random weights (std 0.02; norms 1, A_log 0),
    written one shard at a time (``model-XXXXX.safetensors`` + index) from a meta-device model."""
    from accelerate import init_empty_weights
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    if os.path.isfile(os.path.join(path, "config.json")):
        return
    os.makedirs(path, exist_ok=True)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    from hybrid_compile.distributed.loading import random_value

    g = torch.Generator().manual_seed(seed)
    weight_map, shard, size, index = {}, {}, 0, 0

    def flush():
        nonlocal shard, size, index
        if shard:
            name = f"model-{index:05d}.safetensors"
            save_file(shard, os.path.join(path, name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
            shard, size, index = {}, 0, index + 1

    tied = bool(getattr(config, "tie_word_embeddings", False))
    for name, p in model.named_parameters():
        if tied and name == "lm_head.weight":
            continue  # the embedding's
        t = random_value(name, p.shape, 0.02, g, dtype)
        shard[name] = t
        size += t.numel() * t.element_size()
        if size >= shard_bytes:
            flush()
    flush()
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    config.save_pretrained(path)


def write_random_weights(config, path: str, seed: int = 0, std: float = 0.02) -> None:
    """``config.json`` and ``random_weights.json``: every rank draws its shard on its device."""
    from hybrid_compile.distributed.loading import RANDOM_WEIGHTS

    os.makedirs(path, exist_ok=True)
    config.save_pretrained(path)
    with open(os.path.join(path, RANDOM_WEIGHTS), "w") as f:
        json.dump({"seed": seed, "std": std}, f)


def with_layers(config, layers: int):
    """``config`` cut to its first ``layers`` layers (the layer pattern kept)."""
    config.num_hidden_layers = layers
    for field in ("layer_types", "layers_block_type"):
        if getattr(config, field, None):
            setattr(config, field, list(getattr(config, field)[:layers]))
    return config


def write_random_mtp_head(config, path: str, dtype: torch.dtype) -> str:
    """Random ``mtp.*`` tensors for a model of ``config`` in ``path`` (written once): the head's
    decoder layer built by transformers from the config (a meta-device model gives its class)."""
    if os.path.isfile(os.path.join(path, "mtp.safetensors")):
        return path
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config).to(dtype)
    return save_random_mtp_head(model, path)


def decode(engine, batch: int, prompt_len: int, new: int, vocab: int, seed: int) -> dict:
    from hybrid_compile import SamplingParams

    prompts = random_token_prompts(batch, prompt_len, vocab, seed)
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    rids = [engine.add_request(p, params) for p in prompts]
    reqs = [engine.request(r) for r in rids]
    while not all(r.output for r in reqs):
        engine.step()
    sync_device(engine.device)
    t0, steps = time.perf_counter(), 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    sync_device(engine.device)
    seconds = time.perf_counter() - t0
    tokens = sum(len(r.output) - 1 for r in reqs)
    for r in rids:
        engine.pop_finished(r)
    engine.clear_prefix_cache()
    return dict(batch=batch, decode_tokens=tokens, steps=steps, seconds=seconds,
                tokens_per_s=tokens / seconds if seconds else 0.0)


def prefill(engine, length: int, vocab: int, seed: int) -> dict:
    """One prompt of ``length`` tokens, timed after an untimed one of the same length (kernels that
    first run at this length's chunk sizes are JIT-compiled or autotuned by it)."""
    prompt = random_token_prompts(1, length, vocab, seed)[0]
    engine.generate_batch([random_token_prompts(1, length, vocab, seed + 1)[0]], max_new_tokens=1)
    engine.clear_prefix_cache()
    sync_device(engine.device)
    t0 = time.perf_counter()
    engine.generate_batch([prompt], max_new_tokens=1)
    sync_device(engine.device)
    seconds = time.perf_counter() - t0
    engine.clear_prefix_cache()
    return dict(length=length, seconds=seconds, tokens_per_s=length / seconds)


def run_tp(args, path: str, tp: int, vocab: int, save) -> dict:
    """Every measurement at ``tp``; ``save(out)`` runs after each one (a run cut short keeps them)."""
    import hybrid_compile as hc

    # no prefix cache: every prompt is fresh random tokens, so its Mamba checkpoint slots would only take
    # memory from the running requests' (--extra '{"enable_prefix_cache": true}' turns it on)
    opts = dict(max_running_requests=max(args.batches), chunked_prefill_size=args.chunked_prefill,
                max_context_len=max(args.prefill + [args.prompt_len + args.new_tokens]) + 8,
                enable_prefix_cache=False)
    if args.cuda_graphs != "auto":
        opts["cuda_graphs"] = {"true": True, "false": False}.get(args.cuda_graphs, args.cuda_graphs)
    if args.mtp:
        opts["speculative"] = dict(method="mtp", num_draft_tokens=args.mtp, mtp_checkpoint=args.mtp_dir)
    opts.update(args.extra)
    t0 = time.perf_counter()
    engine = hc.from_pretrained(path, dtype=args.dtype, device=args.device, tokenizer=False, tensor_parallel_size=tp,
                                **opts)
    out = dict(tp=tp, load_seconds=time.perf_counter() - t0, decode={}, prefill={}, all_reduce=None,
               startup=engine.stats()["startup"], startup_work=engine.stats()["startup_work"],
               memory=engine.stats()["memory"])
    print(f"TP {tp}: ready in {out['load_seconds']:.1f} s", flush=True)
    save(out)
    try:
        decode(engine, 1, 16, 4, vocab, seed=1)  # warm-up
        for b in args.batches:
            out["decode"][str(b)] = decode(engine, b, args.prompt_len, args.new_tokens, vocab, seed=b)
            print(f"TP {tp}: decode b{b} {out['decode'][str(b)]['tokens_per_s']:.1f} tok/s", flush=True)
            save(out)
        for L in args.prefill:
            out["prefill"][str(L)] = prefill(engine, L, vocab, seed=L)
            print(f"TP {tp}: prefill {L} {out['prefill'][str(L)]['tokens_per_s']:.0f} tok/s", flush=True)
            save(out)
        out["profile"] = {str(b): decode_profile(engine, b, vocab) for b in sorted({min(args.batches), max(args.batches)})}
        out["prefill_profile"] = prefill_profile(engine, min(args.prefill), vocab)
        out["all_reduce"] = out["profile"][str(max(args.batches))] if tp > 1 else None
        stats = engine.stats()
        out["tensor_parallel"] = stats.get("tensor_parallel")
        out["speculative"] = stats.get("speculative")
        out["memory"] = stats["memory"]
        c = stats["compile"]
        out["compile"] = {k: c.get(k) for k in ("enabled", "cuda_graphs", "decode_batch_sizes", "token_buckets",
                                                 "capture_seconds", "cuda_graph_replays", "piecewise_replays",
                                                 "eager_fallbacks", "graph_breaks", "recompiles")}
    finally:
        engine.close()
    return out


def efficiency(results: list[dict]) -> dict:
    base = next((r for r in results if r["tp"] == 1), None)
    if base is None:
        return {}
    eff = {}
    for r in results:
        e = {}
        for kind in ("decode", "prefill"):
            for k, v in r[kind].items():
                b = base[kind].get(k)
                if b and b["tokens_per_s"]:
                    speedup = v["tokens_per_s"] / b["tokens_per_s"]
                    e[f"{kind}_{k}"] = dict(speedup=speedup, efficiency=speedup / r["tp"])
        eff[str(r["tp"])] = e
    return eff


def without_options(argv: list[str], names: tuple[str, ...], flags: tuple[str, ...] = ()) -> list[str]:
    """``argv`` without the options ``names`` and their values (``--name value`` or ``--name=value``)
    and the value-less ``flags``."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in names:
            skip = True
        elif a not in flags and not any(a.startswith(n + "=") for n in names):
            out.append(a)
    return out


def mtp_vs_plain(mtp: dict, plain: dict) -> dict:
    """Per batch of both runs' decode rows: ``tok_s_ratio`` (MTP / plain), ``cycle_ms`` (a verify step:
    the decode loop's seconds per step), ``decode_step_ms`` (plain) and ``cycle_vs_decode_step``."""
    out = {}
    for b, m in mtp["decode"].items():
        p = plain["decode"].get(b)
        if not p or not m["steps"] or not p["steps"] or not p["tokens_per_s"]:
            continue
        cycle, step = 1e3 * m["seconds"] / m["steps"], 1e3 * p["seconds"] / p["steps"]
        out[b] = dict(tok_s_ratio=m["tokens_per_s"] / p["tokens_per_s"], cycle_ms=cycle, decode_step_ms=step,
                      cycle_vs_decode_step=cycle / step)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="a toy Qwen3-Next (CPU smoke run)")
    ap.add_argument("--model", default=None, help="a checkpoint directory (default: a random one, see --shape)")
    ap.add_argument("--shape", default="qwen3_next_80b", choices=sorted(SHAPES))
    ap.add_argument("--workdir", default="/tmp/hybrid_compile_tp_ckpt", help="where the random checkpoint is written")
    ap.add_argument("--weights", choices=["random", "checkpoint"], default=None,
                    help="random: each rank draws its shard on its device (default for every shape but "
                         "reference); "
                         "checkpoint: write a safetensors checkpoint to --workdir once")
    ap.add_argument("--layers", type=int, default=None, help="only the first N layers of --shape")
    ap.add_argument("--cuda-graphs", default="auto", choices=["auto", "true", "false", "full", "piecewise"],
                    help="the engine's cuda_graphs (auto: its default)")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--tp", default=None, help="tensor-parallel sizes (default 2 with random weights, else 1,2,4)")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prefill", default="4096,32768", help="prefill prompt lengths")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--chunked-prefill", type=int, default=8192)
    ap.add_argument("--mtp", type=int, default=0, metavar="K",
                    help="speculative decoding with K drafts of a random MTP head (module docstring)")
    ap.add_argument("--mtp-baseline", action="store_true",
                    help="with --mtp: each size also without speculative decoding, and their ratios (mtp_vs_plain)")
    ap.add_argument("--extra", type=json.loads, default={}, help="more EngineConfig fields (JSON)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", nargs="+", metavar="FILE", default=None,
                    help="only plot: PNG then the JSON of earlier runs (e.g. one per TP size) of one shape")
    args = ap.parse_args()
    if args.plot:
        from plots import plot_tensor_parallel

        if len(args.plot) < 2:
            raise SystemExit("--plot needs the PNG path, then at least one JSON run")
        runs = []
        for name in args.plot[1:]:
            with open(name) as f:
                runs.append(json.load(f))
        done = plot_tensor_parallel(runs, args.plot[0])
        print(done.get("message") or "\n".join(done["files"]))
        return
    random_default = args.weights == "random" or (args.weights is None and args.model is None and not args.tiny
                                                  and args.shape != "reference")
    if args.mtp_baseline and not args.mtp:
        raise SystemExit("--mtp-baseline compares an MTP run with a plain one: it needs --mtp K")
    args.tp = [int(x) for x in (args.tp or ("2" if random_default else "1,2,4")).split(",")]
    args.batches = [int(x) for x in args.batches.split(",")]
    args.prefill = [int(x) for x in args.prefill.split(",")]
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.tiny and args.prefill == [4096, 32768]:
        args.prefill = [64]
    if args.tiny and args.batches == [1, 16, 64]:
        args.batches = [1, 4]
    dtype = getattr(torch, args.dtype)
    if args.model:
        path = args.model
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path)
    else:
        config = tiny_config() if args.tiny else SHAPES[args.shape]()
        if args.layers:
            config = with_layers(config, args.layers)
        weights = args.weights or ("random" if random_default else "checkpoint")
        name = ("tiny" if args.tiny else args.shape) + (f"_{args.layers}l" if args.layers else "")
        path = os.path.join(args.workdir, f"{name}_{weights}")
        t0 = time.perf_counter()
        if weights == "random":
            if min(args.tp) < 2:
                raise SystemExit("--weights random: every rank draws its shard, so --tp sizes must be > 1 "
                                 "(TP 1 needs --weights checkpoint)")
            write_random_weights(config, path)
        else:
            write_random_checkpoint(config, path, dtype)
        print(f"{weights} weights {path} ready ({time.perf_counter() - t0:.1f} s)")
    vocab = config.get_text_config().vocab_size
    args.mtp_dir = None
    if args.mtp:
        t0 = time.perf_counter()
        args.mtp_dir = write_random_mtp_head(config, path.rstrip("/") + "_mtp", dtype)
        print(f"random MTP head {args.mtp_dir} ready ({time.perf_counter() - t0:.1f} s)")
    results: list[dict] = []

    def result() -> dict:
        return dict(device=args.device, dtype=args.dtype, model=path, tiny=args.tiny,
                    device_name=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                    gpus=torch.cuda.device_count() if args.device == "cuda" else 0, results=results,
                    scaling=efficiency(results), torch=torch.__version__, args=vars(args))

    def run_apart(tp: int, plain: bool = False) -> dict:
        """Size ``tp`` measured by this script in a process of its own (``plain``: without speculative
        decoding, the ``--mtp-baseline`` run): rank 0 of a second engine in one process maps no symmetric
        buffer with new rank processes (``distributed/one_shot.py``), so its all-reduces would be NCCL's,
        not the one-shot kernel's that a first engine takes."""
        import subprocess
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, f"tp{tp}.json")
            argv = without_options(sys.argv[1:], ("--tp", "--out") + (("--mtp",) if plain else ()),
                                   ("--mtp-baseline",) if plain else ())
            subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--tp", str(tp), "--out", out], check=True)
            with open(out) as f:
                return json.load(f)["results"][0]

    def run_plain(tp: int) -> dict:
        """The ``--mtp-baseline`` run of size ``tp``: the same engine without speculative decoding."""
        if args.device == "cuda":
            return run_apart(tp, plain=True)
        return run_tp(argparse.Namespace(**{**vars(args), "mtp": 0}), path, tp, vocab, lambda current: None)

    def save(current: dict) -> None:
        if args.out:
            with open(args.out, "w") as f:
                json.dump({**result(), "results": results + [current]}, f, indent=1, default=str)

    for tp in args.tp:
        r = run_tp(args, path, tp, vocab, save) if len(args.tp) == 1 or args.device != "cuda" else run_apart(tp)
        if args.mtp and args.mtp_baseline:
            r["plain"] = {k: v for k, v in run_plain(tp).items() if k in ("decode", "prefill", "load_seconds")}
            r["mtp_vs_plain"] = mtp_vs_plain(r, r["plain"])
            for b, v in r["mtp_vs_plain"].items():
                print(f"TP {tp}: MTP {args.mtp} vs plain, batch {b}: x{v['tok_s_ratio']:.2f} tok/s, a verify cycle "
                      f"{v['cycle_ms']:.2f} ms = {v['cycle_vs_decode_step']:.2f} decode steps of {v['decode_step_ms']:.2f} ms")
        results.append(r)
        dec = "  ".join(f"b{b} {v['tokens_per_s']:.1f}" for b, v in r["decode"].items())
        pre = "  ".join(f"{L} {v['tokens_per_s']:.0f}" for L, v in r["prefill"].items())
        ar = r["all_reduce"]["all_reduce_ms_per_step"] if r["all_reduce"] else 0.0
        print(f"TP {tp}: decode tok/s {dec} | prefill tok/s {pre} | all-reduce {ar:.3f} ms/step")
        profiles = [(f"decode batch {b}", p) for b, p in r.get("profile", {}).items()]
        if "prefill_profile" in r:
            profiles.append((f"prefill {r['prefill_profile']['length']}", r["prefill_profile"]))
        for what, prof in profiles:
            busy = f", GPU busy {prof['gpu_busy_ms_per_step']:.2f}" if "gpu_busy_ms_per_step" in prof else ""
            print(f"TP {tp}: {what}: {prof['wall_ms_per_step']:.2f} ms per step{busy}, "
                  f"all-reduce {prof['all_reduce_ms_per_step']:.2f}; host: "
                  + ", ".join(f"{o['name'][:40]} {o['ms_per_step']:.3f}" for o in prof["top_host_ops"][:6]))
    final = result()
    for tp, e in final["scaling"].items():
        print(f"TP {tp} scaling: " + "  ".join(f"{k} x{v['speedup']:.2f} ({100 * v['efficiency']:.0f} %)"
                                              for k, v in e.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(final, f, indent=1, default=str)


if __name__ == "__main__":
    main()
