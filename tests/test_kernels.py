"""Every Triton kernel against its torch reference, on whatever this machine has.

Without CUDA the kernels run under Triton's interpreter (numpy, one program at a time), so the shapes
are small (2 KV heads, head_dim 64) and only a handful of cases have long contexts; float32 and float16
only, as the interpreter gets bfloat16 wrong. tests/gpu/test_kernels_gpu.py runs the same checks at
model sizes in bfloat16 on a GPU.
"""


import pytest
import torch
from kernel_cases import (  # NOTE: conftest.py sets TRITON_INTERPRET=1 first when there is no CUDA
    attention_cases,
    check_argmax,
    check_backends_agree,
    check_decode,
    check_fill_pending_ids,
    check_gemv,
    check_model_with_fused_projections,
    check_model_with_interleaved_gate_up,
    check_padded_mixed_step,
    check_prefill,
    check_rms_norm,
    check_rotary_and_store_kv,
    check_silu_and_mul,
    decode_case,
    prefill_case,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F32, F16 = torch.float32, torch.float16

# (seq_lens, q_lens): ragged decode batches; 16, 32 and 64 sit exactly on block (and tile) boundaries
DECODE_LENS = [
    ((1, 16, 33, 64, 97), (1,) * 5),
    ((32, 5, 130, 17), (1,) * 4),
    ((64, 2, 48), (1,) * 3),
]
# mixed steps: whole prompts, decodes, chunks after a cached prefix (prefix = seq_len - q_len)
PREFILL_LENS = [
    ((50, 1, 140, 20), (50, 1, 40, 3)),
    ((16, 96, 33), (16, 32, 1)),
    ((7, 64, 81), (7, 17, 81)),
]

DECODE_CASES = attention_cases((F32, F16), (1, 4, 8), (16, 32), DECODE_LENS) + [
    decode_case((1, 100, 300), num_splits=3),  # splits that are empty for the short sequences
    decode_case((1, 100, 300), num_splits=1, group=1, dtype=F16),
    decode_case((40, 200), head_dim=128, dtype=F16),
    decode_case((90,), head_dim=32, group=2, num_kv_heads=1),
    decode_case((20, 65), group=3, dtype=F16),  # a group that is not a power of two (Qwen-like)
    decode_case((4096,), dtype=F16, num_kv_heads=1),  # long: the automatic split count
    decode_case((3000, 37), group=1, block_size=32, num_kv_heads=1),
]
PREFILL_CASES = attention_cases((F32, F16), (1, 4, 8), (16, 32), PREFILL_LENS) + [
    prefill_case((40, 200), (40, 20), head_dim=128, dtype=F16),
    prefill_case((23, 70, 5), (23, 6, 1), group=3),  # BLOCK_M rows are not a whole number of groups
    prefill_case((2000, 1), (48, 1), dtype=F16, num_kv_heads=1),  # long: a chunk after a long prefix
    prefill_case((300,), (300,), group=1, block_size=32, num_kv_heads=1),  # a whole prompt
]
BACKEND_CASES = [
    prefill_case((50, 1, 140, 20, 33), (50, 1, 40, 3, 1), dtype=F32),  # mixed: the prefill kernel
    prefill_case((61, 7, 130), (9, 7, 1), group=8, num_kv_heads=1, block_size=32, dtype=F16),
    decode_case((1, 16, 33, 300), dtype=F32),  # all decodes: the decode kernel
    decode_case((64, 5), group=1, dtype=F16),
    decode_case((300,), dtype=F32),  # one sequence: the decode kernel rotates and stores itself
    decode_case((37,), group=1, dtype=F16, block_size=32),
]


def test_kernels_run_under_the_interpreter_without_cuda():
    """Guards the import order above: compiled kernels would fail on CPU tensors anyway, but say why."""
    if DEVICE == "cuda":
        pytest.skip("CUDA present: the kernels are compiled")
    from triton.runtime.interpreter import InterpretedFunction

    from bento_pagedllm.kernels import paged_decode

    assert isinstance(paged_decode._decode_split_kernel, InterpretedFunction)


@pytest.mark.parametrize("new_kv", [False, True], ids=["cached", "rotated_here"])
@pytest.mark.parametrize("case", DECODE_CASES, ids=str)
def test_paged_decode_matches_reference(case, new_kv):
    check_decode(case, DEVICE, new_kv=new_kv)


@pytest.mark.parametrize("case", PREFILL_CASES, ids=str)
def test_paged_prefill_matches_reference(case):
    check_prefill(case, DEVICE)


@pytest.mark.parametrize("case,num_tokens,num_slots", [
    (prefill_case((50, 1, 140, 20, 33), (50, 1, 40, 3, 1)), 96, 9),  # 95 real tokens: one of padding
    (prefill_case((61, 7, 130), (9, 7, 1), group=8, num_kv_heads=1, block_size=32, dtype=F16), 64, 4),
    (prefill_case((5, 9), (1, 1)), 32, 3),  # decodes only, no spare slot
    (prefill_case((30,), (30,)), 32, 2),  # a whole prompt and 2 padding tokens
])
def test_a_padded_mixed_step_gives_the_same_attention(case, num_tokens, num_slots):
    check_padded_mixed_step(case, DEVICE, num_tokens, num_slots)


@pytest.mark.parametrize("case", BACKEND_CASES, ids=str)
def test_triton_backend_matches_torch_backend(case):
    check_backends_agree(case, DEVICE)


@pytest.mark.parametrize("dtype,weight_dtype", [(F32, F32), (F16, F16), (F16, F32)])
@pytest.mark.parametrize("hidden", [64, 576])  # 576: SmolLM2's width, not a power of two
def test_rms_norm_matches_reference(hidden, dtype, weight_dtype):
    check_rms_norm(9, hidden, dtype, weight_dtype, DEVICE)


@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [(4, 1, 64, 16), (3, 3, 32, 32)])
def test_rotary_and_kv_store_match_reference(num_heads, num_kv_heads, head_dim, block_size, dtype):
    check_rotary_and_store_kv(37, num_heads, num_kv_heads, head_dim, block_size, dtype, DEVICE)


