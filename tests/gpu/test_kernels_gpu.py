"""The kernel checks of tests/test_kernels.py at model sizes, in bfloat16 and float16, on a GPU.

Shapes are Llama-2-7B's attention (32 heads over 32 KV heads, head_dim 128) and Llama-3-8B's (32 over 8),
with contexts up to 4096 tokens, block sizes 16 and 32. Tolerances (kernel_cases.ATTN_TOL) are against
a float32 reference fed the same rounded inputs: bf16 keeps 8 significant bits, so rounding the softmax
weights before P @ V (what makes the product run on tensor cores) costs up to 2^-8 relative per weight;
with |v| <~ 4 that bounds the error near 1.6e-2 relative, the same budget torch.testing gives bf16.
"""

import pytest
import torch
from bento_pagedllm.models.ops import supports_dependent_launch
from kernel_cases import (
    attention_cases,
    check_argmax,
    check_backends_agree,
    check_decode,
    check_fill_pending_ids,
    check_gemv,
    check_prefill,
    check_rms_norm,
    check_rotary_and_store_kv,
    check_silu_and_mul,
    decode_case,
    prefill_case,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: run on the GPU machine"),
]

BF16, F16 = torch.bfloat16, torch.float16
# the engine's choice on this GPU: kernels launched as programmatic dependents on compute capability 9+
PDL = torch.cuda.is_available() and supports_dependent_launch(torch.device("cuda"))
LLAMA2_7B = dict(num_kv_heads=32, group=1, head_dim=128)
LLAMA3_8B = dict(num_kv_heads=8, group=4, head_dim=128)
MODELS = {"llama2-7b": LLAMA2_7B, "llama3-8b": LLAMA3_8B}

DECODE_LENS = [
    ((1, 16, 511, 4096, 1000, 2048, 33, 64), (1,) * 8),  # ragged, block boundaries, one long context
    (tuple(range(37, 37 + 64 * 61, 61)), (1,) * 64),  # a big batch: no split, one launch
    ((4096, 4095), (1,) * 2),  # few long contexts: many splits
]
PREFILL_LENS = [
    ((4096,), (4096,)),  # a whole long prompt
    ((3512, 1, 700, 2049, 16), (512, 1, 700, 1, 16)),  # a mixed step: chunk after a long prefix, decodes
    ((333, 1024, 77), (33, 1024, 7)),
]


def model_cases(lens_list):
    """Each model's shape in both dtypes and block sizes, the batch shapes cycled over them."""
    return [
        case
        for shape in MODELS.values()
        for case in attention_cases((BF16, F16), (shape["group"],), (16, 32), lens_list,
                                    num_kv_heads=shape["num_kv_heads"], head_dim=shape["head_dim"])
    ]


DECODE_CASES = model_cases(DECODE_LENS) + [
    decode_case((100, 4096, 7), num_splits=s, dtype=BF16, **LLAMA3_8B) for s in (1, 5, 64)
] + [decode_case((900, 17), group=8, num_kv_heads=4, dtype=BF16)]  # GQA 8
PREFILL_CASES = model_cases(PREFILL_LENS) + [
    prefill_case((600, 90), (300, 1), group=8, num_kv_heads=4, dtype=BF16),
    prefill_case((600, 90), (300, 1), group=7, num_kv_heads=4, dtype=BF16),  # Qwen2-7B's group
]
BACKEND_CASES = [
    prefill_case((3512, 1, 700, 2049, 16), (512, 1, 700, 1, 16), dtype=BF16, **LLAMA3_8B),
    prefill_case((3512, 1, 700, 2049, 16), (512, 1, 700, 1, 16), dtype=BF16, **LLAMA2_7B),
    decode_case((1, 16, 511, 4096, 1000), dtype=BF16, **LLAMA3_8B),
    decode_case(tuple(range(5, 5 + 128 * 31, 31)), dtype=F16, **LLAMA2_7B),
    decode_case((1000,), dtype=BF16, **LLAMA3_8B),  # one sequence: the fused rotary and cache write
    decode_case((130,), dtype=BF16, **LLAMA2_7B),
]


@pytest.mark.parametrize("new_kv", [False, True], ids=["cached", "rotated_here"])
@pytest.mark.parametrize("case", DECODE_CASES, ids=str)
def test_paged_decode_matches_reference(case, new_kv):
    check_decode(case, "cuda", pdl=PDL, new_kv=new_kv)


@pytest.mark.parametrize("case", PREFILL_CASES, ids=str)
def test_paged_prefill_matches_reference(case):
    check_prefill(case, "cuda")


