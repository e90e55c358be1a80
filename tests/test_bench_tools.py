"""Pure-Python parts of the GPU benchmarks, checked on the CPU: the offline workload's tail batches
(bench/decode_attention.py --ragged) and the host's clock of the offline loop (bench/serve.py)."""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import sys
import time

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def _load(name: str):
    """A bench script by path (bench/ is not a package), with bench/ on sys.path as when it runs as a script
    (its imports of the other scripts), leaving sys.path as it was."""
    saved = list(sys.path)
    try:
        sys.path.insert(0, BENCH)
        spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(BENCH, f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
    return module


def test_the_tail_batch_is_the_first_step_with_at_most_n_requests_left(tmp_path):
    decode_attention = _load("decode_attention")
    path = tmp_path / "requests.jsonl"
    # prompts of 10, 20, 30, 40 tokens generating 1, 5, 5, 9 tokens
    path.write_text("".join(json.dumps({"prompt_ids": [0] * p, "max_tokens": m}) + "\n"
                            for p, m in [(10, 1), (20, 5), (30, 5), (40, 9)]))
    # at step 0 all four decode; from step 1 three are left: contexts = prompt + step + 1 (the new token)
    assert decode_attention.tail_lengths(str(path), 3) == [22, 32, 42]
    assert decode_attention.tail_lengths(str(path), 1) == [46]  # from step 5 only the 9-token one
    assert decode_attention.tail_lengths(str(path), 4) == [11, 21, 31, 41]


def test_the_host_clock_orders_its_longest_iterations_and_counts_collections():
    serve = _load("serve")
    clock = serve.HostClock()
    with clock:
        for ms in (1.0, 5.0, 2.0):
            clock.iterations_ms.append(ms)
        gc.collect()
    gc.collect()  # outside the clock: not counted
    summary = clock.summary(count=2)
    assert summary["iterations"] == 3 and summary["median_ms"] == 2.0
    assert summary["longest"] == [{"step": 1, "ms": 5.0}, {"step": 2, "ms": 2.0}]
    assert summary["gc_collections"][2] == 1 and summary["gc_longest_ms"] >= 0


class _Cyclic:
    """An object in a reference cycle with itself: only the collector frees it."""

    def __init__(self):
        self.me = self


def _cyclic_closure() -> None:
    """Makes a closure that refers to itself (function -> cell -> function) and drops it."""
    def closure():
        return closure


def test_the_host_clock_names_what_each_collection_traverses_and_the_cyclic_garbage_with_gc_debug():
    serve = _load("serve")
    clock = serve.HostClock(gc_debug=True)
    flags = gc.get_debug()
    gc.collect(0)  # NOTE: an empty young generation: no automatic pass inside the clock
    with clock:
        clock.iterations_ms += [1.0, 2.0]
        for _ in range(3):
            _Cyclic()
        _cyclic_closure()
        looped = ([],)
        looped[0].append(looped)  # a tuple in a cycle through its list
        del looped
        gc.collect(0)
    assert gc.get_debug() == flags and gc.garbage == []  # the collector's flags and list are as they were
    summary = clock.summary()
    name = f"{__name__}._Cyclic"
    (collection,) = summary["gc_passes"]
    assert collection["step"] == 2 and collection["generation"] == 0 and collection["ms"] >= 0
    assert collection["types"][name] == 3 and collection["objects"] >= 3 and collection["collected"] >= 3
    assert summary["gc_garbage"]["types"][name] == 3
    (site, count), = summary["gc_garbage"]["functions"].items()
    assert site.endswith("_cyclic_closure.<locals>.closure") and count == 1
    assert "([(...)],)" in summary["gc_garbage"]["tuples"]  # (with the closure's tuple of cells)
    assert summary["gc_garbage"]["tuple_shapes"] == {"(list)": 1, "(cell)": 1}
    assert "gc_passes" not in serve.HostClock().summary()  # off by default


def test_the_host_clock_times_watched_methods_per_iteration():
    serve = _load("serve")

    class Part:
        def work(self, seconds):
            time.sleep(seconds)
            return seconds

    part = Part()
    clock = serve.HostClock()
    clock.watch(part, "work", "phase")
    for seconds in (0.001, 0.03, 0.002):
        started = time.perf_counter()
        assert part.work(seconds) == seconds  # the wrapper returns what the method returns
        clock.iteration(started)
    assert Part.work is not part.work  # wrapped on the instance alone
    with clock:
        pass
    assert "work" not in vars(part)  # leaving the clock undoes the watch
    summary = clock.summary(count=1)
    slowest = summary["longest"][0]
    assert slowest["step"] == 1 and 30 <= slowest["phases_ms"]["phase"] <= slowest["ms"]
    assert 2 <= summary["median_phases_ms"]["phase"] < 30
    assert summary["reserved_changes"] == []  # no CUDA here: nothing reserved


def test_a_traced_step_is_split_into_what_each_kernel_adds():
    """Two layers whose kernels overlap (dependent launch): each kernel adds the time from the end of the
    one before it; the LM head and the time around the model come out too; a step of another shape is
    skipped."""
    trace_steps = _load("trace_steps")
    events, t = [], 0.0

    def kernel(name, start, dur):
        events.append({"ph": "X", "cat": "kernel", "name": name, "ts": start, "dur": dur})

    for _ in range(2):  # two fused steps, then one prefill step (more kernels)
        kernel("Memcpy HtoD", t + 2, 1)
        end = t + 10
        for _ in range(2):
            for name, adds in zip(("_gemv_kernel", "_decode_split_kernel", "_gemv_kernel", "_gemv_kernel",
                                   "_gemv_kernel"), (20, 5, 8, 40, 21)):
                kernel(name, end - 3, adds + 3)  # starts 3 us before the kernel ahead of it ends
                end += adds
        kernel("_gemv_kernel", end - 2, 62)  # the LM head
        kernel("_argmax_kernel", end + 61, 5)
        t = end + 66
    kernel("_gemv_kernel", t + 1, 5)
    kernel("_argmax_kernel", t + 7, 1)
    result = trace_steps.step_breakdown(trace_steps.device_events({"traceEvents": events}), num_layers=2)
    assert result["steps"] == 1  # the first step has no step end before it
    assert result["layer_us"] == {"qkv": 20, "attention": 5, "o": 8, "gate_up": 40, "down": 21}
    assert result["a_layer_us"] == 94 and result["lm_head_us"] == 60
    assert result["before_us"] == 10 - 3 - 0 and result["after_us"] == 6


def test_any_decode_path_is_read_by_position_in_a_layer():
    """The unfused path of bigger batches (separate norm, activation and rotary kernels), four layers a
    step: each position of a middle layer gives its kernel and what it adds; the kernels before the first
    attention and from the last one on are listed apart; a prefill step (no decode attention) is skipped."""
    trace_steps = _load("trace_steps")
    events, t = [], 0.0

    def kernel(name, start, dur):
        events.append({"ph": "X", "cat": "kernel", "name": name, "ts": start, "dur": dur})

    layer = (("_decode_split_kernel", 20), ("nvjet_sm90_o", 10), ("_rms_norm_kernel", 2), ("nvjet_sm90_gu", 50),
             ("_silu_and_mul_kernel", 2), ("nvjet_sm90_down", 30), ("_rms_norm_kernel", 2), ("nvjet_sm90_qkv", 15),
             ("_rotary_store_kv_kernel", 3))
    for _ in range(3):  # the first step has no step end before it: two are read
        end = t + 1
        for name, adds in (("Memcpy HtoD", 3), ("_rms_norm_kernel", 2), ("nvjet_sm90_qkv", 15),
                           ("_rotary_store_kv_kernel", 3)) + layer * 4:
            kernel(name, end + 1, adds - 1)  # an idle microsecond before each
            end += adds
        kernel("_argmax_kernel", end + 1, 4)
        t = end + 5
    kernel("nvjet_sm90_prefill", t + 1, 5)
    kernel("_argmax_kernel", t + 7, 1)
    result = trace_steps.position_breakdown(trace_steps.device_events({"traceEvents": events}), num_layers=4)
    assert result["steps"] == 2 and result["layers_read"] == 2 * 2 and result["layers_of_other_shapes"] == 0
    assert [(k["kernel"], k["added_us"], k["duration_us"]) for k in result["layer"]] == [
        ("_decode_split_kernel", 20, 19), ("cublas", 10, 9), ("_rms_norm_kernel", 2, 1), ("cublas", 50, 49),
        ("_silu_and_mul_kernel", 2, 1), ("cublas", 30, 29), ("_rms_norm_kernel", 2, 1), ("cublas", 15, 14),
        ("_rotary_store_kv_kernel", 3, 2)]
    assert result["a_layer_us"] == 134
    assert [k["kernel"] for k in result["before_layers"]] == [
        "Memcpy HtoD", "_rms_norm_kernel", "cublas", "_rotary_store_kv_kernel"]
    assert result["last_layer_and_after"][0]["kernel"] == "_decode_split_kernel"
    assert result["last_layer_and_after"][-1]["kernel"] == "_argmax_kernel"


def test_prefill_steps_pack_prompts_in_order_and_chunk_the_one_that_does_not_fit():
    prefill_attention = _load("prefill_attention")
    # budget 10: 4 + the first 6 of 8; then its last 2 (after a 6-token prefix) + 5 + the first 3 of 7; ...
    assert prefill_attention.prefill_steps([4, 8, 5, 7], 10) == [
        [(0, 4), (0, 6)], [(6, 2), (0, 5), (0, 3)], [(3, 4)]]
    assert prefill_attention.prefill_steps([10], 10) == [[(0, 10)]]
    # causal pairs: 3 new tokens after a prefix of 2 see 2 + 1, 2 + 2, 2 + 3 keys = 12
    assert prefill_attention.causal_flops([(2, 3)], num_heads=1) == 4.0 * 12 * 128


def test_the_offline_benchmark_runs_end_to_end_on_the_cpu(tmp_path, monkeypatch):
    """bench/serve.py --mode offline as the GPU session runs it (its host clock wraps the engine's methods
    by name: a renamed one fails here, not in a GPU call), on SmolLM2's shape with random weights."""
    serve = _load("serve")
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps({"id": i, "prompt_ids": list(range(10, 10 + p)), "max_tokens": m}) + "\n"
                                for i, (p, m) in enumerate([(12, 3), (5, 4), (20, 2)])))
    out = tmp_path / "result.json"
    monkeypatch.setattr(sys, "argv", ["serve.py", "--mode", "offline", "--shape", "smollm2-135m", "--requests",
                                      str(requests), "--device", "cpu", "--out", str(out)])
    monkeypatch.syspath_prepend(BENCH)  # shape_dir imports single_stream
    import bento_pagedllm.model_runner

    sample = bento_pagedllm.model_runner.sample
    serve.main()
    assert bento_pagedllm.model_runner.sample is sample  # the clock's watch (on the CPU) is undone
    result = json.loads(out.read_text())
    assert result["completed"] == 3 and result["failed"] == 0
    assert result["output_throughput"] * result["duration_s"] == pytest.approx(9)
    assert set(result["host"]["median_phases_ms"]) >= {"schedule", "prepare", "launch", "device_inputs"}


