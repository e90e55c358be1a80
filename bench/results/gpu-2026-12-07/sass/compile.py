import sys, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
sys.path.insert(0, '/work/main')
from bento_pagedllm.kernels import gemv

def compile_one(kernel, constants, num_warps, num_stages=3, ints=()):
    signature = {name: "constexpr" if name in constants else "*bf16" if name.endswith("_ptr") else "fp32" if name == "eps" else "i32" for name in kernel.arg_names}
    aligned = [i for i, n in enumerate(kernel.arg_names) if n not in constants and (n.endswith("_ptr") or n in ("N", "K", "stride_w"))]
    source = ASTSource(fn=kernel, signature=signature, constexprs={(kernel.arg_names.index(n),): v for n, v in constants.items()},
                       attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    options = {"launch_pdl": constants.get("USE_PDL", False), "num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)

if __name__ == "__main__":
    c = dict(ADD_RESIDUAL=False, RMS_NORM=True, SWIGLU=True, ADD_TO_OUTPUT=False, USE_PDL=True, BLOCK_M=1, BLOCK_N=1, BLOCK_K=512, INTERLEAVE=128)
    k = compile_one(gemv._gemv_kernel, c, 2)
    ptx = k.asm["ptx"]
    open('/tmp/ptx/gate_up.ptx','w').write(ptx)
    print(k.n_regs if hasattr(k,'n_regs') else '', len(ptx))
    print(k.asm.keys())

def sass(k, path):
    import subprocess, os
    open(path + '.cubin', 'wb').write(k.asm['cubin'])
    nv = os.path.join(os.path.dirname(triton.__file__), 'backends/nvidia/bin/nvdisasm')
    out = subprocess.run([nv, '-c', path + '.cubin'], capture_output=True, text=True).stdout
    open(path + '.sass', 'w').write(out)
    return out
