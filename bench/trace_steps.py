"""Where a single-stream decode step's device time goes, from a torch profiler trace
(`bench/single_stream.py --profile-dir DIR` writes DIR/profile_<model>.trace.json).

Why not the kernels' durations: with programmatic dependent launch a layer's kernels overlap (each starts
while the one before it ends, and waits), so durations add up to more than the step. What a kernel adds
to the step is the time from the end of the kernel before it to its own end (it cannot end before the
kernel it waits for). The step is the fused single-sequence path: per layer q/k/v, attention, o,
gate/up and down (`_gemv_kernel`s and `_decode_split_kernel`), then the LM head; a step ends with the
sampler's argmax kernel.

    python bench/trace_steps.py DIR/profile_llama2-7b.trace.json

`--by-position` reads any decode step (the cuBLAS path of bigger batches included, with its separate norm,
activation and rotary kernels), such as a window of `bench/serve.py --profile FILE --profile-window
START:COUNT` (its FILE.stepsA-B.trace.json): what each kernel of a layer adds, by position.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics

LAYER = ("qkv", "attention", "o", "gate_up", "down")


def device_events(trace: dict) -> list[dict]:
    """The trace's kernels and copies, in start order."""
    kinds = ("kernel", "gpu_memcpy", "gpu_memset")
    return sorted((e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in kinds),
                  key=lambda e: e["ts"])


def _is_model_kernel(event: dict) -> bool:
    return event["name"].startswith(("_gemv", "_decode"))


def _is_step_end(event: dict) -> bool:
    return "argmax" in event["name"] or "at::native::reduce_kernel" in event["name"]


def step_breakdown(events: list[dict], num_layers: int) -> dict:
    """Medians over the decode steps whose model ran the fused path (num_layers * 5 + 1 kernels): what
    each layer kernel adds (us), a layer, the LM head, and the device time from the end of the step
    before to the first kernel of the layers ("before") and from the LM head to the step's end ("after")."""
    ends = [i for i, e in enumerate(events) if _is_step_end(e)]
    added = {name: [] for name in LAYER}
    lm_head, before, after = [], [], []
    for a, b in zip(ends, ends[1:]):
        model = [e for e in events[a + 1 : b + 1] if _is_model_kernel(e)]
        if len(model) != num_layers * len(LAYER) + 1:
            continue  # a prefill or a step of another path
        previous_end = None
        for j, event in enumerate(model[:-1]):
            end = event["ts"] + event["dur"]
            if previous_end is not None:
                added[LAYER[j % len(LAYER)]].append(end - previous_end)
            previous_end = end
        lm_end = model[-1]["ts"] + model[-1]["dur"]
        lm_head.append(lm_end - previous_end)
        before.append(model[0]["ts"] - (events[a]["ts"] + events[a]["dur"]))
        after.append(events[b]["ts"] + events[b]["dur"] - lm_end)
    if not lm_head:
        return {"steps": 0}
    layer = {name: statistics.median(values) for name, values in added.items()}
    return {"steps": len(lm_head), "layer_us": layer, "a_layer_us": sum(layer.values()),
            "lm_head_us": statistics.median(lm_head), "before_us": statistics.median(before),
            "after_us": statistics.median(after)}


def _short_name(event: dict) -> str:
    name = event["name"]
    if name.startswith("nvjet"):
        return "cublas"
    return "cublas_split_k_reduce" if "splitKreduce" in name else name.split("(")[0].replace("void ", "")[:40]


def _added(events: list[dict], i: int) -> float:
    """What event i adds to the step: from the end of the event before it to its own end."""
    return events[i]["ts"] + events[i]["dur"] - (events[i - 1]["ts"] + events[i - 1]["dur"])


def position_breakdown(events: list[dict], num_layers: int) -> dict:
    """Any decode path (fused or not, any batch): each step's device work cut into layers at the decode
    attention kernel; per position in a layer (0 = the attention), medians over the middle layers (those
    with the most common sequence of kernels) and the steps, of what the kernel adds and its duration;
    the step's kernels before the first attention, and from the last one on (the last layer, the LM head,
    the sampler), likewise. Used on a window of `bench/serve.py --profile` (its trace), whose steps have
    one shape."""
    ends = [i for i, e in enumerate(events) if _is_step_end(e)]
    layers, head, tail, steps = [], {}, {}, []
    for a, b in zip(ends, ends[1:]):
        step = events[a + 1 : b + 1]
        attention = [i for i, e in enumerate(step) if e["name"].startswith("_decode")]
        if len(attention) != num_layers or attention[0] == 0:
            continue  # a prefill or mixed step
        steps.append(step[-1]["ts"] + step[-1]["dur"] - (events[a]["ts"] + events[a]["dur"]))
        for start, end in zip(attention[1:-1], attention[2:]):
            layers.append([(_short_name(step[i]), _added(step, i), step[i]["dur"]) for i in range(start, end)])
        for i in range(attention[0]):
            head.setdefault(i, []).append((_short_name(step[i]), _added(step, i) if i else 0.0, step[i]["dur"]))
        for i in range(attention[-1], len(step)):
            tail.setdefault(i - attention[-1], []).append((_short_name(step[i]), _added(step, i), step[i]["dur"]))
    if not steps:
        return {"steps": 0}
    shapes = collections.Counter(tuple(name for name, _, _ in layer) for layer in layers)
    common = shapes.most_common(1)[0][0]
    positions = {}
    for layer in layers:
        if tuple(name for name, _, _ in layer) == common:
            for offset, kernel in enumerate(layer):
                positions.setdefault(offset, []).append(kernel)

    def medians(groups: dict) -> list[dict]:
        return [{"kernel": values[0][0], "added_us": round(statistics.median(v[1] for v in values), 2),
                 "duration_us": round(statistics.median(v[2] for v in values), 2)}
                for _, values in sorted(groups.items())]

    layer = medians(positions)
    return {"steps": len(steps), "median_step_us": round(statistics.median(steps), 1),
            "layers_read": shapes[common], "layers_of_other_shapes": len(layers) - shapes[common],
            "layer": layer, "a_layer_us": round(sum(k["added_us"] for k in layer), 1),
            "before_layers": medians(head), "last_layer_and_after": medians(tail)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("trace")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--by-position", action="store_true",
                        help="any decode path: the kernels by position in a layer (offline profile windows)")
    args = parser.parse_args()
    with open(args.trace) as f:
        events = device_events(json.load(f))
    breakdown = position_breakdown if args.by_position else step_breakdown
    print(json.dumps(breakdown(events, args.layers), indent=1))


if __name__ == "__main__":
    main()