def test_the_read_ceilings_kernel_sums_every_chunk_it_is_timed_on(monkeypatch):
    """bench/read_ceiling.py's read-only stream (under Triton's interpreter here): per chunk or walking the
    chunks, with 1, 2 or 4 tiles in flight, its sums cover the whole buffer (the bench asserts as much)."""
    import torch

    read_ceiling = _load("read_ceiling")
    monkeypatch.setattr(read_ceiling, "_seconds", lambda fn: (fn(), 1.0)[1])
    x = torch.rand(1 << 14, dtype=torch.float16)
    expected = x.sum(dtype=torch.float32).item()
    for chunk, block, unroll, programs in [(2048, 512, 1, 0), (2048, 256, 2, 3), (4096, 256, 4, 5)]:
        row = read_ceiling.triton_read(x, expected, chunk, block, unroll, 4, programs)
        assert row["read_tbs"] == x.numel() * 2 / 1e12 and row["unroll"] == unroll
    with pytest.raises(AssertionError):  # a wrong sum is caught
        read_ceiling.triton_read(x, expected + 100.0, 2048, 512, 1, 4, 0)


def test_the_read_ceilings_matrix_read_sums_each_copy_it_cycles_through(monkeypatch):
    """bench/read_ceiling.py --matrices: the read of a projection's bytes (one program per chunk) covers
    the whole copy, for each chunk / tile / unroll it is timed in (the bench asserts the sum)."""
    import torch

    read_ceiling = _load("read_ceiling")
    monkeypatch.setattr(read_ceiling.gemv_bench, "_timed_us", lambda fn, copies: ([fn(c) for c in copies], 2.0)[1])
    copies = [torch.rand(1 << 13, dtype=torch.float16) for _ in range(2)]
    for chunk, block, unroll in [(2048, 512, 1), (4096, 1024, 2)]:
        assert read_ceiling.matrix_read(copies, chunk, block, unroll, 4) == 2.0