@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("intermediate", [96, 1536])  # 1536: SmolLM2's, two column blocks
def test_silu_and_mul_matches_reference(intermediate, dtype):
    check_silu_and_mul(5, intermediate, dtype, DEVICE)


@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("rows,vocab", [(3, 100), (4, 9000), (2, 70000)])  # 9000: two tiles a row; 70000: chunks
def test_argmax_picks_the_first_maximum_like_torch(rows, vocab, dtype):
    check_argmax(rows, vocab, dtype, DEVICE)


@pytest.mark.parametrize("n", [1, 5, 40, 2500])  # 2500: three programs of 1,024
def test_pending_input_ids_come_from_the_sampled_rows(n):
    check_fill_pending_ids(n, DEVICE)


def test_the_pending_ids_fill_runs_at_start_up_at_every_block_size_a_step_may_take(monkeypatch):
    """compile_fill_pending_ids (the model runner's start-up on CUDA): one call at each block size that a
    step of at most max_ids tokens takes, none larger than max_ids, and it fills nothing."""
    from bento_pagedllm.kernels import tokens

    real = tokens.fill_pending_ids
    for max_ids in (1, 300, 512, 16384):
        seen = []

        def recording(ids, src, sampled):
            seen.append(ids.shape[0])
            real(ids, src, sampled)
            assert not ids.any()  # every source is -1: nothing pending

        monkeypatch.setattr(tokens, "fill_pending_ids", recording)
        tokens.compile_fill_pending_ids(max_ids, torch.arange(1, 9, device=DEVICE))
        assert max(seen) <= max_ids and len(seen) == len(set(map(tokens.fill_block, seen)))
        assert set(map(tokens.fill_block, seen)) == {tokens.fill_block(n) for n in range(1, max_ids + 1)}


