"""Draw serving results (JSON files of bench/serve.py) against request rate: throughput and p50/p99
latencies, one line per engine label. Usage:

    python bench/plot_serve.py --out bench/results/serve.png ours=bench/results/serve_ours_*.json \
        vllm=bench/data/peers/vllm-0.26_async_llama2-7b_rate*.json

The request rate of a run is read from its requests file name (`..._rateR.jsonl`; none means all at t=0,
drawn at the right edge as "inf"). A file of bench/vllm_peer.py's `--async-requests` holds one result a
requests file (under "async", keyed by the file): each counts as a run.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PANELS = [
    ("request_throughput", None, "achieved requests/s"),
    ("ttft_s", ("median", "p99"), "time to first token (s)"),
    ("tpot_s", ("median", "p99"), "time per output token (s)"),
    ("itl_s", ("median", "p99"), "inter-token latency (s)"),
]


def rate_of(result: dict) -> float:
    match = re.search(r"rate([0-9.]+)", result.get("requests_file", ""))
    return float(match.group(1)) if match else math.inf


def runs_in(path: str) -> list[dict]:
    result = json.load(open(path))
    if "async" not in result:
        return [result]
    return [dict(run, requests_file=run.get("requests_file", file)) for file, run in result["async"].items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("series", nargs="+", help="LABEL=GLOB of result JSON files")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 4))
    finite_max = 1.0
    series = {}
    for item in args.series:
        label, pattern = item.split("=", 1)
        results = [run for path in sorted(glob.glob(pattern)) for run in runs_in(path)]
        series[label] = sorted(results, key=rate_of)
        finite_max = max([finite_max] + [rate_of(r) for r in results if rate_of(r) != math.inf])
    for ax, (key, quantiles, title) in zip(axes, PANELS):
        for color, (label, results) in enumerate(series.items()):
            results = [r for r in results if key in r]  # NOTE: a peer's published figures may lack a metric
            xs = [rate_of(r) if rate_of(r) != math.inf else finite_max * 1.5 for r in results]
            for quantile in quantiles or (None,):
                ys = [r[key] if quantile is None else r[key][quantile] for r in results]
                ax.plot(xs, ys, marker="o", color=f"C{color}", linestyle="--" if quantile == "p99" else "-",
                        label=label if quantile is None else f"{label} {quantile}")
        ax.set_title(title)
        ax.set_xlabel("request rate (req/s; rightmost: all at t=0)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