def test_the_load_order_probe_counts_loads_a_warp_issues_only_after_a_wait():
    """bench/load_order.py on a hand-written loop: the up tile's load (R16) comes after an instruction
    that reads the gate tile's registers (R12..R15), so it is counted; an address computed from a register
    that is not a load's does not count as a wait; a loop without global loads is not reported."""
    load_order = _load("load_order")
    sass = """
.L_x_1:
        /*0100*/                   IMAD.WIDE R40, R39, 0x2, R40 ;
        /*0110*/              @!P0 LDG.E.128 R8, desc[UR12][R40.64] ;
        /*0120*/               @P0 LDG.E.128 R12, desc[UR12][R42.64] ;
        /*0130*/                   IMAD.WIDE R44, R39, 0x2, R44 ;
        /*0140*/                   SHF.L.U32 R30, R13, 0x10, RZ ;
        /*0150*/               @P0 LDG.E.128 R16, desc[UR12][R44.64] ;
        /*0160*/                   FFMA R2, R30, R17, R2 ;
        /*0170*/              @!P0 BRA `(.L_x_1) ;
.L_x_2:
        /*0180*/                   FADD R2, R2, R3 ;
        /*0190*/                   BRA `(.L_x_2) ;
"""
    assert load_order.loop_load_order(sass) == [
        {"label": ".L_x_1", "instructions": 7, "loads": 3, "first_use": 4, "loads_after_first_use": 1}]


