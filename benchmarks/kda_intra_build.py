"""Build the chunked-prefill intra kernel (``hybrid_compile/ops/triton/gdn_chunk.py``'s
``_chunk_intra_kernel``) for an NVIDIA GPU on a machine without one, and print what the build says
about each launch setting: registers, spill bytes (stores / loads, ptxas), shared memory, static
SASS instructions per thread and the instruction count of each loop body. This is how the KDA
(per-channel gate) intra kernel's ``CONFIG["kda_intra_bk"]`` / ``["kda_intra_warps"]`` defaults
were chosen before any GPU timing; time them with ``benchmarks/profile_gdn_chunk.py --kda --sweep``.
``--kernel gram`` builds the KDA chunk-wide product kernel (``_chunk_kda_gram_kernel``; BK/warps as for
the intra kernel). ``--kernel state`` builds the sequential state kernel (``_chunk_state_kernel``) at the launcher's
setting (``gdn_chunk.state_launch``) instead: its shared memory must stay within the 227 KB a block
may have on sm_90.

    python benchmarks/kda_intra_build.py [--configs 16/4,16/8,32/8] [--arch 90] [--gdn] [--fp32 | --fp16]
                                         [--stages N] [--kernel intra|state|gram] [--chunk-wide] [--split]

Shapes are Kimi-Linear-48B's (32 heads, K = V = 128, bf16 q/k/v, fp32 g); ``--gdn`` builds the
per-head-gate variant instead (Qwen3-Next: value heads per key head 2, BK 64), ``--fp32`` the
fp32-input variant (TF32x3 matmuls), ``--fp16`` fp16 inputs (fp32 intermediates, TF32 matmuls). Uses Triton's bundled ``ptxas`` / ``cuobjdump``; must run
without ``TRITON_INTERPRET``. It builds with the Triton that is importable: the GPU machine's (3.6) compiles
differently from a newer CPU machine's (KDA gram kernel at 16 / 4: 254 registers with 3.6, 174 with 3.9; intra
block path at 16 / 2: 388 B of spills against 1,388), so build with that one for its figures:
``pip download triton==3.6.0 --no-deps -d T && python -m zipfile -e T/triton-3.6.0-*.whl T/site &&
chmod +x T/site/triton/backends/nvidia/bin/*``, then ``PYTHONPATH=T/site:.``.
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

#: element types of the pointer arguments that are not fp32, as the launcher allocates them; "low" =
#: bf16 on the bf16 (``lowp``) path, fp32 otherwise; "in" = the input dtype
_PTR = {"q": "in", "k": "in", "v": "in", "w": "low", "qg": "low", "kg": "low", "pbuf": "low", "vn": "low",
        "hbuf": "low", "cu_seqlens": "*i32", "state_indices": "*i32", "has_init": "*i1", "steep": "*i8"}
_DTYPES = {"bf16": ("*bf16", "tf32"), "fp16": ("*fp16", "tf32"), "fp32": ("*fp32", "tf32x3")}


def constants(bk, gate_k=True, inputs="bf16", kernel="intra", chunk_wide=False, split=False):
    """The kernel's constexpr arguments as the launcher passes them at Kimi-Linear / Qwen3-Next shapes
    (K = V = 128; ``bk``: the intra kernel's K block, or the state kernel's V block)."""
    prec = _DTYPES[inputs][1]
    lowp = inputs == "bf16"
    if kernel == "state":
        return dict(HV=32, R=1 if gate_k else 2, K=128, V=128, KP=128, BV=bk, BB=16, PREC=prec, LOWP=lowp,
                    DOT_F32=False, STORE_CS=lowp, GATE_K=gate_k)
    if kernel == "gram":
        return dict(HV=32, R=1, K=128, BK=bk, BB=16, MMA_RANGE=128.0, PREC=prec, SPLIT=split)
    return dict(HV=32, R=1 if gate_k else 2, K=128, V=128, BK=bk, BV=64, BB=16, USE_L2=True, PREC=prec, KPREC=prec,
                RAW_K=True, GATE_K=gate_k, LOWP=lowp, DOT_F32=False, MMA_RANGE=64.0, CHUNK_WIDE=chunk_wide,
                SPLIT=split)


def signature(kern, consts, inputs, kernel="intra"):
    low = "*bf16" if inputs == "bf16" else "*fp32"
    sig = {}
    for name in kern.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name.startswith("s_") or name == "nb":
            sig[name] = "i32"
        else:  # the state kernel's ``k`` is the intra kernel's decayed keys (or the keys: GDN)
            kind = "low" if kernel == "state" and name == "k" and "GATE_K" in consts and consts["GATE_K"] else _PTR.get(name, "*fp32")
            if consts.get("SPLIT") and name in ("steep", "sidx"):  # channel counts and lists
                kind = "*i32"
            sig[name] = {"in": _DTYPES[inputs][0], "low": low}.get(kind, kind)
    return sig


def _tool(name):
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def build_kernel(kern, sig: dict, consts: dict, warps: int, arch: int = 90, stages: int | None = None) -> dict:
    """Compiles the ``@triton.jit`` kernel ``kern`` with the argument types ``sig`` (``"constexpr"`` for
    the ``consts``) for ``sm_<arch>`` and returns the build's statistics: ``regs``, ``spill_stores`` /
    ``spill_loads`` (bytes, ptxas), ``shared`` (bytes), ``sass`` (static instructions) and ``loops``
    (instructions of each loop body, largest first). Any kernel of the package: the KDA intra and state
    kernels here, the fp32 paged-attention extend tile in ``tests/test_triton_attention.py``."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("building real kernels (benchmarks/kda_intra_build.py): unset TRITON_INTERPRET")
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
    return {"warps": warps, "regs": regs, "spill_stores": spills and spills[0], "spill_loads": spills and spills[1],
            "shared": compiled.metadata.shared, "sass": len(insts), "loops": sorted(loops, reverse=True)}


