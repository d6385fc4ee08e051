"""The ``hybrid-compile`` command line (also ``python -m hybrid_compile``).

Subcommands: ``demo`` (built-in random-weight model), ``selfcheck`` (kernel ops), and for a
Hugging Face checkpoint directory ``generate``, ``chat``, ``bench`` and ``serve`` (the HTTP
server of :mod:`hybrid_compile.serving`). Errors the user can fix
(missing directory, non-hybrid model, missing tokenizer, a prompt too long, ...) print one
``error: ...`` line and exit with status 2; ``HYBRID_COMPILE_TRACEBACK=1`` shows the traceback.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
import time


def _selfcheck(args: argparse.Namespace) -> int:
    import torch

    from .ops.selfcheck import format_results, run_selfcheck

    dtype = getattr(torch, args.dtype)
    try:
        _check_device(args.device)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"hybrid_compile kernel-op self-check on {args.device}, {args.dtype} inputs (torch {torch.__version__})")
    results = run_selfcheck(args.device, dtype, seed=args.seed, reps=args.reps)
    print(format_results(results))
    failed = [r.op for r in results if not r.ok]
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.__dict__ | {"ok": r.ok} for r in results], f, indent=2)
    print(f"{len(results) - len(failed)}/{len(results)} ops match their per-token reference")
    return 1 if failed else 0


def _demo(args: argparse.Namespace) -> int:
    import warnings

    from transformers.utils import logging as hf_logging

    from .demo import run_demo

    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    try:
        _check_device(args.device)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = run_demo(args.device, args.num_prompts, args.max_new_tokens, args.seed, check=not args.no_check,
                      tensor_parallel_size=args.tensor_parallel_size)
    return 0 if result["matches_hf"] in (True, None) else 1


# ---------------------------------------------------------------------------------------------
# checkpoint commands: generate, chat, bench
# ---------------------------------------------------------------------------------------------


def _quiet_transformers() -> None:
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore")


def _check_device(device: str) -> None:
    """``--device cuda...`` on a machine without CUDA: a ValueError (one ``error:`` line, exit 2)."""
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA device is available on this machine (torch "
                         f"{torch.__version__}, built {'with' if torch.version.cuda else 'without'} CUDA); "
                         "use --device cpu or --device auto")


class _FollowerRankDone(Exception):
    """Raised by :func:`_load` on a torchrun rank other than 0 once it has followed rank 0's engine
    to its close: that rank's command has nothing more to do and exits 0 (no output, no prompt read)."""


