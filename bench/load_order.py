"""When does a one-row projection's loop issue its loads? A diagnostic, offline (no GPU needed).

Why: a warp issues in order, so a load that comes after an instruction reading an earlier load's registers
waits for that load to arrive: the two round trips are serialised, and the loop keeps fewer bytes in flight
than its tiles suggest. Which instructions come first is ptxas's choice, not the source's. Found so
(fiftieth session, bench/results/gpu-2026-12-07): main's one-row gate/up in a 1 x 512 tile of 2 warps issued
its up row only once its gate row had arrived, while the autotuner's usual 4 x 1,024 tile issued all ten loads
first; and the plain projections (o, down) ask for their next, double-buffered, W tile only once the loop's x
tile has come from L2 (bench/results/gpu-2026-12-07/gemv_x_double_buffer.diff loads x ahead too; not measured
yet).

For each of the autotuner's one-row configurations (kernels/gemv.py `_row_configs`) and each kind of
projection (norm prologue: q/k/v and the LM head; SwiGLU: gate/up, interleaved as the model lays it out; plain
with the residual added: o and down), this compiles `_gemv_kernel` for sm_90 (pointers and N, K, the stride
16-divisible, as the JIT specialises them), disassembles it with the nvdisasm Triton bundles, and reports per
loop: registers, global loads, and how many loads come after the first instruction that reads a loaded
register. Run it with the GPU machine's Triton (its ptxas decides), e.g.

    pip download --no-deps triton==3.6.0 -d /tmp/t36w && pip install --no-deps --target /tmp/t36 /tmp/t36w/*.whl
    PYTHONPATH=/tmp/t36 python bench/load_order.py --kinds swiglu
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

# NOTE: appended, so that a tree named first on PYTHONPATH (an A/B variant in ab/) is the one compiled
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KINDS = {  # the flags of each kind of one-row projection, as the model launches it on an H200
    "norm": dict(ADD_RESIDUAL=False, RMS_NORM=True, SWIGLU=False, ADD_TO_OUTPUT=False, INTERLEAVE=0),
    "swiglu": dict(ADD_RESIDUAL=False, RMS_NORM=True, SWIGLU=True, ADD_TO_OUTPUT=False, INTERLEAVE=128),
    "plain": dict(ADD_RESIDUAL=False, RMS_NORM=False, SWIGLU=False, ADD_TO_OUTPUT=True, INTERLEAVE=0),
}


def loop_load_order(sass: str) -> list[dict]:
    """Per loop of the disassembly (a label some later branch jumps back to): its instructions, its global
    loads, and the loads issued after the first instruction that reads a register an earlier load of the same
    iteration writes (each such load waits for that one)."""
    loops = []
    for label in re.findall(r"^(\.L_x_\d+):", sass, flags=re.M):
        start = sass.index(label + ":")
        back = re.search(r"BRA `\(" + re.escape(label) + r"\)", sass[start:])
        if not back:
            continue
        text = sass[start:start + back.start()].rsplit("\n", 1)[0]  # NOTE: up to the branch's line, not into it
        body = [re.sub(r";.*", "", line.split("*/", 1)[1]).strip()
                for line in text.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", line)]
        pending: set[int] = set()  # the registers the loads issued so far in this iteration write
        loads = after_use = 0
        first_use = None
        for index, line in enumerate(body):
            opcode, _, operands = re.sub(r"^@!?P\d\s+", "", line).partition(" ")
            parts = [p.strip() for p in operands.split(",")]
            if opcode.startswith("LDG"):
                loads += 1
                after_use += first_use is not None
                base = int(re.search(r"R(\d+)", parts[0]).group(1))
                pending |= set(range(base, base + (4 if ".128" in opcode else 2 if ".64" in opcode else 1)))
            elif pending & {int(r) for r in re.findall(r"\bR(\d+)\b", ",".join(parts[1:]))}:
                first_use = index if first_use is None else first_use
        if loads:
            loops.append({"label": label, "instructions": len(body), "loads": loads,
                          "first_use": first_use, "loads_after_first_use": after_use})
    return loops


def compile_sass(kernel, constants: dict, num_warps: int) -> tuple[str, str]:
    """(SASS, resource usage) of `kernel` compiled for sm_90 with these constexprs."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    signature = {n: "constexpr" if n in constants else "*bf16" if n.endswith("_ptr") else "fp32" if n == "eps"
                 else "i32" for n in names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
               if n not in constants and (n.endswith("_ptr") or n in ("N", "K", "stride_w"))}
    source = ASTSource(fn=kernel, signature=signature, attrs=aligned,
                       constexprs={(names.index(n),): v for n, v in constants.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"launch_pdl": constants.get("USE_PDL", False), "num_warps": num_warps})
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        sass = subprocess.run([os.path.join(tools, "nvdisasm"), "-c", cubin.name], capture_output=True,
                              text=True, check=True).stdout
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-resource-usage", cubin.name],
                               capture_output=True, text=True).stdout
    return sass, usage


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated: " + ", ".join(KINDS))
    parser.add_argument("--extra", default="", help="more tiles, e.g. 1x512x2 (rows x columns x warps)")
    args = parser.parse_args()
    import triton

    from bento_pagedllm.kernels import gemv

    tiles = [(c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps) for c in gemv._row_configs()]
    tiles += [tuple(map(int, t.split("x"))) for t in args.extra.split(",") if t]
    for kind in args.kinds.split(","):
        for block_n, block_k, warps in tiles:
            constants = {**KINDS[kind], "USE_PDL": True, "BLOCK_M": 1, "BLOCK_N": block_n, "BLOCK_K": block_k}
            sass, usage = compile_sass(gemv._gemv_kernel, constants, warps)
            registers = re.search(r"REG:(\d+)", usage)
            print(json.dumps({"triton": triton.__version__, "kind": kind, "tile": f"{block_n}x{block_k}x{warps}",
                              "registers": int(registers.group(1)) if registers else None,
                              "loops": loop_load_order(sass)}), flush=True)


if __name__ == "__main__":
    main()
