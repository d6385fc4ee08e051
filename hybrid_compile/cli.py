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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybrid-compile",
        description="Fast serving of Hugging Face hybrid (linear attention / SSM + attention) models.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
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