def _load(args: argparse.Namespace, tokenizer, max_running_requests: int, **more_options):
    """from_pretrained with the command line's model / engine options (progress bar on stderr);
    ``more_options``: further EngineConfig fields. Under ``torchrun`` with ``--tensor-parallel-size``
    every rank runs the command: ranks other than 0 follow rank 0's steps inside this call and then
    end their command (:class:`_FollowerRankDone`)."""
    from .loading import from_pretrained

    _check_device(args.device)
    _quiet_transformers()
    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    if args.no_progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    options = dict(
        max_running_requests=max_running_requests, chunked_prefill_size=args.chunked_prefill_size,
        memory_fraction=args.memory_fraction, **more_options,
    )
    for name in ("max_total_tokens", "max_context_len"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    options.update(_engine_choices(args))
    engine = from_pretrained(
        args.model, dtype=None if args.dtype == "auto" else args.dtype,
        device=None if args.device == "auto" else args.device, tokenizer=tokenizer,
        trust_remote_code=args.trust_remote_code, progress=not args.no_progress,
        tensor_parallel_size=args.tensor_parallel_size, **options,
    )
    if engine is None:
        raise _FollowerRankDone
    return engine


_SWITCHES = {"auto": None, "on": True, "off": False}


def _engine_choices(args: argparse.Namespace) -> dict:
    """The EngineConfig fields of ``--quantization``, ``--kv-cache-dtype``, ``--ssm-state-dtype``,
    ``--compile``, ``--cuda-graphs``, ``--speculative-config``, ``--prefix-cache-host-tier``,
    ``--prefix-cache-host-bytes`` and ``--elastic-pools`` (each passed on as given: the engine
    honours it or raises naming it)."""
    options = dict(quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                   ssm_state_dtype=args.ssm_state_dtype, compile=_SWITCHES[args.compile],
                   cuda_graphs=_SWITCHES.get(args.cuda_graphs, args.cuda_graphs),
                   prefix_cache_host_tier=args.prefix_cache_host_tier, elastic_pools=args.elastic_pools)
    if args.prefix_cache_host_bytes is not None:  # (without --prefix-cache-host-tier: the engine's error naming it)
        options["prefix_cache_host_bytes"] = args.prefix_cache_host_bytes
    if args.speculative_config is not None:
        options["speculative"] = _speculative(args)
    return options


def _speculative(args: argparse.Namespace) -> dict:
    """``--speculative-config``'s fields (a ``draft_model`` directory is read by ``from_pretrained``)."""
    text = args.speculative_config
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--speculative-config: not a JSON object ({e}): {text!r}") from None
    if not isinstance(spec, dict):
        raise ValueError(f"--speculative-config: a JSON object of SpeculativeConfig fields, got {text!r}")
    if "draft_source" in spec:
        raise ValueError("--speculative-config: draft_source (a Python object, method 'custom') cannot come from "
                         "the command line; use method 'ngram', 'mtp' or 'draft_model'")
    from .engine.speculative import SpeculativeConfig

    try:  # (an unknown field is a TypeError there: one error line here)
        SpeculativeConfig.coerce(spec)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--speculative-config: {e}") from None
    return spec


def _sampling(args: argparse.Namespace) -> dict:
    sampling = dict(max_new_tokens=args.max_new_tokens, seed=args.seed)
    if args.temperature > 0:
        sampling.update(do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    else:
        sampling.update(do_sample=False)
    return sampling


def _text_streamer(tokenizer):
    from transformers import TextStreamer

    return TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)


def _prepare_stdout() -> None:
    # generated text may hold any character: never crash on a terminal that cannot show it
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")


def _generate(args: argparse.Namespace) -> int:
    _prepare_stdout()
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    engine = _load(args, args.tokenizer or "required", max_running_requests=1)
    if args.chat:
        prompt = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": prompt}
        ]
    try:
        if args.stream:
            engine.generate(prompt, streamer=_text_streamer(engine.tokenizer), **_sampling(args))
        else:
            print(engine.generate(prompt, **_sampling(args)), flush=True)
    finally:
        engine.close()
    return 0


def _chat(args: argparse.Namespace) -> int:
    _prepare_stdout()
    engine = _load(args, args.tokenizer or "required", max_running_requests=1)
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"chatting with {args.model}: one message per line; /reset starts over, /exit or Ctrl-D ends",
              file=sys.stderr)
    try:
        while True:
            if interactive:
                try:
                    line = input("you> ")
                except EOFError:
                    break
            else:
                line = sys.stdin.readline()
                if not line:
                    break
            text = line.rstrip("\r\n")
            command = text.strip()
            if not command:
                continue
            if command in ("/exit", "/quit"):
                break
            if command == "/reset":
                messages = list(system)
                continue
            messages.append({"role": "user", "content": text})
            try:
                if args.stream:
                    reply = engine.generate(messages, streamer=_text_streamer(engine.tokenizer), **_sampling(args))
                else:
                    reply = engine.generate(messages, **_sampling(args))
                    print(reply, flush=True)
            except ValueError as e:  # e.g. the conversation outgrew the context: keep the session
                messages.pop()
                print(f"error: {_one_line(e)} (/reset starts a new conversation)", file=sys.stderr)
                continue
            messages.append({"role": "assistant", "content": reply})
    finally:
        engine.close()
    return 0


class _StepMeter:
    """Wraps ``engine.step`` for the duration of a ``generate_batch``: times each step, splits the
    time into steps that process prompt tokens (prefill, also mixed ones) and decode-only steps,
    and advances a progress bar per generated token."""

    def __init__(self, engine, bar) -> None:
        self.engine, self.bar = engine, bar
        self.prefill_seconds = self.decode_seconds = 0.0
        self.prefill_tokens = self.decode_tokens = self.mixed_decode_tokens = 0
        self.prefill_steps = self.decode_steps = 0

    def __enter__(self) -> "_StepMeter":
        step = self.engine.step

        def timed_step():
            before = self.engine.stats()
            t0 = time.perf_counter()
            outputs = step()
            seconds = time.perf_counter() - t0
            after = self.engine.stats()
            prefill = after["prefill_tokens"] - before["prefill_tokens"]
            decode = after["decode_tokens"] - before["decode_tokens"]
            if prefill:
                self.prefill_seconds += seconds
                self.prefill_tokens += prefill
                self.mixed_decode_tokens += decode
                self.prefill_steps += 1
            elif decode:
                self.decode_seconds += seconds
                self.decode_tokens += decode
                self.decode_steps += 1
            self.bar.update(sum(o.token is not None for o in outputs))
            return outputs

        self.engine.step = timed_step
        return self

    def __exit__(self, *exc) -> None:
        self.engine.__dict__.pop("step", None)