@pytest.mark.parametrize("interleave", [0, 4, 16])
def test_the_projection_benchmark_times_gate_up_in_the_layout_it_names(interleave):
    """bench/gemv.py --interleave: the fused gate/up it times reads W's rows in that layout (interleaved in
    blocks of `interleave`), against the reference on the de-interleaved W (under Triton's interpreter); the
    unfused line, whose input also adds a residual, runs in the same layout."""
    import torch

    from bento_pagedllm.kernels import gemv, swiglu_gemm

    bench = _load("gemv")
    torch.manual_seed(0)
    inter, k = 32, 64
    w = torch.randn(2 * inter, k) * k**-0.5
    fused, unfused, x = bench._calls(2 * inter, k, "swiglu", 1, w, 1e-5, interleave)
    plain = swiglu_gemm.deinterleave_gate_up(w, interleave) if interleave else w
    expected = gemv.add_rms_norm_gemv_ref(x, None, torch.ones(k), 1e-5, plain, swiglu=True)[0]
    torch.testing.assert_close(fused(False, w)[0], expected, rtol=1e-4, atol=1e-5)
    assert unfused(w).shape == (1, inter)


def test_a_packaged_tile_table_keeps_the_searches_one_row_keys_the_last_winning_a_shared_one():
    """bench/tile_search.py --package: a GPU's table from its searches' results (here run10b's two H100
    searches, the 7B named last): only one-row keys (the tile-row keys in a result are the autotuner's), the
    shared o key the last result's, and exactly the table the package ships for that GPU."""
    from bento_pagedllm.kernels import gemv

    tile_search = _load("tile_search")
    run10b = os.path.join(BENCH, "results", "gpu-2026-12-07", "run10b")
    results = [json.load(open(os.path.join(run10b, f"{model}_search.json"))) for model in ("llama3-8b", "llama2-7b")]
    packaged = tile_search.package_table(results, measured="run10b")
    assert packaged["gpu"] == "NVIDIA H100 80GB HBM3"
    assert packaged["table"] == gemv.measured_tiles(packaged["gpu"])
    assert len(packaged["table"]) == 9 < sum(map(len, (r["table"] for r in results)))  # tile-row keys left out
    o = next(key for key in packaged["table"] if key.startswith("(4096, 4096, 1,"))
    assert packaged["table"][o] == results[1]["table"][o] != results[0]["table"][o]
    with pytest.raises(ValueError):  # results of two GPUs make no one table
        tile_search.package_table([results[0], {**results[1], "gpu": "NVIDIA H200"}], measured="")


