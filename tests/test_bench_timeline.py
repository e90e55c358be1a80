"""bench/timeline.py: the idle fraction and its owners, from stand-ins for CUDA events (the arithmetic
only; on the GPU the events come from ModelRunner.timeline)."""

from __future__ import annotations

import importlib.util
import os

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "timeline.py")
_SPEC = importlib.util.spec_from_file_location("bench_timeline", _PATH)
timeline = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(timeline)  # NOTE: by path: bench/ is not a package, and its names stay off sys.path


class _Event:
    """A CUDA event's interface: a time on the device (ms), elapsed_time to another, synchronize."""

    def __init__(self, ms: float) -> None:
        self.ms = ms

    def elapsed_time(self, later: "_Event") -> float:
        return later.ms - self.ms

    def synchronize(self) -> None:
        pass


def test_idle_time_is_owned_by_the_step_that_waited():
    # (start, end, path, seqs, tokens): a 2 ms gap before step 2, 1 ms before step 3
    steps = [(0, 10, "eager", 300, 8192), (10, 15, "decode_graph", 300, 300), (17, 20, "decode_graph", 4, 4),
             (21, 24, "decode_graph", 3, 3)]
    events = [(_Event(a), _Event(b), path, seqs, tokens) for a, b, path, seqs, tokens in steps]
    result = timeline.idle_fraction(events)
    assert result["span_ms"] == 24 and result["idle_between_steps_ms"] == 3
    assert result["idle_fraction"] == 3 / 24
    groups = {(g["path"], g["batch"]): g for g in result["by_step_kind"]}
    assert groups["decode_graph", "<=8 seqs"]["idle_before_ms"] == 3.0
    assert groups["decode_graph", "<=8 seqs"]["steps"] == 2 and groups["decode_graph", "<=8 seqs"]["device_ms"] == 6.0
    assert groups["eager", "<=512 seqs"]["idle_before_ms"] == 0.0
    assert groups["decode_graph", "<=512 seqs"]["idle_before_ms"] == 0.0
    # the longest waits first, each with the step that waited
    assert result["longest_idle_gaps"][:2] == [
        {"step": 2, "idle_ms": 2, "path": "decode_graph", "seqs": 4, "tokens": 4},
        {"step": 3, "idle_ms": 1, "path": "decode_graph", "seqs": 3, "tokens": 3}]
    # the decode-graph steps' mean time by sequence count (eager steps left out)
    assert result["decode_graph_ms_by_seqs"] == {3: 3.0, 4: 3.0, 300: 5.0}