@pytest.mark.parametrize("case", BACKEND_CASES, ids=str)
def test_triton_backend_matches_torch_backend(case):
    check_backends_agree(case, "cuda")


@pytest.mark.parametrize("dtype,weight_dtype", [(BF16, BF16), (F16, F16), (BF16, torch.float32)])
def test_rms_norm_matches_reference(dtype, weight_dtype):
    check_rms_norm(1031, 4096, dtype, weight_dtype, "cuda")


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("num_heads,num_kv_heads,block_size", [(32, 32, 16), (32, 8, 32), (9, 3, 16)])
def test_rotary_and_kv_store_match_reference(num_heads, num_kv_heads, block_size, dtype):
    check_rotary_and_store_kv(4099, num_heads, num_kv_heads, 128 if num_heads == 32 else 64, block_size, dtype,
                              "cuda", pdl=PDL)


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("intermediate", [11008, 14336])  # Llama-2-7B's and Llama-3-8B's
def test_silu_and_mul_matches_reference(intermediate, dtype):
    check_silu_and_mul(517, intermediate, dtype, "cuda")


# tiles fixed per row tile: each (dtype, row tile, prologue, epilogue) compiles once, not once per
# autotuning configuration (the engine's tests run the autotuned path)
ONE_ROW, ROWS = {"BLOCK_N": 4, "BLOCK_K": 1024}, {"BLOCK_N": 64, "BLOCK_K": 128}


@pytest.mark.parametrize("n,k,rows,dtype,config", [
    # one row: Llama-2-7B's qkv (also autotuned), o/down widths, LM head, Llama-3-8B's LM head, SmolLM2's
    # qkv and down width
    (12288, 4096, 1, BF16, None), *[(n, k, 1, BF16, ONE_ROW) for n, k in [(12288, 4096), (4096, 11008),
                                                                          (32000, 4096), (128256, 4096),
                                                                          (960, 576), (576, 1536)]],
    (12288, 4096, 1, F16, ONE_ROW), (576, 1536, 1, F16, ONE_ROW),
    # decode batches: tensor-core tiles of 16 to 64 rows
    (12288, 4096, 5, BF16, ROWS), (4096, 11008, 16, BF16, ROWS), (576, 1536, 8, BF16, ROWS),
    (4096, 4096, 40, BF16, ROWS), (12288, 4096, 9, F16, ROWS),
])
def test_projections_of_a_few_tokens_match_reference(n, k, rows, dtype, config):
    """Each projection (plain, norm before, SwiGLU after, residual added) against float64 products, launched
    as the engine launches it on this GPU (programmatic dependent launch on compute capability 9+)."""
    check_gemv(n, k, dtype, "cuda", config=config, rows=rows, pdl=PDL)


def test_a_pinned_tile_is_the_one_a_launch_uses():
    """gemv.pin_tiles' keys are those the autotuner's launch looks up: a projection tuned, its record pinned
    with another configuration into an emptied cache, launches untimed (no key added) and still matches."""
    from bento_pagedllm.kernels import gemv

    x, weight = torch.randn(1, 4096, device="cuda", dtype=BF16), torch.randn(4096, 4096, device="cuda", dtype=BF16)
    expected = gemv.gemv(x, weight, pdl=PDL)
    (key,) = [key for key in gemv.tuned_configs() if key.startswith("(4096, 4096, 1, False, False, False, False")]
    chosen = gemv.tuned_configs()[key]
    other = next(fields for fields in gemv.tile_candidates(key) if fields != chosen)
    saved = dict(gemv._tuned_one_row.cache)
    try:
        gemv._tuned_one_row.cache.clear()
        gemv.pin_tiles({key: other})
        out = gemv.gemv(x, weight, pdl=PDL)
        assert [str(k) for k in gemv._tuned_one_row.cache] == [key] and gemv.tuned_configs()[key] == other
    finally:
        gemv._tuned_one_row.cache.clear()
        gemv._tuned_one_row.cache.update(saved)
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)