@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("n,k,config,rows", [
    (37, 100, None, 1),  # neither size a multiple of a tile
    (64, 576, {"BLOCK_N": 8, "BLOCK_K": 128}, 1),  # SmolLM2's width
    (9, 130, {"BLOCK_N": 2, "BLOCK_K": 32}, 1),
    (37, 100, None, 3),  # a few rows: the tensor-core tile of 16, rows and columns ragged
    (40, 130, {"BLOCK_N": 16, "BLOCK_K": 64}, 16),
    (24, 96, {"BLOCK_N": 16, "BLOCK_K": 32}, 21),  # a tile of 32
    (20, 40, {"BLOCK_N": 16, "BLOCK_K": 32}, 64),  # a tile of 64
])
def test_projections_of_a_few_tokens_match_reference(n, k, config, rows, dtype):
    check_gemv(n, k, dtype, DEVICE, config, rows)


@pytest.mark.parametrize("num_seqs", [1, 3])
def test_a_model_step_with_fused_projections_matches_the_unfused_one(num_seqs):
    check_model_with_fused_projections(DEVICE, F16, num_seqs)


@pytest.mark.parametrize("num_seqs", [1, 3])
def test_a_model_step_reads_interleaved_gate_up_rows_on_every_path(num_seqs):
    check_model_with_interleaved_gate_up(DEVICE, F16, num_seqs)


def test_interleaved_gate_up_rows_give_the_same_activations():
    """kernels/swiglu_gemm.py's layout: the SiLU kernel and the fused projection read it to the same bits
    as the plain layout; the SwiGLU GEMM matches the model's unfused path on the plain weights."""
    from bento_pagedllm.kernels.activation import silu_and_mul
    from bento_pagedllm.kernels.gemv import add_rms_norm_gemv
    from bento_pagedllm.kernels.swiglu_gemm import (deinterleave_gate_up, interleave_gate_up, swiglu_gemm,
                                                   swiglu_gemm_ref)

    block, inter, hidden = 16, 48, 64
    gate_up = torch.randn(2 * inter, hidden, dtype=F16) / hidden**0.5
    interleaved = interleave_gate_up(gate_up, block)
    assert torch.equal(deinterleave_gate_up(interleaved, block), gate_up)
    assert torch.equal(interleaved[block : 2 * block], gate_up[inter : inter + block])  # the first up block
    products = torch.randn(5, 2 * inter, dtype=F16)
    as_interleaved = interleave_gate_up(products.T.contiguous(), block).T.contiguous()
    assert torch.equal(silu_and_mul(as_interleaved, interleave=block), silu_and_mul(products))
    norm_weight = torch.randn(hidden, dtype=F16)
    for rows, config in ((1, {"BLOCK_N": 4, "BLOCK_K": 32}), (5, {"BLOCK_N": 16, "BLOCK_K": 32})):
        x = torch.randn(rows, hidden, dtype=F16)
        plain, _ = add_rms_norm_gemv(x, None, norm_weight, 1e-5, gate_up, swiglu=True, config=config)
        mixed, _ = add_rms_norm_gemv(x, None, norm_weight, 1e-5, interleaved, swiglu=True, config=config,
                                     interleave=block)
        assert torch.equal(mixed, plain)
    x = torch.randn(37, hidden, dtype=F16)
    torch.testing.assert_close(swiglu_gemm(x, interleaved, block, config=(32, 32, 2, 4)),
                               swiglu_gemm_ref(x, interleaved, block), atol=2e-3, rtol=2e-3)


