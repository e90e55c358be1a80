"""Where a single-stream decode step's device time goes, from a torch profiler trace
(`bench/single_stream.py --profile-dir DIR` writes DIR/profile_<model>.trace.json).

Why not the kernels' durations: with programmatic dependent launch a layer's kernels overlap (each starts
while the one before it ends, and waits), so durations add up to more than the step. What a kernel adds
to the step is the time from the end of the kernel before it to its own end (it cannot end before the
kernel it waits for). The step is the fused single-sequence path: per layer q/k/v, attention, o,
gate/up and down (`_gemv_kernel`s and `_decode_split_kernel`), then the LM head; a step ends with the
sampler's argmax kernel.

    python bench/trace_steps.py DIR/profile_llama2-7b.trace.json
"""

from __future__ import annotations

import argparse
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("trace")
    parser.add_argument("--layers", type=int, default=32)
    args = parser.parse_args()
    with open(args.trace) as f:
        events = device_events(json.load(f))
    print(json.dumps(step_breakdown(events, args.layers), indent=1))


if __name__ == "__main__":
    main()
