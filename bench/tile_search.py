"""Search the projections' tiles (kernels/gemv.py) by the time of whole decode steps (single stream; small batches).

Why: the autotuner ranks each projection's configurations by short timings of the kernel alone, and
different processes pick different tiles; pinned back into fresh processes, two processes' choices ran
Llama-3-8B decode steps in 5.169-5.170 against 5.220-5.224 ms, each as its source process did (H100,
bench/results/gpu-2026-12-07/run6). So the choice, not the process, sets the step's time, and the kernel
alone is the wrong judge: here each candidate runs inside the step as the engine runs it (the batch-1
decode graph re-captured with it, its kernels launched as dependents of the ones before).

Coordinate descent from the autotuner's choice: for each tuning key (q/k/v, o, gate/up, down, the LM head)
of the row tiles searched, every configuration the autotuner would try for it, the others fixed; the fastest
kept; `--rounds` passes. The objective: the median of `--repeats` back-to-back replays of the decode graph
(short contexts) plus the median of as many LM-head launches (it runs outside the graphs), summed over the
`--batches` that launch the key's row tile (1: the one-row tile; 2-16 rows: 16; 17-32: 32). Run 8 to 32 with
care: a replay's padded rows attend to one token, so attention is lighter than in served steps. The result's
`table` is the process's `gemv.tuned_configs()` afterwards: `single_stream.py` / `serve.py --pin-tiles`
take it.

    python bench/tile_search.py --model llama2-7b --out tiles.json  # then: single_stream.py --pin-tiles with its table
    python bench/tile_search.py --model llama3-8b --batches 1,8,16,24,32 --out tiles.json

A GPU's packaged table (kernels/tiles/, pinned by EngineArgs.measured_tiles) from searches' results: the keys
of the row tiles each searched (its other keys are the autotuner's); where results share a key (o: 4,096 x
4,096 in Llama-2-7B and Llama-3-8B) the last named wins:

    python bench/tile_search.py --package llama3-8b.json llama2-7b.json --note "..."
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
from single_stream import SHAPES, config_dir, single_stream_prompt
from triton.runtime.errors import OutOfResources


def _captured(launch):
    """`launch` captured in a CUDA graph: its replay, whose timing is the GPU's alone. Why: the LM head
    launched from Python back to back measured 0.088 ms in most candidates' timings and 0.13-0.59 ms in
    some, for tiles of keys it never launches (host-bound; H100, run10): noise that picked the LM head's
    and other keys' tiles at random."""
    launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    return graph.replay


def _median_ms(launch, repeats: int) -> float:
    """The median time of `launch` over `repeats` back-to-back calls, after one."""
    launch()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(repeats + 1)]
    events[0].record()
    for event in events[1:]:
        launch()
        event.record()
    events[-1].synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in zip(events, events[1:]))