def build(bk, warps, arch=90, gate_k=True, inputs="bf16", stages=None, kernel="intra", chunk_wide=False,
          split=False):
    """Compiles ``_chunk_intra_kernel`` (or ``_chunk_state_kernel``: ``kernel="state"``, ``bk`` its V
    block) for ``sm_<arch>`` (``stages``: Triton's ``num_stages``, None = its default); returns the
    build's statistics (:func:`build_kernel`)."""
    kern = {"state": gdn_chunk._chunk_state_kernel, "gram": gdn_chunk._chunk_kda_gram_kernel}.get(
        kernel, gdn_chunk._chunk_intra_kernel)
    consts = constants(bk, gate_k, inputs, kernel, chunk_wide, split)
    return {"bk": bk, **build_kernel(kern, signature(kern, consts, inputs, kernel), consts, warps, arch, stages)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=None,
                    help="BK/warps, comma separated (default 16/2,16/4,16/8,32/4,32/8,64/8); "
                         "--kernel state: the launcher's setting (gdn_chunk.state_launch) unless given as BV/warps")
    ap.add_argument("--kernel", choices=("intra", "state", "gram"), default="intra")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--gdn", action="store_true", help="the per-head gate (GDN) variant")
    dt = ap.add_mutually_exclusive_group()
    dt.add_argument("--fp32", action="store_true", help="fp32 inputs (TF32x3 matmuls)")
    dt.add_argument("--fp16", action="store_true", help="fp16 inputs (fp32 intermediates, TF32 matmuls)")
    ap.add_argument("--stages", type=int, default=None, help="num_stages (default: Triton's, as the launcher)")
    ap.add_argument("--chunk-wide", action="store_true",
                    help="the intra kernel's CHUNK_WIDE compile (KDA chunks whose A the gram kernel made)")
    ap.add_argument("--split", action="store_true",
                    help="KDA with CONFIG['kda_split_channels'] (steep channels listed per chunk; gram and intra kernels)")
    args = ap.parse_args()
    inputs = "fp32" if args.fp32 else ("fp16" if args.fp16 else "bf16")
    stages = args.stages
    if args.configs is None and args.kernel == "state":
        bv, warps, launch_stages = gdn_chunk.state_launch(gdn_chunk.CONFIG, inputs == "bf16", 128, 128)
        configs = [(bv, warps)]
        stages = launch_stages if stages is None else stages
    else:
        configs = [tuple(int(x) for x in c.split("/")) for c in (args.configs or "16/2,16/4,16/8,32/4,32/8,64/8").split(",")]
    print(f"triton {triton.__version__}, sm_{args.arch}, {args.kernel} kernel, {'GDN' if args.gdn else 'KDA'}, {inputs}, "
          f"num_stages {stages if stages is not None else 'default'}")
    for bk, warps in configs:
        r = build(bk, warps, args.arch, gate_k=not args.gdn, inputs=inputs, stages=stages, kernel=args.kernel,
                  chunk_wide=args.chunk_wide, split=args.split)
        print(f"{'BV' if args.kernel == 'state' else 'BK'} {bk:3d} / {warps} warps: {r['regs']} regs, spills {r['spill_stores']} B stored / "
              f"{r['spill_loads']} B loaded, {r['shared']} B shared, {r['sass']} SASS instructions, "
              f"loop bodies {r['loops'][:4]}", flush=True)


if __name__ == "__main__":
    main()
