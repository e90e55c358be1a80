"""Search the one-row projections' tiles (kernels/gemv.py) by the time of a whole single-stream decode step.

Why: the autotuner ranks each projection's configurations by short timings of the kernel alone, and
different processes pick different tiles; pinned back into fresh processes, two processes' choices ran
Llama-3-8B decode steps in 5.169-5.170 against 5.220-5.224 ms, each as its source process did (H100,
bench/results/gpu-2026-12-07/run6). So the choice, not the process, sets the step's time, and the kernel
alone is the wrong judge: here each candidate runs inside the step as the engine runs it (the batch-1
decode graph re-captured with it, its kernels launched as dependents of the ones before).

Coordinate descent from the autotuner's choice: for each one-row tuning key (q/k/v, o, gate/up, down, the
LM head), every configuration the autotuner would try for it, the others fixed; the fastest kept; `--rounds`
passes. The objective: the median of `--repeats` back-to-back replays of the batch-1 decode graph (short
contexts) plus the median of as many LM-head launches (it runs outside the graphs). The result's `table`
is the process's `gemv.tuned_configs()` afterwards: `single_stream.py --pin-tiles` takes it.

    python bench/tile_search.py --model llama2-7b --out tiles.json  # then: single_stream.py --pin-tiles with its table

A GPU's packaged table (kernels/tiles/, pinned by EngineArgs.measured_tiles) from searches' results, the
one-row keys only (the tile-row keys in a result are the autotuner's, unsearched); where results share a key
(o: 4,096 x 4,096 in Llama-2-7B and Llama-3-8B) the last named wins:

    python bench/tile_search.py --package llama3-8b.json llama2-7b.json --note "..."
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics

import torch
from single_stream import SHAPES, config_dir, single_stream_prompt


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


def search(model: str, rounds: int, repeats: int) -> dict:
    from bento_pagedllm import LLM, SamplingParams
    from bento_pagedllm.kernels import gemv

    # NOTE: graphs for batch 1 only, prompts eager: a re-capture takes ~0.1 s
    llm = LLM(config_dir(SHAPES[model]), load_format="dummy", dtype="bfloat16", device="cuda", max_graph_batch=1,
              max_mixed_graph_tokens=0)
    llm.generate([single_stream_prompt()], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    runner = llm.engine.runner
    graphs = runner.graphs
    hidden = torch.randn(1, runner.model.config.hidden_size, dtype=torch.bfloat16, device="cuda")
    block_m_at = gemv.TUNING_KEY.index("BLOCK_M")
    keys = [key for key in gemv._tuned_one_row.cache if key[block_m_at] == 1]

    def step_ms() -> tuple[float, float]:
        graphs.capture()  # NOTE: re-captured with the tuners' current choices
        graph = graphs.graphs[1, graphs.context_bounds[0]][0]
        return _median_ms(graph.replay, repeats), _median_ms(lambda: runner.model.compute_logits(hidden), repeats)

    def fields(config) -> dict:
        return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}

    start = step_ms()
    trials = []
    for round_ in range(rounds):
        for key in keys:
            n, k = key[0], key[1]
            flags = dict(zip(gemv.TUNING_KEY, key))
            candidates = gemv._prune(gemv._row_configs(), {"N": n, "K": k}, **flags)
            times = []
            for config in candidates:
                gemv._tuned_one_row.cache[key] = config
                graph_ms, head_ms = step_ms()
                times.append((graph_ms + head_ms, config))
                trials.append({"round": round_, "key": str(key), "config": fields(config), "graph_ms": graph_ms,
                               "lm_head_ms": head_ms})
            best_ms, best = min(times, key=lambda t: t[0])
            gemv._tuned_one_row.cache[key] = best
            print(json.dumps({"round": round_, "key": str(key), "best": fields(best), "step_ms": best_ms,
                              "spread_ms": max(t for t, _ in times) - best_ms}), flush=True)
    end = step_ms()
    result = {"model": model, "gpu": torch.cuda.get_device_name(), "rounds": rounds, "repeats": repeats,
              "start_ms": {"graph": start[0], "lm_head": start[1]}, "end_ms": {"graph": end[0], "lm_head": end[1]},
              "table": gemv.tuned_configs(), "trials": trials}
    llm.engine.shutdown()
    return result


def package_table(results: list[dict], measured: str, note: str = "") -> dict:
    """The packaged table for the GPU the `results` (of `search`, one GPU) ran on: their one-row keys,
    a later result's choice winning a shared key."""
    from bento_pagedllm.kernels import gemv

    (gpu,) = {result["gpu"] for result in results}
    block_m_at = gemv.TUNING_KEY.index("BLOCK_M")
    table = {key: fields for result in results for key, fields in result["table"].items()
             if ast.literal_eval(key)[block_m_at] == 1}
    return {"gpu": gpu, "measured": measured, "note": note, "table": dict(sorted(table.items()))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama2-7b", choices=list(SHAPES),
                        help="one per process: the tuners' caches hold every model's keys (o is 4,096 x 4,096 in two)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
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
        print(f"{len(packaged['table'])} keys -> {path}")
        return
    result = search(args.model, args.rounds, args.repeats)
    print(json.dumps({k: result[k] for k in ("model", "gpu", "start_ms", "end_ms")}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
