"""The GPU-only code of the kernels, compiled for a Hopper GPU on this machine (no GPU needed): Triton
compiles to PTX and runs ptxas offline, while the interpreter the other kernel tests use never reaches the
dependent-launch paths (`USE_PDL`), whose instructions exist only on compute capability 9+.

What is checked is the invariant that makes dependent launch safe (kernels/gemv.py): a kernel launched
before the one ahead of it ends reads nothing that kernel writes until `griddepcontrol.wait`. For the
projections with a norm, nothing but L2 prefetches of W comes before the wait (plain ones load W's
first tile there); every kernel lets its own dependents
launch only after it waited (so the ordering is transitive); without `USE_PDL` none of it is emitted.

NOTE: runs in a subprocess: this session's kernels were decorated under TRITON_INTERPRET=1 (conftest.py),
and the compiler needs them decorated without it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = r'''
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from bento_pagedllm.kernels import gemv, paged_decode, rotary, swiglu_gemm

POINTERS = {"block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "counter_ptr": "*i32", "part_out_ptr": "*fp32",
            "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32", "slot_mapping_ptr": "*i64",
            "positions_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32"}


def aligned(kernel, constants):
    """What a launch specialises (Triton's "D" attribute) for the model's tensors: pointers 16-byte aligned,
    strides multiples of 16 elements; without it the loads compile element by element."""
    return {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
            if name not in constants and (name.endswith("_ptr") or name.startswith("stride"))}


def ptx(kernel, constants, num_warps=4, num_stages=3):
    """The kernel's PTX for an H100/H200 (sm_90): 16-bit tensors, 32-bit integers, float scales; the
    constexprs not given take their defaults."""
    constants = {**{p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default}, **constants}
    signature = {name: "constexpr" if name in constants else POINTERS.get(name, "*bf16")
                 if name.endswith("_ptr") else "fp32" if name in ("eps", "qk_scale") else "i32"
                 for name in kernel.arg_names}
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(kernel.arg_names.index(n),): v for n, v in constants.items()},
                       attrs=aligned(kernel, constants))
    options = {"launch_pdl": constants["USE_PDL"], "num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


def facts(text):
    wait = text.find("griddepcontrol.wait")
    return {"wait": wait, "launch": text.find("griddepcontrol.launch_dependents"),
            "first_load": text.find("ld.global"), "prefetches": text.count("prefetch.global.L2")}


result = {}
for swiglu in (False, True):
    for pdl in (False, True):
        constants = dict(ADD_RESIDUAL=swiglu, RMS_NORM=True, SWIGLU=swiglu, ADD_TO_OUTPUT=not swiglu, USE_PDL=pdl,
                         BLOCK_M=1, BLOCK_N=4, BLOCK_K=1024)
        result[f"gemv swiglu={swiglu} pdl={pdl}"] = facts(ptx(gemv._gemv_kernel, constants))
for pdl in (False, True):  # o and down: no norm, W double-buffered, its first tile loaded before the wait
    constants = dict(ADD_RESIDUAL=False, RMS_NORM=False, SWIGLU=False, ADD_TO_OUTPUT=True, USE_PDL=pdl,
                     BLOCK_M=1, BLOCK_N=4, BLOCK_K=1024)
    result[f"gemv plain pdl={pdl}"] = facts(ptx(gemv._gemv_kernel, constants))
for swiglu in (False, True):  # the tensor-core tiles of 2-64 rows
    constants = dict(ADD_RESIDUAL=swiglu, RMS_NORM=True, SWIGLU=swiglu, ADD_TO_OUTPUT=not swiglu, USE_PDL=True,
                     BLOCK_M=16, BLOCK_N=64, BLOCK_K=128)
    text = ptx(gemv._gemv_kernel, constants)
    result[f"gemv tile swiglu={swiglu} pdl=True"] = {
        **facts(text), "first_async_copy": text.find("cp.async"),
        "last_mma": max(text.rfind("mma.sync"), text.rfind("wgmma.mma_async"))}
for pdl in (False, True):
    for fused_rotary in (False, True):
        constants = dict(GROUP=4, GROUP_PAD=16, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_N=64, SINGLE_SPLIT=False,
                         ROTARY=fused_rotary, DOT_PRECISION="tf32", USE_PDL=pdl, EARLY_TILE=fused_rotary,
                         COMBINE_ROWS=4, COMBINE_SPLITS=8)
        name = "decode" + (" rotary" if fused_rotary else "")
        result[f"{name} pdl={pdl}"] = facts(ptx(paged_decode._decode_split_kernel, constants, num_stages=2))
    constants = dict(NUM_HEADS=32, HEADS_PAD=32, NUM_KV_HEADS=8, KV_HEADS_PAD=8, HALF=64, BLOCK_SIZE=16,
                     USE_PDL=pdl)
    result[f"rotary pdl={pdl}"] = facts(ptx(rotary._rotary_store_kv_kernel, constants))
# the SwiGLU GEMM of prefill steps: x and W through the tensor-memory accelerator, the tensor cores' wgmma
constants = dict(NUM_SMS=132, BLOCK_M=128, BLOCK=128, BLOCK_K=64, GROUP_M=8)
signature = {"x_desc": "tensordesc<bf16[128, 64]>", "w_desc": "tensordesc<bf16[256, 64]>",
             "y_desc": "tensordesc<bf16[128, 128]>", "M": "i32", "N": "i32", "K": "i32",
             **{name: "constexpr" for name in constants}}
kernel = swiglu_gemm._swiglu_gemm_kernel
source = ASTSource(fn=kernel, signature=signature,
                   constexprs={(kernel.arg_names.index(n),): v for n, v in constants.items()})
text = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 3}).asm["ptx"]
result["swiglu gemm"] = {"wgmma": text.count("wgmma.mma_async"), "tma": text.count("cp.async.bulk.tensor")}
print(json.dumps(result))
'''


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0 and "ptxas" in done.stderr and "not found" in done.stderr.lower():
        pytest.skip("no ptxas in this Triton install")
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("swiglu", [False, True])
def test_a_dependent_projection_only_prefetches_before_it_waits(compiled, swiglu):
    facts = compiled[f"gemv swiglu={swiglu} pdl=True"]
    assert facts["wait"] >= 0 and facts["prefetches"] == (2 if swiglu else 1)  # W's first tile (and up's)
    assert facts["first_load"] > facts["wait"], "a load before the wait could read the previous kernel's output"
    assert facts["launch"] > facts["wait"], "dependents may launch only after this kernel waited"


def test_a_plain_dependent_projection_loads_w_before_it_waits(compiled):
    """o and down (kernels/gemv.py): W is read-only, so its first tile is loaded, not prefetched, before
    the wait; the input (the kernel ahead's output) only after it."""
    facts = compiled["gemv plain pdl=True"]
    assert facts["prefetches"] == 0 and 0 <= facts["first_load"] < facts["wait"] < facts["launch"]


@pytest.mark.parametrize("swiglu", [False, True])
def test_a_dependent_tile_lets_the_next_kernel_launch_only_after_its_loop(compiled, swiglu):
    """The tiles (kernels/gemv.py): only prefetches before the wait, the inputs' loads and W's copies to
    shared memory after it, and the dependents' launch after the last tensor-core instruction."""
    facts = compiled[f"gemv tile swiglu={swiglu} pdl=True"]
    assert facts["prefetches"] > 0 and 0 <= facts["wait"] < facts["first_load"]
    assert facts["first_async_copy"] < 0 or facts["first_async_copy"] > facts["wait"]
    assert 0 <= facts["last_mma"] < facts["launch"], "the next kernel's programs would compete with the loop"


@pytest.mark.parametrize("kernel", ["decode", "decode rotary", "rotary"])
def test_dependent_attention_kernels_wait_before_letting_the_next_launch(compiled, kernel):
    facts = compiled[f"{kernel} pdl=True"]
    assert 0 <= facts["wait"] < facts["launch"]


@pytest.mark.parametrize("name", ["gemv swiglu=False", "gemv swiglu=True", "gemv plain", "decode", "decode rotary",
                                  "rotary"])
def test_plain_launches_emit_no_dependency_control(compiled, name):
    facts = compiled[f"{name} pdl=False"]
    assert facts["wait"] == facts["launch"] == -1 and facts["prefetches"] == 0


def test_the_swiglu_gemm_compiles_for_hopper_with_tma_and_wgmma(compiled):
    facts = compiled["swiglu gemm"]
    assert facts["wgmma"] > 0 and facts["tma"] > 0