def test_the_row_tiles_the_engine_tunes_at_start_up():
    """ModelRunner runs the LM head once per row tile at start-up (it runs outside the graphs, on any
    number of logit rows): one count per tile kernels/gemv.py may pick up to `fused_gemv_rows`."""
    from bento_pagedllm.models.ops import TorchOps, TritonOps

    assert TritonOps(0).row_counts_to_tune() == ()
    assert TritonOps(1).row_counts_to_tune() == (1,)
    assert TritonOps(16).row_counts_to_tune() == (1, 16)
    assert TritonOps(64).row_counts_to_tune() == (1, 16, 32, 64)
    assert TorchOps().row_counts_to_tune() == ()
    with pytest.raises(ValueError):
        TritonOps(65)


def test_dependent_launch_is_taken_only_where_the_gpu_has_it():
    """Programmatic dependent launch needs compute capability 9+: never on the CPU (the interpreter cannot
    run its instructions), and the setting reaches the engine's configs; so does `measured_tiles` (the
    CPU has no tiles)."""
    from bento_pagedllm.config import EngineArgs, ModelConfig
    from bento_pagedllm.models.ops import TorchOps, TritonOps, ops_for, supports_dependent_launch

    cpu = torch.device("cpu")
    assert not supports_dependent_launch(cpu)
    assert isinstance(ops_for(cpu, dependent_launch=True), TorchOps)
    assert isinstance(ops_for(cpu, measured_tiles=True), TorchOps)
    assert TritonOps().pdl is False and TritonOps(16, dependent_launch=True).pdl is True
    tiny = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1)
    for setting in (True, False):
        args = EngineArgs(model="unused", device="cpu", dependent_launch=setting, measured_tiles=setting)
        configs = args.create_configs(tiny, "unused")
        assert configs.dependent_launch is setting and configs.measured_tiles is setting


