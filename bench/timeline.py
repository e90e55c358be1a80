"""The device's idle fraction between engine steps, from the CUDA events the model runner records.

Each launched step is bracketed by two events on the device's stream: `started` before its first
operation, `ended` after the copy of its sampled ids. When the host launches step N+1 before step N ends
(async scheduling), N+1's `started` fires as soon as N's `ended` does; when the host is late, the device
waits, and the wait is the gap between them.
"""

from __future__ import annotations


def idle_fraction(timeline: list) -> dict:
    """timeline: [(started, ended)] CUDA events in launch order (ModelRunner.timeline)."""
    if len(timeline) < 2:
        return {"steps": len(timeline), "idle_fraction": None}
    timeline[-1][1].synchronize()
    gaps = [ended.elapsed_time(started_next) for (_, ended), (started_next, _) in zip(timeline, timeline[1:])]
    busy = [started.elapsed_time(ended) for started, ended in timeline]
    span = timeline[0][0].elapsed_time(timeline[-1][1])
    return {"steps": len(timeline), "span_ms": span, "idle_between_steps_ms": sum(gaps),
            "idle_fraction": sum(gaps) / span, "median_step_device_ms": sorted(busy)[len(busy) // 2]}
