"""Build the chunked-prefill intra kernel (``hybrid_compile/ops/triton/gdn_chunk.py``'s
``_chunk_intra_kernel``) for an NVIDIA GPU on a machine without one, and print what the build says
about each launch setting: registers, spill bytes (stores / loads, ptxas), shared memory, static
SASS instructions per thread and the instruction count of each loop body. This is how the KDA
(per-channel gate) intra kernel's ``CONFIG["kda_intra_bk"]`` / ``["kda_intra_warps"]`` defaults
were chosen before any GPU timing; time them with ``benchmarks/profile_gdn_chunk.py --kda --sweep``.

    python benchmarks/kda_intra_build.py [--configs 16/4,16/8,32/8] [--arch 90] [--gdn] [--fp32] [--stages N]

Shapes are Kimi-Linear-48B's (32 heads, K = V = 128, bf16 q/k/v, fp32 g); ``--gdn`` builds the
per-head-gate variant instead (Qwen3-Next: value heads per key head 2, BK 64), ``--fp32`` the
fp32-input variant (TF32x3 matmuls). Uses Triton's bundled ``ptxas`` / ``cuobjdump``; must run
without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from hybrid_compile.ops.triton import gdn_chunk  # noqa: E402

_PTR = {"q": "*bf16", "k": "*bf16", "v": "*bf16", "w": "*bf16", "qg": "*bf16", "kg": "*bf16", "pbuf": "*bf16",
        "cu_seqlens": "*i32", "state_indices": "*i32"}


def constants(bk, gate_k=True, fp32=False):
    """The kernel's constexpr arguments as the launcher passes them at Kimi-Linear / Qwen3-Next shapes."""
    prec = "tf32x3" if fp32 else "tf32"
    return dict(HV=32, R=1 if gate_k else 2, K=128, V=128, BK=bk, BV=64, BB=16, USE_L2=True, PREC=prec, KPREC=prec,
                RAW_K=True, GATE_K=gate_k, LOWP=not fp32, DOT_F32=False, MMA_RANGE=64.0)


def _tool(name):
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def build(bk, warps, arch=90, gate_k=True, fp32=False, stages=None):
    """Compiles ``_chunk_intra_kernel`` for ``sm_<arch>`` (``stages``: Triton's ``num_stages``, None =
    its default, as the launcher); returns the build's statistics."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("benchmarks/kda_intra_build.py builds real kernels: unset TRITON_INTERPRET")
    kern = gdn_chunk._chunk_intra_kernel
    consts = constants(bk, gate_k, fp32)
    sig = {}
    for name in kern.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name.startswith("s_") or name == "nb":
            sig[name] = "i32"
        else:
            sig[name] = _PTR.get(name, "*fp32").replace("bf16", "fp32" if fp32 else "bf16")
    const_args = {(kern.arg_names.index(k),): v for k, v in consts.items()}
    compiled = triton.compile(ASTSource(fn=kern, signature=sig, constexprs=const_args),
                              target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": warps, **({} if stages is None else {"num_stages": stages})})
    with tempfile.TemporaryDirectory() as tmp:
        cubin, ptx = os.path.join(tmp, "k.cubin"), os.path.join(tmp, "k.ptx")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        res = subprocess.run([_tool("cuobjdump"), "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True, check=True).stdout
        # ptxas -v for the spill bytes: the first bundled ptxas that takes this PTX version
        spills = None
        for name in ("ptxas", "ptxas-blackwell"):
            if not os.path.exists(_tool(name)):
                continue
            out = subprocess.run([_tool(name), "-v", f"-arch=sm_{arch}a", ptx, "-o", os.path.join(tmp, "v.cubin")],
                                 capture_output=True, text=True)
            m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out.stderr)
            if m:
                spills = (int(m.group(1)), int(m.group(2)))
                break
    regs = int(re.search(r"REG:(\d+)", res).group(1))
    insts = re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)
    loops = []
    for addr, text in insts:
        m = re.search(r"BRA (?:\S+ )?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < int(addr, 16):  # a backward branch: a loop's body
            loops.append((int(addr, 16) - int(m.group(1), 16)) // 16 + 1)
    return {"bk": bk, "warps": warps, "regs": regs, "spill_stores": spills and spills[0],
            "spill_loads": spills and spills[1], "shared": compiled.metadata.shared, "sass": len(insts),
            "loops": sorted(loops, reverse=True)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="16/2,16/4,16/8,32/4,32/8,64/8", help="BK/warps, comma separated")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--gdn", action="store_true", help="the per-head gate (GDN) variant")
    ap.add_argument("--fp32", action="store_true", help="fp32 inputs (TF32x3 matmuls)")
    ap.add_argument("--stages", type=int, default=None, help="num_stages (default: Triton's, as the launcher)")
    args = ap.parse_args()
    print(f"triton {triton.__version__}, sm_{args.arch}, {'GDN' if args.gdn else 'KDA'}, {'fp32' if args.fp32 else 'bf16'}")
    for cfg in args.configs.split(","):
        bk, warps = (int(x) for x in cfg.split("/"))
        r = build(bk, warps, args.arch, gate_k=not args.gdn, fp32=args.fp32, stages=args.stages)
        print(f"BK {bk:3d} / {warps} warps: {r['regs']} regs, spills {r['spill_stores']} B stored / "
              f"{r['spill_loads']} B loaded, {r['shared']} B shared, {r['sass']} SASS instructions, "
              f"loop bodies {r['loops'][:4]}", flush=True)


if __name__ == "__main__":
    main()
