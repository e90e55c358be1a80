import time, sys, os
from concurrent.futures import ThreadPoolExecutor
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from bento_pagedllm.kernels import gemv

POINTERS = {}
def compile_one(constants, num_warps, num_stages):
    kernel = gemv._gemv_kernel
    signature = {name: "constexpr" if name in constants else "*bf16" if name.endswith("_ptr") else "fp32" if name == "eps" else "i32" for name in kernel.arg_names}
    source = ASTSource(fn=kernel, signature=signature, constexprs={(kernel.arg_names.index(n),): v for n, v in constants.items()})
    options = {"launch_pdl": constants["USE_PDL"], "num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]

jobs = []
for c in gemv._row_configs():
    for swiglu in (False, True):
        jobs.append((dict(ADD_RESIDUAL=True, RMS_NORM=True, SWIGLU=swiglu, ADD_TO_OUTPUT=False, USE_PDL=True, BLOCK_M=1, **c.kwargs), c.num_warps, c.num_stages))
threads = int(sys.argv[1])
t = time.perf_counter()
if threads == 1:
    out = [compile_one(*j) for j in jobs]
else:
    with ThreadPoolExecutor(threads) as pool:
        out = list(pool.map(lambda j: compile_one(*j), jobs))
print(threads, len(jobs), round(time.perf_counter() - t, 2), sum(len(o) for o in out))