def test_a_search_of_batch_tiles_packages_the_row_tiles_it_searched_and_takes_only_graph_sizes():
    """A search result names the row tiles it searched (`--batches 1,8,16,24,32`: 1, 16 and 32): its package
    keeps their keys and no other; batches without a decode graph of their own, or past the fused
    projections' rows, are refused before anything is built."""
    tile_search = _load("tile_search")
    dtypes = ("torch.bfloat16",) * 7
    keys = {m: str((4096, 4096, m, False, False, False, True, True, 0, *dtypes)) for m in (1, 16, 32, 64)}
    fields = {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 6}
    result = {"gpu": "G", "searched_row_tiles": [1, 16, 32], "table": {key: fields for key in keys.values()}}
    assert set(tile_search.package_table([result], measured="x")["table"]) == {keys[1], keys[16], keys[32]}
    for batches in [(3,), (1, 40)]:
        with pytest.raises(ValueError):
            tile_search.search("llama2-7b", 1, 1, batches)


def test_the_tile_search_judges_each_key_by_the_graphs_of_its_row_tiles_batches(monkeypatch):
    """bench/tile_search.py's control flow without a GPU (the engine, its graphs and CUDA's clock stood in
    for; what a search finds is the GPU's, run7): each tuning key of a searched row tile tries every
    candidate the autotuner offers it, re-capturing only the graphs of the batches that launch its tile
    (1 for one row; 8 and 16 for the 16-row tile; 24 and 32 for the 32-row one), and keeps the fastest;
    a candidate too big for the GPU's shared memory is recorded and passed over; the engine it times has no
    packaged table pinned."""
    import types

    from triton.runtime.errors import OutOfResources

    import bento_pagedllm
    import torch
    from bento_pagedllm.kernels import gemv

    tile_search = _load("tile_search")
    monkeypatch.setattr(gemv, "_tuned_one_row", gemv._autotuned(gemv._row_configs()))
    monkeypatch.setattr(gemv, "_tuned_rows", gemv._autotuned(gemv._tile_configs()))
    dtypes = ("torch.bfloat16",) * 7
    keys = [str((4096, 4096, m, False, False, False, True, True, 0, *dtypes)) for m in (1, 16, 32)]
    captures, clock = [], iter(range(10**6))
    too_big = gemv.tile_candidates(keys[1])[1]  # a 16-row candidate that does not fit the GPU: skipped

    class Graphs:
        context_bounds = [1024, 4096]
        graphs = {}

        def capture(self, sizes):
            captures.append(sorted(sizes))
            if gemv.tuned_configs().get(keys[1]) == too_big:  # as a graph's warm-up launch raises it
                raise OutOfResources(245760, 232448, "shared memory")
            self.graphs.update({(b, bound): (types.SimpleNamespace(replay=lambda: None), None)
                                for b in sizes for bound in self.context_bounds})

    class Event:  # each key's last candidate times fastest: elapsed times shrink as the search goes on
        def record(self):
            self.t = next(clock) ** 0.5

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return end.t - self.t

    built = []

    class LLM:
        def __init__(self, *args, **kwargs):
            built.append(kwargs)
            runner = types.SimpleNamespace(graphs=Graphs(), model=types.SimpleNamespace(
                config=types.SimpleNamespace(hidden_size=8), compute_logits=lambda hidden: hidden))
            self.engine = types.SimpleNamespace(runner=runner, shutdown=lambda: None)

        def generate(self, *args, **kwargs):  # the autotuner's choices for the keys the steps launch
            gemv.pin_tiles({key: gemv.tile_candidates(key)[0] for key in keys})

    monkeypatch.setattr(bento_pagedllm, "LLM", LLM)
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing: Event())
    monkeypatch.setattr(tile_search, "_captured", lambda launch: launch)  # the LM head's graph
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "G")
    randn = torch.randn
    monkeypatch.setattr(torch, "randn", lambda *shape, device, **kwargs: randn(*shape, **kwargs))
    result = tile_search.search("llama2-7b", rounds=1, repeats=3, batches=(1, 8, 16, 24, 32))
    candidates = [gemv.tile_candidates(key) for key in keys]
    assert captures == ([[1, 8, 16, 24, 32]] + [[1]] * len(candidates[0]) + [[8, 16]] * len(candidates[1])
                        + [[24, 32]] * len(candidates[2]) + [[1, 8, 16, 24, 32]])
    assert len(result["trials"]) == sum(map(len, candidates)) and result["searched_row_tiles"] == [1, 16, 32]
    assert [trial["config"] for trial in result["trials"] if "error" in trial] == [too_big]
    assert [result["table"][key] for key in keys] == [options[-1] for options in candidates]
    assert set(result["start_ms"]) == {"1", "8", "16", "24", "32"}
    assert built[0]["measured_tiles"] is False  # no packaged table pinned: its other model's keys not searched
