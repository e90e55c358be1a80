"""Serving benchmark, like `vllm bench serve`: a fixed ShareGPT-shaped workload through the engine.

Modes:
- `offline`: the in-process engine (`LLM`) gets every request at once;
- `async`: the in-process AsyncLLMEngine gets each request at its arrival time (no HTTP);
- `online`: a running `bentoml serve service:svc` at --url gets streaming OpenAI completions requests
  (token-id prompts, `ignore_eos`) from an asyncio HTTP client (aiohttp), at their arrival times.
Every request generates exactly its `max_tokens`. Writes one JSON result (--out).

    python ../shared/bench/workload.py --n 500 --seed 0 --vocab 32000 > bench/data/requests.jsonl
    python bench/serve.py --mode offline --shape llama2-7b --requests bench/data/requests.jsonl --out r.json
    python bench/serve.py --mode online --url http://127.0.0.1:3000 --model NAME --requests ... --out r.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import gc
import json
import logging
import os
import statistics
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling bench modules

from timeline import idle_fraction, longest  # noqa: E402

SUMMARY = ("ttft_s", "tpot_s", "itl_s", "e2e_s")


def load(path: str, limit: int | None) -> list[dict]:
    with open(path) as f:
        requests = [json.loads(line) for line in f if line.strip()]
    return requests[:limit] if limit else requests


def stats(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "median": None, "p99": None}
    ordered = sorted(values)
    return {"mean": statistics.fmean(ordered), "median": statistics.median(ordered),
            "p99": ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]}


def report(records: list[dict], wall: float, extra: dict) -> dict:
    """records: per request {"ok", "start", "tokens": [arrival time of each output token], "prompt_len"}."""
    done = [r for r in records if r["ok"]]
    ttft = [r["tokens"][0] - r["start"] for r in done if r["tokens"]]
    e2e = [r["tokens"][-1] - r["start"] for r in done if r["tokens"]]
    tpot = [(r["tokens"][-1] - r["tokens"][0]) / (len(r["tokens"]) - 1) for r in done if len(r["tokens"]) > 1]
    itl = [b - a for r in done for a, b in zip(r["tokens"], r["tokens"][1:])]
    output_tokens = sum(r.get("output_tokens", len(r["tokens"])) for r in done)
    prompt_tokens = sum(r["prompt_len"] for r in done)
    return {
        "completed": len(done), "failed": len(records) - len(done), "duration_s": wall,
        "request_throughput": len(done) / wall, "output_throughput": output_tokens / wall,
        "total_token_throughput": (output_tokens + prompt_tokens) / wall,
        **{name: stats(values) for name, values in zip(SUMMARY, (ttft, tpot, itl, e2e))}, **extra,
    }


def shared_prefix(num_tokens: int) -> list[int]:
    import random

    rng = random.Random(99)
    return [rng.randrange(10, 30000) for _ in range(num_tokens)]


def shape_dir(shape: str) -> str:
    import os
    import tempfile

    from single_stream import SHAPES

    path = tempfile.mkdtemp()
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(dict(SHAPES[shape], architectures=["LlamaForCausalLM"], model_type="llama", bos_token_id=1,
                       eos_token_id=2), f)
    return path


def engine_kwargs(args) -> dict:
    # NOTE: this process runs one engine, as the engine process does: the same garbage-collector setting
    kwargs = dict(dtype=args.dtype, device=args.device, enable_prefix_caching=not args.no_prefix_caching,
                  tensor_parallel_size=args.tensor_parallel_size, peer_all_reduce=args.peer_all_reduce,
                  quiet_gc=not args.no_quiet_gc)
    if args.sync_scheduling:
        kwargs["async_scheduling"] = False
    if args.no_dependent_launch:
        kwargs["dependent_launch"] = False
    kwargs.update(args.tile_options)
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_graph_batch", "fused_gemv_rows"):
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    if args.shape:
        kwargs["load_format"] = "dummy"
    return kwargs


def record_triton_compiles(start: float) -> list[dict]:
    """From now on, note each Triton kernel variant this process had not compiled yet (compiled, or loaded
    from the disk cache, inside the clock): the warm-up should have met them all."""
    import triton

    compiles: list[dict] = []
    if not hasattr(triton, "knobs"):  # NOTE: Triton before 3.4 has no hook
        return compiles

    def hook(*, fn, key, **kwargs) -> bool:
        # NOTE: `key` holds each argument's specialisation (integer class, pointer alignment) and the constants
        compiles.append({"at_s": round(time.perf_counter() - start, 3), "kernel": fn.name, "key": str(key)[:1000]})
        return False  # NOTE: True would skip the compilation

    triton.knobs.runtime.jit_cache_hook = hook
    return compiles


def run_offline(args, requests) -> dict:
    from bento_pagedllm import LLMEngine, EngineArgs, SamplingParams

    engine = LLMEngine(EngineArgs(model=args.model_path, **engine_kwargs(args)))
    warm_up(engine, requests)
    timeline = engine.runner.timeline = [] if engine.runner.device.type == "cuda" else None
    records = {}
    start = time.perf_counter()
    compiles = record_triton_compiles(start)
    windows = [tuple(int(n) for n in w.split(":")) for w in args.profile_window]
    profiler = RunProfiler(args.profile, windows) if args.profile else None
    for r in requests:
        engine.add_request(str(r["id"]), r["prompt_ids"], SamplingParams(max_tokens=r["max_tokens"],
                                                                          temperature=0.0, ignore_eos=True))
        records[str(r["id"])] = {"ok": False, "start": start, "tokens": [], "prompt_len": len(r["prompt_ids"])}
    host = HostClock(gc_debug=args.gc_debug)
    for owner, method, label in [(engine, "_read_step", "read"), (engine.runner, "collect", "wait"),
                                 (engine.scheduler, "schedule", "schedule"), (engine.runner, "prepare", "prepare"),
                                 (engine.runner, "launch", "launch"), (engine.runner.model, "forward", "forward"),
                                 (engine.runner.model, "compute_logits", "logits"),
                                 (engine.scheduler, "update_computed", "update_computed"),
                                 (engine.runner, "_device_inputs", "device_inputs"),
                                 (engine, "_output_or_failure", "outputs")]:
        host.watch(owner, method, label)
    if engine.runner.device.type == "cpu":  # there sampling is the device's work, done in the call
        import bento_pagedllm.model_runner

        host.watch(bento_pagedllm.model_runner, "sample", "sample")
    if engine.runner.graphs is not None:
        host.watch(engine.runner.graphs, "run", "decode_graph_run")
        host.watch(engine.runner.graphs.inputs, "upload", "upload")
    with host:
        while engine.has_unfinished_requests():
            iteration_start = time.perf_counter()
            outputs = engine.step()
            now = time.perf_counter()
            if profiler is not None:
                profiler.step(engine.last_plan)
            for out in outputs:
                record = records[out.request_id]
                record["tokens"] += [now] * len(out.outputs[0].delta_token_ids)
                record["ok"] = out.finished
            host.iteration(iteration_start, len(engine.last_plan.seqs) if engine.last_plan else 0)
    wall = time.perf_counter() - start
    if profiler is not None:
        profiler.stop()
    extra = {"profiled": profiler is not None, "kv_blocks": engine.block_manager.num_blocks, "preemptions": engine.scheduler.num_preemptions_total,
             "async_scheduling": engine.configs.async_scheduling, "fused_gemv_rows": engine.configs.fused_gemv_rows,
             "dependent_launch": engine.configs.dependent_launch, "measured_tiles": engine.configs.measured_tiles,
             "pinned_tiles": args.pin_tiles, "prefix_hit_tokens": engine.block_manager.prefix_hit_tokens, "triton_compiles_in_run": compiles,
             "host": host.summary()}
    if timeline is not None:
        from bento_pagedllm.kernels import gemv

        extra["gpu_timeline"] = idle_fraction(timeline)
        extra["tuned_configs"] = gemv.tuned_configs()  # NOTE: re-made (and may differ) in every process
    engine.shutdown()  # the tensor-parallel workers, if any
    return report(list(records.values()), wall, extra)


_ABSENT = object()


def _type_counts(objects, top: int = 12) -> dict[str, int]:
    """The most common types among `objects` (module.qualname: count)."""
    counts = collections.Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in objects)
    return dict(counts.most_common(top))


def _function_sites(objects, top: int = 8) -> dict[str, int]:
    """Where the functions among `objects` were defined (file:line qualname: count): the code that made
    the closures found in reference cycles."""
    counts = collections.Counter(f"{o.__code__.co_filename}:{o.__code__.co_firstlineno} {o.__qualname__}"
                                 for o in objects if isinstance(o, types.FunctionType))
    return dict(counts.most_common(top))


def _tuple_shapes(objects, top: int = 8) -> dict[str, int]:
    """The tuples among `objects` by their elements' types (the first four): what made them shows in
    what they hold."""
    def shape(t: tuple) -> str:
        return "(" + ", ".join(type(x).__name__ for x in t[:4]) + (", ..." if len(t) > 4 else "") + ")"

    return dict(collections.Counter(shape(o) for o in objects if type(o) is tuple).most_common(top))


def _samples(objects, kind: type, count: int = 6, width: int = 160) -> list[str]:
    """The reprs of a few of the `kind` objects among `objects`, cut at `width` characters (spread over the
    list: the garbage of the whole run, in the order the passes found it)."""
    chosen = [o for o in objects if type(o) is kind]
    step = max(1, len(chosen) // count)
    return [repr(o)[:width] for o in chosen[::step][:count]]


class HostClock:
    """The host's side of the offline loop: how long each iteration (engine.step() and reading its outputs)
    took, and the garbage collector's passes in it. Beside `gpu_timeline.longest_idle_gaps` (the same
    step indices: one launch an iteration) it says whether the device waited on a slow iteration, and on
    what: `watch` times named methods of the engine's parts (schedule, prepare, launch, the wait for the
    device, ...) within each iteration, and the longest iterations report those phases and whether the
    CUDA allocator took or gave back memory in them (`reserved_mb`: a cudaMalloc or a cudaFree, which may
    synchronise the device)."""

    def __init__(self, gc_debug: bool = False) -> None:
        self.iterations_ms: list[float] = []
        self.phases: list[dict[str, float]] = []
        self.reserved_mb: list[float] = []
        self.num_seqs: list[int] = []
        self._watched: list[tuple[object, str, object]] = []  # (owner, name, its own attribute or _ABSENT)
        self._current: dict[str, float] = {}
        self._reserved = self._reserved_mb()
        self.gc_count, self.gc_ms, self.gc_longest_ms = [0, 0, 0], [0.0, 0.0, 0.0], 0.0
        self._gc_start = 0.0
        # `gc_debug`: each pass's objects by type, and the cyclic garbage the passes found (the run slows)
        self.gc_debug, self.gc_passes, self.gc_garbage = gc_debug, [], None

    @staticmethod
    def _reserved_mb() -> float:
        import torch

        if not torch.cuda.is_initialized():
            return 0.0
        # NOTE: not torch.cuda.memory_reserved(): its memory_stats() flattens the stats through a recursive
        # closure, a reference cycle with ~120 tuples a call: every iteration of the run left them for the
        # collector (the cyclic garbage `--gc-debug` found, h200-2026-12-02h run 1)
        return torch.cuda.memory_stats_as_nested_dict()["reserved_bytes"]["all"]["current"] / 2**20

    def watch(self, owner, method: str, label: str | None = None) -> None:
        """Time `owner.method` (an instance's, wrapped on the instance alone; or a module's function) as
        phase `label` of the iteration it runs in; nested phases each count their own time, their parent's
        included. Leaving the clock's `with` block puts every watched attribute back."""
        inner = getattr(owner, method)
        label = label or method
        self._watched.append((owner, method, vars(owner).get(method, _ABSENT)))

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self._current[label] = self._current.get(label, 0.0) + (time.perf_counter() - started) * 1e3

        setattr(owner, method, timed)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            if self.gc_debug:  # what the pass is about to traverse, by type (before the clock starts)
                objects = gc.get_objects(info["generation"])
                self.gc_passes.append({"step": len(self.iterations_ms), "generation": info["generation"],
                                       "objects": len(objects), "types": _type_counts(objects)})
                del objects
            self._gc_start = time.perf_counter()
            return
        ms = (time.perf_counter() - self._gc_start) * 1e3
        generation = info["generation"]
        self.gc_count[generation] += 1
        self.gc_ms[generation] += ms
        self.gc_longest_ms = max(self.gc_longest_ms, ms)
        if self.gc_debug:
            self.gc_passes[-1].update(ms=round(ms, 3), collected=info["collected"])

    def __enter__(self) -> "HostClock":
        gc.callbacks.append(self._on_gc)
        if self.gc_debug:  # NOTE: the collector keeps what it finds unreachable in gc.garbage, to count it
            self._gc_flags = gc.get_debug()
            gc.set_debug(self._gc_flags | gc.DEBUG_SAVEALL)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._on_gc)
        if self.gc_debug:
            gc.set_debug(self._gc_flags)
            self.gc_garbage = {"objects": len(gc.garbage), "types": _type_counts(gc.garbage),
                               "functions": _function_sites(gc.garbage), "tuples": _samples(gc.garbage, tuple),
                               "tuple_shapes": _tuple_shapes(gc.garbage)}
            gc.garbage.clear()
        for owner, method, own in reversed(self._watched):
            if own is _ABSENT:
                delattr(owner, method)  # the class's method shows through again
            else:
                setattr(owner, method, own)
        self._watched.clear()

    def iteration(self, started: float, num_seqs: int = 0) -> None:
        """An iteration ended; `num_seqs`: the sequences of the step it launched (for `by_seqs`)."""
        self.iterations_ms.append((time.perf_counter() - started) * 1e3)
        self.num_seqs.append(num_seqs)
        self.phases.append(self._current)
        self._current = {}
        reserved = self._reserved_mb()
        self.reserved_mb.append(reserved - self._reserved)
        self._reserved = reserved

    def _iteration(self, i: int) -> dict:
        entry = {"step": i, "ms": round(self.iterations_ms[i], 3)}
        if i < len(self.phases) and self.phases[i]:
            entry["phases_ms"] = {label: round(ms, 3) for label, ms in self.phases[i].items()}
        return entry

    def summary(self, count: int = 12) -> dict:
        ms = sorted(self.iterations_ms)
        return {"iterations": len(ms), "median_ms": ms[len(ms) // 2] if ms else None,
                "p90_ms": ms[int(0.9 * (len(ms) - 1))] if ms else None,
                "longest": [self._iteration(i) for i in longest(self.iterations_ms, count)],
                "median_phases_ms": {label: round(statistics.median(p.get(label, 0.0) for p in self.phases), 3)
                                     for label in sorted({k for p in self.phases for k in p})},
                "reserved_changes": [{"step": i, "mb": round(mb, 1)} for i, mb in enumerate(self.reserved_mb) if mb],
                "gc_collections": self.gc_count, "gc_ms": [round(v, 2) for v in self.gc_ms],
                "gc_longest_ms": round(self.gc_longest_ms, 3), "by_seqs": self.by_seqs(),
                **({"gc_passes": self.gc_passes, "gc_garbage": self.gc_garbage} if self.gc_debug else {})}

    # NOTE: time in these phases is the model's or the device's, not the host's own work ("sample" is
    # watched on the CPU only)
    NOT_HOST = ("forward", "logits", "wait", "sample")
    SEQ_BUCKETS = ((1, 32), (33, 128), (129, 256), (257, 512), (513, 1 << 30))

    def by_seqs(self) -> list[dict]:
        """Per bucket of launched sequences: iterations, their median, median phases, and the median host
        work a sequence (`host_us_per_seq`: the iteration less NOT_HOST's phases, over its sequences)
        -- where the host may fall behind the device (a big step's host work grows with its sequences)."""
        buckets = []
        for low, high in self.SEQ_BUCKETS:
            chosen = [i for i, n in enumerate(self.num_seqs) if low <= n <= high]
            if not chosen:
                continue
            host_us = [1e3 * (self.iterations_ms[i] - sum(self.phases[i].get(p, 0.0) for p in self.NOT_HOST))
                       / self.num_seqs[i] for i in chosen]
            labels = sorted({k for i in chosen for k in self.phases[i]})
            buckets.append({"seqs": f"{low}-{high}" if high < 1 << 30 else f"{low}+", "iterations": len(chosen),
                            "median_ms": round(statistics.median(self.iterations_ms[i] for i in chosen), 3),
                            "host_us_per_seq": round(statistics.median(host_us), 2),
                            "median_phases_ms": {label: round(statistics.median(self.phases[i].get(label, 0.0)
                                                                                for i in chosen), 3)
                                                 for label in labels}})
        return buckets


class RunProfiler:
    """torch.profiler over the timed run, the device's activity only (the CPU's without CUDA): tables of
    where the device time goes, by kernel. Without windows, one table for the whole run; with windows
    (start step, step count), one table per window, headed by its steps' (sequences, tokens), so a step
    shape's kernels can be read apart (kernels of a launched step run during the next host step: a window
    of steps of one shape is what to read; each window's trace is also written beside the table, as
    PATH.stepsA-B.trace.json, for bench/step_gaps.py). NOTE: the profiler slows the host a little: a profiled run's
    throughput is not a figure."""

    def __init__(self, path: str, windows: list[tuple[int, int]]) -> None:
        import torch
        from torch.profiler import ProfilerAction, ProfilerActivity, profile

        def action(step: int) -> "ProfilerAction":
            for start, count in windows:
                if step == start - 1:
                    return ProfilerAction.WARMUP
                if start <= step < start + count - 1:
                    return ProfilerAction.RECORD
                if step == start + count - 1:
                    return ProfilerAction.RECORD_AND_SAVE
            return ProfilerAction.NONE

        self.path, self.windows, self.saved = path, windows, 0
        self.sizes: list[tuple[int, int]] = []  # (sequences, tokens) of each step's plan
        activity = ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU
        self.profiler = profile(activities=[activity], schedule=action if windows else None,
                                on_trace_ready=self._save_window if windows else None)
        self.profiler.start()

    def step(self, plan) -> None:
        self.sizes.append((len(plan.seqs), plan.num_batched_tokens))
        if self.windows:
            self.profiler.step()

    def stop(self) -> None:
        self.profiler.stop()
        if not self.windows:
            with open(self.path, "w") as f:
                f.write(self.profiler.key_averages().table(sort_by="cuda_time_total", row_limit=50))

    def _save_window(self, profiler) -> None:
        start, count = self.windows[self.saved]
        self.saved += 1
        with open(self.path, "a" if self.saved > 1 else "w") as f:
            f.write(f"== steps {start}..{start + count - 1}, (sequences, tokens): {self.sizes[start:start + count]}\n")
            f.write(profiler.key_averages().table(sort_by="cuda_time_total", row_limit=30) + "\n")
        profiler.export_chrome_trace(f"{self.path}.steps{start}-{start + count - 1}.trace.json")


def warm_up_requests(requests: list[dict], count: int = 64) -> list[dict]:
    """Random prompts with the lengths of the workload's first `count` requests, 16 tokens each: they compile
    the kernel variants the run will meet (Triton specialises on tile sizes and on which integer arguments
    are 1 or multiples of 16; a cold first run paid seconds of compiling inside its clock), and share no
    prefix with the workload, so the prefix cache holds nothing it could hit."""
    import random

    rng = random.Random(1234)
    return [{"id": f"warmup-{i}", "prompt_ids": [rng.randrange(10, 30000) for _ in range(len(r["prompt_ids"]))],
             "max_tokens": 16} for i, r in enumerate(requests[:count])]


def warm_up(engine, requests: list[dict]) -> None:
    """Run `warm_up_requests` to completion before the clock starts."""
    from bento_pagedllm import SamplingParams

    for r in warm_up_requests(requests):
        engine.add_request(r["id"], r["prompt_ids"],
                           SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def run_transformers(args, requests) -> dict:
    """The peer: transformers' continuous batching manager (what `generate_batch` drives), all requests at
    t=0, each with its own max_new_tokens, bfloat16 on the GPU."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(args.model_path)
    with torch.device("cuda"):  # NOTE: random init on the GPU: a minute on the CPU for a 7B model
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    generation = GenerationConfig(do_sample=False, max_new_tokens=max(r["max_tokens"] for r in requests),
                                  eos_token_id=-1, pad_token_id=0)  # NOTE: -1: no token ends a request early
    manager = model.init_continuous_batching(generation_config=generation)
    manager.start()
    try:
        records = {}
        start = time.perf_counter()
        for r in requests:
            request_id = manager.add_request(r["prompt_ids"], request_id=str(r["id"]), max_new_tokens=r["max_tokens"])
            records[request_id] = {"ok": False, "start": start, "tokens": [], "prompt_len": len(r["prompt_ids"])}
        pending = set(records)
        while pending:
            if args.deadline and time.perf_counter() - start > args.deadline:
                break  # NOTE: the requests still pending count as failed; the JSON says how many
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    break
                continue
            if result.is_finished() and result.request_id in pending:
                pending.discard(result.request_id)
                if len(pending) % 50 == 0:
                    print(f"transformers: {len(pending)} left after {time.perf_counter() - start:.1f} s", flush=True)
                now = time.perf_counter()
                record = records[result.request_id]
                record["ok"] = True
                # NOTE: without streaming only the finish time is known: TTFT and latencies are end-to-end
                record["tokens"] = [now] * len(result.generated_tokens)
        wall = time.perf_counter() - start
    finally:
        # NOTE: past a deadline the thread would finish the pending requests first: not waited for (the
        # caller writes the JSON, then its time limit ends the process)
        manager.stop(block=not args.deadline)
    return report(list(records.values()), wall, {"peer": "transformers continuous batching",
                                                 "unfinished": len(pending), "deadline_s": args.deadline,
                                                 "transformers": __import__("transformers").__version__})


LAG_PROBE_S = 0.001


async def _probe_loop_lag(lags: list[float]) -> None:
    """How late the client's event loop wakes a 1 ms sleep, over and over: a busy client delays every
    timestamp it takes, so its lag is part of what the latencies measure (seconds, appended to `lags`)."""
    while True:
        asked = time.perf_counter()
        await asyncio.sleep(LAG_PROBE_S)
        lags.append(time.perf_counter() - asked - LAG_PROBE_S)


async def replay(requests, send) -> tuple[list[dict], float, dict]:
    """Send each request at its arrival time; `send(request, record)` fills the record. Also returns the
    client's event-loop lag during the replay (ms: mean, median, p99)."""
    lags: list[float] = []
    probe = asyncio.create_task(_probe_loop_lag(lags))
    start = time.perf_counter()

    async def one(r):
        delay = r["arrival_s"] - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        record = {"ok": False, "start": time.perf_counter(), "tokens": [], "prompt_len": len(r["prompt_ids"])}
        try:
            await send(r, record)
        except Exception as error:  # noqa: BLE001 - a failed request is counted, not fatal
            record["error"] = repr(error)
        return record

    records = await asyncio.gather(*(one(r) for r in requests))
    wall = time.perf_counter() - start
    probe.cancel()
    return list(records), wall, {name: None if value is None else value * 1e3 for name, value in stats(lags).items()}


def run_async(args, requests) -> dict:
    """The in-process AsyncLLMEngine (no HTTP); with --engine-process its engine runs in a child process."""
    from bento_pagedllm import AsyncLLMEngine, EngineArgs, SamplingParams
    from bento_pagedllm.async_engine import EngineObserver

    class Totals(EngineObserver):
        def __init__(self) -> None:
            self.stats, self.preemptions = None, 0

        def observe(self, report) -> None:
            self.stats, self.preemptions = report.stats, self.preemptions + report.num_preempted

    totals = Totals()
    engine = AsyncLLMEngine(EngineArgs(model=args.model_path, **engine_kwargs(args)), observer=totals,
                            engine_process=args.engine_process)

    async def send(r, record):
        params = SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True)
        async for out in engine.generate(r["prompt_ids"], params, request_id=str(r["id"])):
            record["tokens"] += [time.perf_counter()] * len(out.outputs[0].delta_token_ids)
            record["ok"] = out.finished

    async def main():
        await asyncio.gather(*(send(r, {"tokens": []}) for r in warm_up_requests(requests)))
        warm_hits = totals.stats.prefix_hit_tokens
        records, wall, lag = await replay(requests, send)
        return records, wall, lag, warm_hits

    preempted_before = totals.preemptions
    records, wall, lag, warm_hits = asyncio.run(main())
    engine.shutdown()  # the engine process or the tensor-parallel workers, if any
    return report(records, wall, {"kv_blocks": totals.stats.kv_blocks_total,
                                  "preemptions": totals.preemptions - preempted_before,
                                  "prefix_hit_tokens": totals.stats.prefix_hit_tokens - warm_hits,
                                  "prefix_caching": not args.no_prefix_caching,
                                  "engine_process": args.engine_process, "client_loop_lag_ms": lag})


def run_online(args, requests) -> dict:
    """Streaming completions through aiohttp (as `vllm bench serve` does: httpx's streaming costs several
    times more client CPU per event). Output tokens are counted from the final usage chunk; the time of
    each SSE event stands for its tokens' arrival."""
    import aiohttp

    async def main():
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        timeout = aiohttp.ClientTimeout(total=None)
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        async with aiohttp.ClientSession(args.url, connector=connector, timeout=timeout, headers=headers) as client:
            async def send(r, record):
                body = {"model": args.model, "prompt": r["prompt_ids"], "max_tokens": r["max_tokens"],
                        "temperature": 0.0, "ignore_eos": True, "stream": not args.no_stream}
                if args.no_stream:  # one JSON answer: every token "arrives" with it
                    async with client.post("/v1/completions", json=body) as response:
                        response.raise_for_status()
                        answer = await response.json()
                    record["tokens"].append(time.perf_counter())
                    record["output_tokens"] = answer["usage"]["completion_tokens"]
                    record["ok"] = True
                    return
                body["stream_options"] = {"include_usage": True}
                async with client.post("/v1/completions", json=body) as response:
                    response.raise_for_status()
                    async for line in response.content:  # one SSE line at a time
                        if not line.startswith(b"data: "):
                            continue
                        if line.startswith(b"data: [DONE]"):
                            record["ok"] = True
                            break
                        chunk = json.loads(line[6:])
                        if chunk.get("usage"):
                            record["output_tokens"] = chunk["usage"]["completion_tokens"]
                        if chunk["choices"] and chunk["choices"][0]["text"] is not None:
                            record["tokens"].append(time.perf_counter())
            # the server's first requests compile kernel variants: not inside the clock (as offline)
            await asyncio.gather(*(send(r, {"tokens": []}) for r in warm_up_requests(requests)))
            return await replay(requests, send)

    cpu = time.process_time()
    records, wall, lag = asyncio.run(main())
    return report(records, wall, {"client_cpu_s": time.process_time() - cpu, "client_loop_lag_ms": lag})


def main() -> None:
    from single_stream import add_tile_arguments, apply_tile_arguments

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["offline", "async", "online", "transformers"], required=True)
    parser.add_argument("--requests", required=True, help="JSONL from ../shared/bench/workload.py")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--shape", default=None, help="dummy weights of a named shape (bench/single_stream.py)")
    parser.add_argument("--model-path", default=None, help="a model dir or .gguf (instead of --shape)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--shared-prefix-tokens", type=int, default=0,
                        help="prepend the same N random tokens (a system prompt) to every request")
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-graph-batch", type=int, default=None)
    parser.add_argument("--sync-scheduling", action="store_true", help="read each step before planning the next")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="GPUs (ranks) the model is split over (offline and async modes)")
    parser.add_argument("--peer-all-reduce", action="store_true", help="tensor parallelism: small all-reduces through peer memory")
    parser.add_argument("--no-quiet-gc", action="store_true", help="leave Python's garbage collector as it is")
    parser.add_argument("--fused-gemv-rows", type=int, default=None,
                        help="EngineArgs.fused_gemv_rows: steps of up to this many tokens project with kernels/gemv.py")
    parser.add_argument("--no-dependent-launch", action="store_true",
                        help="EngineArgs.dependent_launch=False: decode kernels in plain stream order")
    parser.add_argument("--engine-process", action="store_true",
                        help="async: the engine in a child process (what the service does on CUDA)")
    parser.add_argument("--no-stream", action="store_true",
                        help="online: non-streaming requests (one write per request: isolates the per-token cost of SSE)")
    add_tile_arguments(parser)
    parser.add_argument("--url", default="http://127.0.0.1:3000")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="served model name (online)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--gc-debug", action="store_true",
                        help="offline: each garbage-collector pass's objects by type, and the cyclic garbage found")
    parser.add_argument("--profile", default=None, help="offline: write a table of the device's kernels over the run here")
    parser.add_argument("--profile-window", action="append", default=[], metavar="START:COUNT",
                        help="with --profile: a table for these steps alone (repeatable)")
    parser.add_argument("--deadline", type=float, default=None,
                        help="transformers: stop after this many seconds and report the requests finished by then")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    args.tile_options = apply_tile_arguments(args)  # NOTE: in-process modes (online: the service's engine)
    if args.shape:
        args.model_path = shape_dir(args.shape)
    requests = load(args.requests, args.limit)
    if args.shared_prefix_tokens:
        shared = shared_prefix(args.shared_prefix_tokens)
        requests = [dict(r, prompt_ids=shared + r["prompt_ids"]) for r in requests]
    run = {"offline": run_offline, "async": run_async, "online": run_online, "transformers": run_transformers}[args.mode]
    result = {"date": datetime.date.today().isoformat(), "mode": args.mode, "requests_file": args.requests,
              "num_requests": len(requests), "shape": args.shape,
              "tensor_parallel_size": args.tensor_parallel_size, "stream": not args.no_stream, **run(args, requests)}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
