"""The device's idle fraction between engine steps, from the CUDA events the model runner records.

Each launched step is bracketed by two events on the device's stream: `started` before its first
operation, `ended` after the copy of its sampled ids. When the host launches step N+1 before step N ends
(async scheduling), N+1's `started` fires as soon as N's `ended` does; when the host is late, the device
waits, and the wait is the gap between them.
"""

from __future__ import annotations


def idle_fraction(timeline: list) -> dict:
    """timeline: [(started, ended, path, num_seqs, num_tokens)] in launch order (ModelRunner.timeline)."""
    if len(timeline) < 2:
        return {"steps": len(timeline), "idle_fraction": None}
    timeline[-1][1].synchronize()
    gaps = [step[1].elapsed_time(following[0]) for step, following in zip(timeline, timeline[1:])]
    busy = [step[0].elapsed_time(step[1]) for step in timeline]
    span = timeline[0][0].elapsed_time(timeline[-1][1])
    idle_before = [0.0] + gaps  # [i]: the device's wait before step i started
    return {"steps": len(timeline), "span_ms": span, "idle_between_steps_ms": sum(gaps),
            "idle_fraction": sum(gaps) / span, "median_step_device_ms": sorted(busy)[len(busy) // 2],
            "by_step_kind": step_breakdown(timeline, busy, idle_before),
            "decode_graph_ms_by_seqs": decode_ms_by_seqs(timeline, busy),
            "longest_idle_gaps": longest_gaps(timeline, idle_before)}


def decode_ms_by_seqs(timeline: list, busy: list[float]) -> dict[int, float]:
    """The decode-graph steps' mean device time by their number of sequences: which batch sizes are slow
    (a graph's GEMM kernels are picked per row count)."""
    sums: dict[int, list] = {}
    for step, ms in zip(timeline, busy):
        if step[2] == "decode_graph":
            total = sums.setdefault(step[3], [0, 0.0])
            total[0] += 1
            total[1] += ms
    return {seqs: round(ms / n, 3) for seqs, (n, ms) in sorted(sums.items())}


def longest(values: list[float], count: int) -> list[int]:
    """The indices of the `count` largest values, largest first."""
    return sorted(range(len(values)), key=lambda i: -values[i])[:count]


def longest_gaps(timeline: list, idle_before: list[float], count: int = 12) -> list[dict]:
    """The longest waits of the device, each with the step that waited (its index, path and size): whether
    the idle time is a steady share of many steps or a few long stalls (a collection, a slow plan)."""
    return [{"step": i, "idle_ms": round(idle_before[i], 3), "path": timeline[i][2], "seqs": timeline[i][3],
             "tokens": timeline[i][4]} for i in longest(idle_before, count)]


def _bucket(num_seqs: int) -> str:
    for bound in (1, 8, 32, 128, 256, 512):
        if num_seqs <= bound:
            return f"<={bound} seqs"
    return ">512 seqs"


def step_breakdown(timeline: list, busy: list[float], idle_before: list[float]) -> list[dict]:
    """Device time by the step's path (decode graph, mixed graph, eager) and batch size: where a run's
    time goes. `idle_before[i]`: the device's wait before step i started (its host was late), summed
    per group as `idle_before_ms`, so the idle time has an owner too."""
    groups: dict[tuple[str, str], list] = {}
    for step, ms, idle in zip(timeline, busy, idle_before):
        path, num_seqs, num_tokens = step[2:5]
        group = groups.setdefault((path, _bucket(num_seqs)), [0, 0.0, 0, 0.0])
        group[0] += 1
        group[1] += ms
        group[2] += num_tokens
        group[3] += idle
    return [{"path": path, "batch": bucket, "steps": n, "device_ms": round(ms, 1), "tokens": tokens,
             "ms_per_step": round(ms / n, 3), "idle_before_ms": round(idle, 1)}
            for (path, bucket), (n, ms, tokens, idle) in sorted(groups.items(), key=lambda item: -item[1][1])]