def search(model: str, rounds: int, repeats: int, batches: tuple[int, ...] = (1,)) -> dict:
    """Coordinate descent over the tuning keys of the row tiles `batches` launch (1: one row; 2-16: the
    16-row tile; 17-32: the 32-row tile), each key judged by the decode graphs and LM heads of the batches
    that use its tile."""
    from bento_pagedllm import LLM, SamplingParams
    from bento_pagedllm.config import FUSED_GEMV_ROWS
    from bento_pagedllm.cuda_graphs import batch_size_ladder
    from bento_pagedllm.kernels import gemv

    max_batch = max(batches)
    if not set(batches) <= set(batch_size_ladder(max_batch)) or max_batch > FUSED_GEMV_ROWS:
        raise ValueError(f"batches must be decode-graph sizes ({batch_size_ladder(FUSED_GEMV_ROWS)}), not {batches}")
    # NOTE: graphs up to the largest batch only, prompts eager; a candidate re-captures only its judges' graphs
    # NOTE: measured_tiles off: the keys searched (and packaged) are this model's alone. With a packaged table
    # pinned, its other model's keys were "searched" too, by graphs that never launch them, their tiles chosen
    # by noise, and packaged (H100, run10: that table ran Llama-3-8B 3% slower than the autotuner)
    llm = LLM(config_dir(SHAPES[model]), load_format="dummy", dtype="bfloat16", device="cuda",
              max_graph_batch=max_batch, max_mixed_graph_tokens=0, measured_tiles=False)
    llm.generate([single_stream_prompt()], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    runner = llm.engine.runner
    graphs = runner.graphs
    hidden = torch.randn(max_batch, runner.model.config.hidden_size, dtype=torch.bfloat16, device="cuda")
    judged = {}  # a row tile -> the batches that launch it
    for batch in batches:
        judged.setdefault(gemv.row_tile(batch), []).append(batch)
    keys = [key for key in gemv.tuned_configs() if gemv.tuning_flags(key)["BLOCK_M"] in judged]

    def step_ms(batch_sizes) -> dict[int, tuple[float, float]]:
        """Each batch's (decode graph, LM head) time: its graphs re-captured with the tuners' current choices."""
        graphs.capture(list(batch_sizes))
        return {batch: (_median_ms(graphs.graphs[batch, graphs.context_bounds[0]][0].replay, repeats),
                        _median_ms(_captured(lambda: runner.model.compute_logits(hidden[:batch])), repeats))
                for batch in batch_sizes}

    start = step_ms(batches)
    trials = []
    for round_ in range(rounds):
        for key in keys:
            times = []
            for fields in gemv.tile_candidates(key):
                gemv.pin_tiles({key: fields})
                trial = {"round": round_, "key": key, "config": fields}
                try:
                    measured = step_ms(judged[gemv.tuning_flags(key)["BLOCK_M"]])
                except OutOfResources as error:
                    # NOTE: raised by the graphs' warm-up, before capture: the judges' graphs stay as they were.
                    # The autotuner times such a tile as infinitely slow (Llama-3-8B gate/up at 32 rows: one
                    # needs 240 KiB of shared memory, an H100 has 227)
                    trials.append({**trial, "error": str(error)})
                    continue
                times.append((sum(graph + head for graph, head in measured.values()), fields))
                trials.append({**trial, "ms": {str(batch): list(pair) for batch, pair in measured.items()}})
            best_ms, best = min(times, key=lambda t: t[0])
            gemv.pin_tiles({key: best})
            print(json.dumps({"round": round_, "key": key, "best": best, "judged_ms": best_ms,
                              "spread_ms": max(t for t, _ in times) - best_ms}), flush=True)
    end = step_ms(batches)

    def per_batch(times: dict) -> dict:
        return {str(batch): {"graph": graph, "lm_head": head} for batch, (graph, head) in times.items()}

    result = {"model": model, "gpu": torch.cuda.get_device_name(), "rounds": rounds, "repeats": repeats,
              "batches": list(batches), "searched_row_tiles": sorted(judged), "start_ms": per_batch(start),
              "end_ms": per_batch(end), "table": gemv.tuned_configs(), "trials": trials}
    llm.engine.shutdown()
    return result


def package_table(results: list[dict], measured: str, note: str = "") -> dict:
    """The packaged table for the GPU the `results` (of `search`, one GPU) ran on: the keys of the row tiles
    each searched (the others in its table are the autotuner's), a later result's choice winning a shared key."""
    from bento_pagedllm.kernels import gemv

    (gpu,) = {result["gpu"] for result in results}
    table = {key: fields for result in results for key, fields in result["table"].items()
             if gemv.tuning_flags(key)["BLOCK_M"] in result.get("searched_row_tiles", [1])}
    return {"gpu": gpu, "measured": measured, "note": note, "table": dict(sorted(table.items()))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama2-7b", choices=list(SHAPES),
                        help="one per process: the tuners' caches hold every model's keys (o is 4,096 x 4,096 in two)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--batches", default="1",
                        help="decode batches that judge the tiles, comma-separated: 1 searches the one-row tiles; "
                             "e.g. 1,8,16,24,32 also the 16- and 32-row tiles (each judged by its batches)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--package", nargs="+", default=None, metavar="RESULT",
                        help="no search: write these results' table to kernels/tiles/<GPU>.json")
    parser.add_argument("--note", default="", help="with --package: what measured it (date, run, figures)")
    args = parser.parse_args()
    if args.package:
        from bento_pagedllm.kernels import gemv

        results = []
        for path in args.package:
            with open(path) as f:
                results.append(json.load(f))
        packaged = package_table(results, measured=", ".join(map(os.path.basename, args.package)), note=args.note)
        path = gemv.tile_table_path(packaged["gpu"])
        with open(path, "w") as f:
            json.dump(packaged, f, indent=1)
            f.write("\n")
        print(f"{len(packaged['table'])} keys -> {path}")
        return
    result = search(args.model, args.rounds, args.repeats, tuple(map(int, args.batches.split(","))))
    print(json.dumps({k: result[k] for k in ("model", "gpu", "start_ms", "end_ms")}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