def test_the_engines_ops_pin_this_gpus_measured_tiles():
    """TritonOps built for this GPU with its measured table (EngineArgs.measured_tiles) leave each of the
    table's keys pinned in the one-row autotuner (none where the package has no table for the GPU)."""
    from bento_pagedllm.kernels import gemv
    from bento_pagedllm.models.ops import ops_for

    table = gemv.measured_tiles(torch.cuda.get_device_name())
    ops_for(torch.device("cuda"), dependent_launch=PDL, measured_tiles=True)
    tuned = gemv.tuned_configs()
    assert {key: tuned.get(key) for key in table} == table


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("rows,vocab", [(1, 32000), (7, 128256), (64, 49152)])  # the three shapes' vocabularies
def test_argmax_picks_the_first_maximum_like_torch(rows, vocab, dtype):
    check_argmax(rows, vocab, dtype, "cuda")


@pytest.mark.parametrize("n", [1, 512, 16384])
def test_pending_input_ids_come_from_the_sampled_rows(n):
    check_fill_pending_ids(n, "cuda")


def _compiled_variants(kernel) -> int:
    return len(kernel.device_caches[torch.cuda.current_device()][0])


def test_a_steps_id_count_compiles_no_new_pending_fill_variant():
    """The pending-ids fill, whose id count is the step's size, compiles once per block size whatever the
    count: Triton specialises integers divisible by 16, and a second variant compiled inside a served step
    (0.4 s on a cold H200 for the SwiGLU GEMM below, 2026-12-02)."""
    from bento_pagedllm.kernels import tokens

    sampled = torch.arange(8, device="cuda")
    for n in (1008, 600, 700):  # one BLOCK (1,024); 1,008 divisible by 16, the others not
        tokens.fill_pending_ids(torch.zeros(n, dtype=torch.int64, device="cuda"),
                                torch.zeros(n, dtype=torch.int64, device="cuda"), sampled)
        if n == 1008:
            variants = _compiled_variants(tokens._fill_pending_kernel)
    assert _compiled_variants(tokens._fill_pending_kernel) == variants


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="the tensor-memory accelerator needs compute capability 9+")
def test_a_steps_token_count_compiles_no_new_swiglu_gemm_variant():
    """The eager path's SwiGLU GEMM, whose row count is the step's size, compiles once whatever the count
    (see the test above)."""
    from bento_pagedllm.kernels import swiglu_gemm as sg

    weight = sg.interleave_gate_up(torch.randn(2 * 1024, 512, device="cuda", dtype=BF16), sg.INTERLEAVE)
    for rows in (4096, 4100, 4113):
        sg.swiglu_gemm(torch.randn(rows, 512, device="cuda", dtype=BF16), weight, sg.INTERLEAVE)
        if rows == 4096:
            variants = _compiled_variants(sg._swiglu_gemm_kernel)
    assert _compiled_variants(sg._swiglu_gemm_kernel) == variants


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="the tensor-memory accelerator needs compute capability 9+")
@pytest.mark.parametrize("rows,inter,hidden", [(4096, 1024, 4096), (5000, 14336, 4096), (300, 14336, 4096)])  # ragged rows; 8B's MLP
def test_swiglu_gemm_matches_the_unfused_path(rows, inter, hidden):
    """kernels/swiglu_gemm.py in bfloat16 against cuBLAS then the SiLU kernel on the plain layout: the
    products differ only in summation order (float32 both), then both round as the model does, so a gate
    or up value may round an ulp apart (2^-8 relative): bf16's budget of torch.testing, plus 2e-2 for an
    output near zero whose |up| or |gate| (N(0, 1) here) is up to ~4; and the fused projections read the
    interleaved layout to the same bits as the plain one."""
    from bento_pagedllm.kernels.gemv import add_rms_norm_gemv
    from bento_pagedllm.kernels.swiglu_gemm import INTERLEAVE, interleave_gate_up, swiglu_gemm, swiglu_gemm_ref

    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, hidden, device="cuda", dtype=BF16, generator=generator)
    gate_up = torch.randn(2 * inter, hidden, device="cuda", dtype=BF16, generator=generator) * hidden**-0.5
    interleaved = interleave_gate_up(gate_up, INTERLEAVE)
    got, want = swiglu_gemm(x, interleaved, INTERLEAVE).float(), swiglu_gemm_ref(x, interleaved, INTERLEAVE).float()
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=2e-2)
    norm_weight = torch.ones(hidden, device="cuda", dtype=BF16)
    for m, config in ((1, ONE_ROW), (16, ROWS)):
        plain, _ = add_rms_norm_gemv(x[:m], None, norm_weight, 1e-5, gate_up, swiglu=True, config=config)
        mixed, _ = add_rms_norm_gemv(x[:m], None, norm_weight, 1e-5, interleaved, swiglu=True, config=config,
                                     interleave=INTERLEAVE)
        assert torch.equal(mixed, plain)