def _bench(args: argparse.Namespace) -> int:
    import torch
    from tqdm.auto import tqdm

    engine = _load(args, False, max_running_requests=args.max_running_requests)
    try:
        vocab = engine.layout.vocab_size
        gen = torch.Generator().manual_seed(args.seed)
        prompts = [torch.randint(0, vocab, (args.input_len,), generator=gen).tolist() for _ in range(args.num_prompts)]
        sampling = dict(max_new_tokens=args.output_len, ignore_eos=True, do_sample=False)
        from .engine.sampling import SamplingParams

        # the timed requests' own numbers are checked first (not the warm-up's 2 new tokens)
        try:
            for p in prompts:
                engine.validate_request(p, SamplingParams(max_new_tokens=args.output_len))
        except ValueError as e:
            raise ValueError(f"--input-len {args.input_len} + --output-len {args.output_len}: {_one_line(e)}") from e
        if args.warmup:  # same prompts, 2 new tokens: compiles / warms the kernels at the timed shapes
            engine.generate_batch(prompts, **{**sampling, "max_new_tokens": min(2, args.output_len)})
            engine.reset_timings()
        with tqdm(total=len(prompts) * args.output_len, desc="tokens", unit="tok", file=sys.stderr,
                  disable=args.no_progress) as bar, _StepMeter(engine, bar) as meter:
            t0 = time.perf_counter()
            outputs = engine.generate_batch(prompts, **sampling)
            wall = time.perf_counter() - t0
        stats = engine.stats()
    finally:
        engine.close()
    generated = sum(len(o) for o in outputs)
    rate = lambda n, s: n / s if s > 0 else 0.0  # noqa: E731
    result = {
        "model": args.model,
        "device": str(engine.device),
        "dtype": str(engine.dtype).replace("torch.", ""),
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "max_running_requests": args.max_running_requests,
        "seconds": wall,
        "prompt_tokens": args.num_prompts * args.input_len,
        "generated_tokens": generated,
        "requests_per_s": rate(len(prompts), wall),
        "output_tokens_per_s": rate(generated, wall),
        "prefill_tokens_per_s": rate(meter.prefill_tokens, meter.prefill_seconds),
        "decode_tokens_per_s": rate(meter.decode_tokens, meter.decode_seconds),
        "prefill_seconds": meter.prefill_seconds,
        "decode_seconds": meter.decode_seconds,
        "prefill_steps": meter.prefill_steps,
        "decode_steps": meter.decode_steps,
        "decode_tokens_in_prefill_steps": meter.mixed_decode_tokens,
        "ttft_seconds": stats["ttft"],
        "tpot_seconds": stats["tpot"],
        "engine_stats": stats,
    }
    print(f"{args.model}: {args.num_prompts} prompts x {args.input_len} tokens -> {args.output_len} new tokens "
          f"each, on {result['device']} ({result['dtype']}), {args.max_running_requests} running at most")
    print(f"  prefill  {result['prefill_tokens_per_s']:12.1f} tokens/s  ({meter.prefill_tokens} tokens, "
          f"{meter.prefill_steps} steps, {meter.prefill_seconds:.3f} s)")
    print(f"  decode   {result['decode_tokens_per_s']:12.1f} tokens/s  ({meter.decode_tokens} tokens, "
          f"{meter.decode_steps} steps, {meter.decode_seconds:.3f} s)")
    print(f"  overall  {result['output_tokens_per_s']:12.1f} new tokens/s, {result['requests_per_s']:.2f} "
          f"requests/s, {wall:.3f} s")
    ms = lambda d, k: f"{1e3 * d[k]:.2f}" if d else "n/a"  # noqa: E731
    ttft, tpot = stats["ttft"], stats["tpot"]
    print(f"  TTFT     p50 {ms(ttft, 'p50')} ms, p90 {ms(ttft, 'p90')} ms, p99 {ms(ttft, 'p99')} ms (time to first token)")
    print(f"  TPOT     p50 {ms(tpot, 'p50')} ms, p90 {ms(tpot, 'p90')} ms, p99 {ms(tpot, 'p99')} ms "
          "(time per output token after the first)")
    spec = stats.get("speculative")
    if spec is not None:  # (--speculative-config)
        print(f"  drafts   {spec['method']}: {spec['verify_steps']} verify steps, {spec['accepted']} of "
              f"{spec['drafted']} drafts accepted ({100 * spec['acceptance_rate']:.1f} %)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
        print(f"  wrote {args.json}")
    return 0


def _engine_process(load):
    """``serve --engine-process``: the engine loaded and stepped by a child process (returns once it is ready)."""
    from .serving.engine_process import ProcessAsyncEngine

    return ProcessAsyncEngine(load)


def serve_engine_process(args: argparse.Namespace) -> bool:
    """Whether ``serve`` steps the engine in its own process: ``--engine-process`` /
    ``--no-engine-process`` as given; by default yes, except under tensor parallelism (the ranks'
    processes start from the serving process, whose driver thread steps rank 0's engine), where an
    explicit ``--engine-process`` is an error."""
    if args.engine_process and args.tensor_parallel_size != 1:
        raise ValueError("--engine-process with --tensor-parallel-size: the engine process cannot start the "
                         "ranks' processes; serve tensor-parallel models without --engine-process")
    return args.tensor_parallel_size == 1 if args.engine_process is None else args.engine_process


def _serve(args: argparse.Namespace) -> int:
    try:
        from .serving.server import run
    except ImportError as e:
        raise ValueError(f"serve needs the serve extra (pip install 'hybrid_compile[serve]'): {e}") from None

    options = dict(max_running_requests=args.max_running_requests, enable_prefix_cache=args.prefix_cache)
    load = functools.partial(_load, args, args.tokenizer or "required", **options)
    if serve_engine_process(args):
        # the same _load call, pickled to the engine process (the parser's func is no part of it)
        child_args = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "func"})
        load = functools.partial(_engine_process, functools.partial(_load, child_args, args.tokenizer or "required",
                                                                    **options))

    from .distributed.group import is_torchrun_follower

    if is_torchrun_follower(args.tensor_parallel_size):
        load()  # only rank 0 listens: a follower follows its engine until it closes, then _load ends the command
    return run(args.served_model_name or args.model, load, host=args.host, port=args.port,
               log_level=args.log_level, access_log=args.access_log, stream_interval=args.stream_interval,
               request_timing_log=args.request_timing_log)


