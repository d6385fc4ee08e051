"""The ``hybrid-compile`` command line (also ``python -m hybrid_compile``)."""

from __future__ import annotations

import argparse
import json
import sys


def _selfcheck(args: argparse.Namespace) -> int:
    import torch

    from .ops.selfcheck import format_results, run_selfcheck

    dtype = getattr(torch, args.dtype)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA device is available", file=sys.stderr)
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
    result = run_demo(args.device, args.num_prompts, args.max_new_tokens, args.seed, check=not args.no_check)
    return 0 if result["matches_hf"] in (True, None) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybrid-compile",
        description="Fast serving of Hugging Face hybrid (linear attention / SSM + attention) models.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