def test_the_decode_split_count_stays_within_its_limits():
    """choose_num_splits: one sequence gets a power of two, one split once its programs fill two waves, at
    least two from 256 tokens on, no more than the context has ~96-token pieces; a batch gets one split from
    7 (sequence, KV head) pairs a multiprocessor, 2 from 3, 4 from 1, no more than it has 64-token pieces
    (132 multiprocessors on the CPU, an H200's count)."""
    from bento_pagedllm.kernels.paged_decode import MAX_SPLITS, choose_num_splits

    cpu = torch.device("cpu")
    for heads, kv_heads in ((32, 32), (32, 8), (9, 3)):
        for seqs in (1, 2, 5, 8, 16, 33, 64, 300):
            for context in (1, 64, 200, 256, 384, 1024, 4096, 32768):
                splits = choose_num_splits(context, seqs, heads, kv_heads, cpu)
                pairs = seqs * kv_heads
                assert 1 <= splits <= MAX_SPLITS
                if seqs == 1:
                    assert splits & (splits - 1) == 0 and (context < 256 or splits >= 2)
                    assert splits == 1 or splits * 96 <= max(context, 192)
                else:
                    assert splits * 64 < context + 64
                    if pairs >= 7 * 132:
                        assert splits == 1
                    elif pairs >= 132:
                        assert splits == min(2 if pairs >= 3 * 132 else 4, -(-context // 64))
    assert choose_num_splits(4096, 1, 32, 8, cpu) == 16 and choose_num_splits(1024, 8, 32, 8, cpu) == 9


def test_the_packaged_tile_tables_name_one_row_keys_and_tiles_compiled_ahead():
    """Each GPU's measured table (kernels/tiles/, bench/tile_search.py) pins one-row tuning keys only (the
    search times single-stream steps), each to a configuration the autotuner offers that key, so the
    projection's first call compiles it ahead with the rest; a GPU without a table gets none."""
    import json

    from bento_pagedllm.kernels import gemv

    tables = sorted(gemv.TILE_TABLES.glob("*.json"))
    assert tables and gemv.measured_tiles("NVIDIA H100 80GB HBM3") and gemv.measured_tiles("A GPU of 2040") == {}
    for path in tables:
        gpu = json.loads(path.read_text())["gpu"]
        assert gemv.measured_tiles(gpu) == json.loads(path.read_text())["table"]
        for text, fields in gemv.measured_tiles(gpu).items():
            assert gemv.tuning_flags(text)["BLOCK_M"] == 1, text
            assert fields in gemv.tile_candidates(text), text


def test_pinned_tiles_round_trip_a_recorded_choice(monkeypatch):
    """gemv.pin_tiles puts an earlier process's `tuned_configs()` record (JSON-ready) back into the autotuner
    of each key's row tile, where its launch looks the key up before timing anything: the record round-trips
    exactly. (tests/gpu: the keys are those a launch looks up.)"""
    import json

    from bento_pagedllm.kernels import gemv

    monkeypatch.setattr(gemv, "_tuned_one_row", gemv._autotuned(gemv._row_configs()))
    monkeypatch.setattr(gemv, "_tuned_rows", gemv._autotuned(gemv._tile_configs()))
    dtypes = ("torch.bfloat16",) * 7
    one_row = (4096, 11008, 1, False, False, False, True, True, 0, *dtypes)  # down: residual added, PDL
    tile = (4096, 4096, 16, False, True, False, False, True, 0, *dtypes)  # 16 rows with the norm
    table = {str(one_row): {"BLOCK_N": 2, "BLOCK_K": 1024, "num_warps": 4, "num_stages": 3},
             str(tile): {"BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 4, "num_stages": 4}}
    gemv.pin_tiles(json.loads(json.dumps(table)))
    assert list(gemv._tuned_one_row.cache) == [one_row] and list(gemv._tuned_rows.cache) == [tile]
    assert gemv.tuned_configs() == table
    # a key's candidates are the configurations its tile offers it (a plain one-row projection: no 32-row blocks)
    assert gemv.tuning_flags(str(one_row))["BLOCK_M"] == 1 and table[str(one_row)] in gemv.tile_candidates(str(one_row))
    assert max(fields["BLOCK_N"] for fields in gemv.tile_candidates(str(one_row))) < 32
    assert table[str(tile)] in gemv.tile_candidates(str(tile))
    with pytest.raises(AssertionError):
        gemv.pin_tiles({"(4096, 4096)": table[str(tile)]})  # not a tuning key


def test_a_projection_compiles_every_row_tile_it_will_use_at_its_first_call(monkeypatch):
    """gemv's autotuned path: the first call of a projection compiles, in threads, every configuration of
    every row tile its caller names (`row_tiles`), each with the call's arguments and exactly the flags and
    options the autotuner's later launch of that tile passes (the key it looks up); later calls compile
    nothing; only the kernel's first compile on a device runs alone."""
    import threading

    from bento_pagedllm.kernels import gemv

    warmups, launches, lock = [], [], threading.Lock()

    class Kernel:
        def warmup(self, *args, grid, **kwargs):
            with lock:
                warmups.append((threading.get_ident(), args[7:], grid, kwargs))  # args[7:]: M, N, K, stride, eps

    class Tuned:
        def __init__(self, configs):
            self.configs = configs

        def __getitem__(self, grid):
            return lambda *args, **flags: launches.append(flags)

    monkeypatch.setattr(gemv, "INTERPRETER_CONFIGS", None)
    monkeypatch.setattr(gemv, "_gemv_kernel", Kernel())
    monkeypatch.setattr(gemv, "_tuned_one_row", Tuned(gemv._row_configs()))
    monkeypatch.setattr(gemv, "_tuned_rows", Tuned(gemv._tile_configs()))
    monkeypatch.setattr(gemv, "_compiled_ahead", set())
    monkeypatch.setattr(gemv, "_kernels_set_up", set())
    hidden, inter = 576, 96
    norm_weight, gate_up = torch.ones(hidden), torch.randn(2 * inter, hidden)
    for rows in (1, 5, 20, 3):
        gemv.add_rms_norm_gemv(torch.randn(rows, hidden), None, norm_weight, 1e-5, gate_up, swiglu=True, pdl=True,
                               row_tiles=(1, 16, 32))
        if rows == 1:  # everything compiled at the first call, with its arguments (M = 1)
            assert {args for _, args, _, _ in warmups} == {(1, inter, hidden, hidden, 1e-5)}
            assert {grid for _, _, grid, _ in warmups} == {(1,)}
    row_configs = gemv._prune(gemv._row_configs(), {"K": hidden}, BLOCK_M=1, RMS_NORM=True)
    # a plain one-row projection (o, down) is offered no blocks of 32 rows of W; one with a norm is
    plain_rows = gemv._prune(gemv._row_configs(), {"K": hidden}, BLOCK_M=1)
    assert max(c.kwargs["BLOCK_N"] for c in plain_rows) < 32 <= max(c.kwargs["BLOCK_N"] for c in row_configs)
    tile_configs = {m: gemv._prune(gemv._tile_configs(), {"K": hidden}, BLOCK_M=m) for m in (16, 32)}
    assert len(tile_configs[32]) < len(tile_configs[16])  # the 32-row tile tries fewer (TILE_32_SHAPES)
    # NOTE: 32 x 256 in 4 warps and 4 stages and 32 x 512 in 4 warps and 3 stages, never best in-graph, cost
    # small decode steps 0.1-0.2 ms where the autotuner picked them (gemv._tile_configs): offered to no row tile
    assert not [c for m in (16, 32) for c in tile_configs[m]
                if (c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps, c.num_stages) in {(32, 256, 4, 4),
                                                                                             (32, 512, 4, 3)}]
    # a tile keeps no row blocks that leave fewer than MIN_TILE_PROGRAMS programs, where others remain (o of
    # Llama-3-8B: N = 4,096, so no 128-row blocks); a small projection (N = 576) keeps every tile
    for m in (16, 32):
        o_tiles = gemv._prune(gemv._tile_configs(), {"K": 4096, "N": 4096}, BLOCK_M=m)
        assert o_tiles and max(c.kwargs["BLOCK_N"] for c in o_tiles) <= 4096 // gemv.MIN_TILE_PROGRAMS
        assert max(c.kwargs["BLOCK_N"] for c in gemv._prune(gemv._tile_configs(), {"K": 4096, "N": 14336},
                                                             BLOCK_M=m)) == 128
        assert gemv._prune(gemv._tile_configs(), {"K": hidden, "N": inter}, BLOCK_M=m) == tile_configs[m]
    assert len(warmups) == len(row_configs) + len(tile_configs[16]) + len(tile_configs[32])  # each once
    # each launch's flags are those its tile's configurations were compiled with
    assert [flags["BLOCK_M"] for flags in launches] == [1, 16, 32, 16]
    for flags in launches:
        configs = row_configs if flags["BLOCK_M"] == 1 else tile_configs[flags["BLOCK_M"]]
        compiled = sorted(str(kwargs) for _, _, _, kwargs in warmups if kwargs["BLOCK_M"] == flags["BLOCK_M"])
        assert compiled == sorted(str({**flags, **c.all_kwargs()}) for c in configs)
    assert all(flags["launch_pdl"] and flags["USE_PDL"] for flags in launches)  # every tile a dependent launch
    main = threading.get_ident()
    assert warmups[0][0] == main  # NOTE: the first compile alone, on the caller's thread
    # a second projection: no compile alone any more (the kernel's device cache exists)
    warmups.clear()
    gemv.gemv(torch.randn(1, hidden), torch.randn(64, hidden), pdl=True, row_tiles=(1, 16))
    assert len(warmups) == len(plain_rows) + len(tile_configs[16])  # a plain projection: plain_rows
    assert all(thread != main for thread, _, _, _ in warmups)