def _one_line(e: BaseException) -> str:
    text = " ".join(part.strip() for part in str(e).splitlines() if part.strip())
    return text or type(e).__name__


def _user_errors(func):
    """Run a checkpoint command; errors the user can fix become one line and exit status 2."""

    def run(args: argparse.Namespace) -> int:
        from .loading import LoadError

        try:
            return func(args)
        except _FollowerRankDone:
            return 0
        except KeyboardInterrupt:
            return 130
        except (LoadError, ValueError, OSError, NotImplementedError) as e:
            if os.environ.get("HYBRID_COMPILE_TRACEBACK") == "1":
                raise
            print(f"error: {_one_line(e)}", file=sys.stderr)
            return 2

    return run


def _add_model_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="DIR", default=argparse.SUPPRESS,
                   help="Hugging Face checkpoint directory (config.json + safetensors; a Hub id also works); "
                   "required")


def _add_model_options(p: argparse.ArgumentParser, max_running_requests: int | None) -> None:
    from .engine.config import EngineConfig

    defaults = EngineConfig()
    p.add_argument("--device", default="auto",
                   help="cpu, cuda, cuda:N, or auto (the first CUDA device if there is one, else cpu)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weight / activation dtype; auto = the checkpoint's")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the checkpoint's own Python code")
    if max_running_requests is not None:
        p.add_argument("--max-running-requests", type=int, default=max_running_requests,
                       help="requests decoded together at most")
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="KV-pool token slots; None = sized from --memory-fraction")
    p.add_argument("--max-context-len", type=int, default=None,
                   help="longest prompt + generation; None = the model's limit")
    p.add_argument("--chunked-prefill-size", type=int, default=defaults.chunked_prefill_size,
                   help="prompt tokens per engine step at most")
    p.add_argument("--memory-fraction", type=float, default=defaults.memory_fraction,
                   help="share of free device memory (RAM on CPU) the pools may use")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads of torch (torch.set_num_threads); 0 = torch's default")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars (stderr)")
    p.add_argument("--quantization", default=None, choices=["fp8"],
                   help="fp8: serve the projections and MoE experts in block FP8, a float checkpoint quantized as "
                   "it loads; None = as stored (an FP8 checkpoint stays FP8)")
    p.add_argument("--kv-cache-dtype", default=defaults.kv_cache_dtype, choices=["auto", "fp8"],
                   help="KV cache of the full-attention layers: auto = the model dtype, fp8 = e4m3 with scales")
    p.add_argument("--ssm-state-dtype", default="float32", choices=["float32", "bfloat16", "float16", "fp8"],
                   help="recurrent-state pool of the linear-attention / SSM layers")
    p.add_argument("--compile", default="auto", choices=["auto", "on", "off"],
                   help="torch.compile with hybrid_compile's backend; auto = on for CUDA, off on CPU")
    p.add_argument("--cuda-graphs", default="auto", choices=["auto", "on", "off", "full", "piecewise"],
                   help="CUDA graphs over the compiled forward; auto = on with --compile on CUDA")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding: a JSON object of SpeculativeConfig fields, e.g. '
                   '\'{"method": "mtp", "num_draft_tokens": 3}\' or \'{"method": "draft_model", "draft_model": DIR}\' '
                   "(a checkpoint directory, loaded onto the model's device); None = off")
    p.add_argument("--prefix-cache-host-tier", action="store_true",
                   help="keep the prefix cache's evicted prefixes (their KV and recurrent states) in host memory and "
                   "load them back on a hit")
    p.add_argument("--prefix-cache-host-bytes", type=_byte_size, default=None, metavar="SIZE",
                   help="the host tier's size (bytes, or with a unit: 512MiB, 8GiB, 8G); None = a quarter of the "
                   "available host memory")
    p.add_argument("--elastic-pools", action="store_true",
                   help="move memory between the KV and recurrent-state pools at run time when one runs out while "
                   "the other sits free")
    _add_tensor_parallel_option(p)


_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def _byte_size(text: str) -> int:
    """``--prefix-cache-host-bytes``: a byte count, or a number with a binary unit (``512MiB``,
    ``8GiB``, ``8G``, ``1.5g``)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if m is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (bytes, or e.g. 512MiB, 8GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def _add_tensor_parallel_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="serve the model over N processes, one per device (--device cuda: GPUs 0..N-1; cpu: gloo), "
                   "each loading only its shard")


def _add_text_options(p: argparse.ArgumentParser, max_new_tokens: int) -> None:
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="tokenizer directory; None = the model directory")
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help="tokens generated per reply at most")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy decoding")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (with --temperature > 0)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0 = all")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--system", default=None, help="system message put first in the chat template (generate: with --chat); None = none")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybrid-compile",
        description="Fast serving of Hugging Face hybrid (linear attention / SSM + attention) models.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    from . import __version__

    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser(
        "demo",
        help="serve a small built-in random-weight Qwen3-Next and compare with transformers",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d.add_argument("--device", default="cpu", help="device of the model (cpu, cuda)")
    d.add_argument("--num-prompts", type=int, default=6, help="prompts of random lengths")
    d.add_argument("--max-new-tokens", type=int, default=24, help="tokens generated per prompt")
    d.add_argument("--seed", type=int, default=0, help="seed of the weights and prompts")
    d.add_argument("--no-check", action="store_true", help="skip the comparison with transformers' generate")
    _add_tensor_parallel_option(d)
    d.set_defaults(func=_demo)
    p = sub.add_parser(
        "selfcheck",
        help="check every kernel op against its per-token reference and time it",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--device", default="cpu", help="device to run the ops on (cpu, cuda)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="input dtype")
    p.add_argument("--seed", type=int, default=0, help="random seed of the inputs")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions per op (median reported)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.set_defaults(func=_selfcheck)

    fmt = argparse.ArgumentDefaultsHelpFormatter
    g = sub.add_parser(
        "generate", formatter_class=fmt,
        help="generate text for one prompt with a local hybrid checkpoint",
        description="Load a Hugging Face hybrid checkpoint (weights + tokenizer), generate for one prompt and print "
        "the new text (only the new text, on stdout).",
    )
    _add_model_argument(g)
    g.add_argument("--prompt", required=True, default=argparse.SUPPRESS,
                   help="the prompt text ('-' reads it from stdin); required")
    g.add_argument("--chat", action="store_true",
                   help="send the prompt as a user message through the tokenizer's chat template")
    g.add_argument("--stream", action="store_true", help="print the text as it is generated")
    _add_text_options(g, max_new_tokens=128)
    _add_model_options(g, max_running_requests=None)
    g.set_defaults(func=_user_errors(_generate))

    c = sub.add_parser(
        "chat", formatter_class=fmt,
        help="chat with a local hybrid checkpoint over stdin, one message per line",
        description="Interactive chat: each line read from stdin is a user message; the reply (rendered with the "
        "tokenizer's chat template) is printed. /reset starts a new conversation; /exit, /quit or end of input "
        "ends. Each turn sends the whole conversation; the engine's prefix cache (on by default) reuses the KV and "
        "recurrent state of the earlier turns, so only the new text is prefilled (up to the last checkpoint "
        "boundary of the cached part).",
    )
    _add_model_argument(c)
    c.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                   help="print replies as they are generated")
    _add_text_options(c, max_new_tokens=256)
    _add_model_options(c, max_running_requests=None)
    c.set_defaults(func=_user_errors(_chat))

    b = sub.add_parser(
        "bench", formatter_class=fmt,
        help="time generate_batch on random prompts with a local hybrid checkpoint",
        description="Time the engine's generate_batch on random token prompts drawn from the checkpoint's "
        "vocabulary (no tokenizer needed; EOS ignored): prefill tokens/s (steps that process prompt tokens), "
        "decode tokens/s (decode-only steps) and overall new tokens/s. Prints them and writes a JSON file.",
    )
    _add_model_argument(b)
    b.add_argument("--num-prompts", type=int, default=16, help="number of requests")
    b.add_argument("--input-len", type=int, default=256, help="prompt tokens per request")
    b.add_argument("--output-len", type=int, default=64, help="new tokens per request")
    b.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    b.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="run the prompts once untimed first (2 new tokens each)")
    b.add_argument("--json", default="bench.json", help="write the results to this JSON file ('' = do not write)")
    _add_model_options(b, max_running_requests=16)
    b.set_defaults(func=_user_errors(_bench))

    s = sub.add_parser(
        "serve", formatter_class=fmt,
        help="serve a local hybrid checkpoint over an OpenAI-compatible HTTP API",
        description="Serve a Hugging Face hybrid checkpoint (weights + tokenizer) over HTTP: /v1/completions, "
        "/v1/chat/completions (streaming with server-sent events), /v1/models, /health and Prometheus /metrics. "
        "The server listens at once and loads the model meanwhile (/health answers 503 until it is ready). Needs "
        "the serve extra: pip install 'hybrid_compile[serve]'.",
    )
    _add_model_argument(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=8000, help="TCP port")
    s.add_argument("--served-model-name", default=None, help="the model name clients send; None = --model as given")
    s.add_argument("--tokenizer", default=None, metavar="DIR", help="tokenizer directory; None = the model directory")
    s.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV and recurrent state of shared prompt prefixes")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="log level of the server")
    s.add_argument("--stream-interval", type=int, default=1,
                   help="send a streamed choice's text every N tokens (and at its end): less HTTP work per token, "
                        "coarser chunks")
    s.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True,
                   help="log one line per HTTP request")
    s.add_argument("--request-timing-log", default=None, metavar="FILE",
                   help="append one JSON line per request with the times of its way through the server (handler "
                        "start, queued to the engine, added to the engine, first token, first event sent, end; "
                        "perf_counter seconds, keyed by the request's X-Request-Id header)")
    s.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                   help="run the engine in its own process (the server process keeps HTTP, tokenization and "
                        "detokenization; the engine process steps): neither waits on the other's Python. The "
                        "default without --tensor-parallel-size; --no-engine-process: the engine on a driver "
                        "thread of the server process (the default with it)")
    _add_model_options(s, max_running_requests=64)
    s.set_defaults(func=_user_errors(_serve))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
