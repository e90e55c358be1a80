"""The engine's Prometheus metrics, registered through `bentoml.metrics` so they appear on /metrics.

`EngineMetrics.observe` runs after every pass of the engine loop, on the thread that routes its outputs
(prometheus_client is thread-safe), with the loop's report: the engine's counts, the tokens generated and
the requests ended, with their timings. Every request the engine
admits ends in exactly one of finished, aborted, timed out or failed, so after a run
`finished + aborted + timed_out + failed` equals the requests admitted: nothing is lost without a count.
`live_gauges` renders, at scrape time on the event loop, what only the event loop knows (open streams, tasks).

The measurements that dashboards and autoscalers built for vLLM read (its Grafana dashboard, KEDA scaling on
`vllm:num_requests_waiting`) are also exported under vLLM's names, with the same `model_name` label.
"""

from __future__ import annotations

import asyncio

from .async_engine import AsyncLLMEngine, EngineObserver
from .engine_loop import EngineReport

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                    1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _Twins:
    """One measurement under several names (ours, and vLLM's): what is set, counted or observed goes to all."""

    def __init__(self, *children) -> None:
        self._children = children

    def set(self, value: float) -> None:
        for child in self._children:
            child.set(value)

    def inc(self, amount: float = 1) -> None:
        for child in self._children:
            child.inc(amount)

    def observe(self, value: float) -> None:
        for child in self._children:
            child.observe(value)


class EngineMetrics(EngineObserver):
    def __init__(self, model_name: str) -> None:
        from bentoml import metrics

        labels = ["model_name"]

        def named(kind, names, doc, **options):
            """The metric under each of `names` (ours first, then vLLM's), as one."""
            children = [kind(name=name, documentation=doc, labelnames=labels, **options).labels(model_name=model_name)
                        for name in names]
            return children[0] if len(children) == 1 else _Twins(*children)

        # NOTE: BentoML runs prometheus_client in multiprocess mode; gauges must say how to merge workers.
        def gauge(*names, doc):
            return named(metrics.Gauge, names, doc, multiprocess_mode="livemax")

        def counter(*names, doc):  # NOTE: prometheus_client appends `_total` to a counter's name
            return named(metrics.Counter, names, doc)

        def histogram(*names, doc):
            return named(metrics.Histogram, names, doc, buckets=_LATENCY_BUCKETS)

        self.requests_running = gauge("pagedllm_requests_running", "vllm:num_requests_running",
                                      doc="Sequences in the running batch")
        self.requests_waiting = gauge("pagedllm_requests_waiting", "vllm:num_requests_waiting",
                                      doc="Sequences waiting to be scheduled")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", doc="KV cache usage (1: every block in use)")
        self.requests_unfinished = gauge("pagedllm_requests_unfinished", doc="Requests the engine holds")
        self.kv_blocks_used = gauge("pagedllm_kv_blocks_used", doc="KV cache blocks in use")
        self.kv_blocks_total = gauge("pagedllm_kv_blocks_total", doc="KV cache blocks in the pool")
        self.prompt_tokens = counter("pagedllm_prompt_tokens", "vllm:prompt_tokens",
                                     doc="Prompt tokens of finished requests")
        self.generation_tokens = counter("pagedllm_generation_tokens", "vllm:generation_tokens", doc="Tokens generated")
        self.preemptions = counter("pagedllm_preemptions", "vllm:num_preemptions",
                                   doc="Sequences preempted for lack of KV blocks")
        self.requests_finished = counter("pagedllm_requests_finished", doc="Requests finished (not aborted)")
        self.requests_aborted = counter("pagedllm_requests_aborted", doc="Requests aborted (client gone, shutdown)")
        self.requests_timed_out = counter("pagedllm_requests_timed_out",
                                          doc="Requests aborted for running past the time limit")
        self.requests_failed = counter("pagedllm_requests_failed", doc="Requests that failed inside the engine")
        self.requests_rejected = counter("pagedllm_requests_rejected",
                                         doc="Requests refused at admission because too many were waiting")
        self.prefix_cache_queries = counter("pagedllm_prefix_cache_queries", "vllm:prefix_cache_queries",
                                            doc="Prompt tokens looked up in the prefix cache")
        self.prefix_cache_hits = counter("pagedllm_prefix_cache_hits", "vllm:prefix_cache_hits",
                                         doc="Prompt tokens found in the prefix cache")
        self._prefix_seen = (0, 0)
        self.time_to_first_token = histogram("pagedllm_time_to_first_token_seconds", "vllm:time_to_first_token_seconds",
                                             doc="Time to first token")
        # NOTE: vLLM's per-request mean is `request_time_per_output_token_seconds` (its
        # `time_per_output_token_seconds` observes each token's interval)
        self.time_per_output_token = histogram("pagedllm_time_per_output_token_seconds",
                                               "vllm:request_time_per_output_token_seconds",
                                               doc="Mean time per output token after the first, per request")
        self.request_latency = histogram("pagedllm_e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds",
                                         doc="Time from a request's arrival to its end, per finished request")

    def observe(self, report: EngineReport) -> None:
        stats = report.stats
        self.requests_running.set(stats.num_running)
        self.requests_waiting.set(stats.num_waiting)
        self.requests_unfinished.set(stats.num_unfinished)
        self.kv_blocks_used.set(stats.kv_blocks_used)
        self.kv_blocks_total.set(stats.kv_blocks_total)
        self.kv_cache_usage.set(stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0)
        queries, hits = stats.prefix_query_tokens, stats.prefix_hit_tokens
        if (queries, hits) != self._prefix_seen:
            self.prefix_cache_queries.inc(queries - self._prefix_seen[0])
            self.prefix_cache_hits.inc(hits - self._prefix_seen[1])
            self._prefix_seen = (queries, hits)
        for counter, count in ((self.preemptions, report.num_preempted),
                               (self.generation_tokens, report.generated_tokens),
                               (self.requests_finished, len(report.finished)),
                               (self.requests_failed, report.num_failed),
                               (self.requests_aborted, report.num_aborted),
                               (self.requests_timed_out, report.num_timed_out)):
            if count:
                counter.inc(count)
        for done in report.finished:
            self.prompt_tokens.inc(done.prompt_tokens)
            if done.time_to_first_token is not None:
                self.time_to_first_token.observe(done.time_to_first_token)
            if done.time_per_output_token is not None:
                self.time_per_output_token.observe(done.time_per_output_token)
            if done.latency is not None:
                self.request_latency.observe(done.latency)

    def observe_rejection(self) -> None:
        self.requests_rejected.inc()


def live_gauges(engine: AsyncLLMEngine, model_name: str) -> str:
    """Prometheus text for what the serving event loop holds now: engine streams open and asyncio tasks.

    NOTE: call it on the event loop that serves the requests (BentoML's `__metrics__` hook runs there);
    after a run both return to their idle values, which shows no stream or task was left behind.
    """
    label = model_name.replace("\\", "\\\\").replace('"', '\\"')
    gauges = (
        ("pagedllm_open_streams", "Engine request streams the event loop holds open", engine.num_open_streams),
        ("pagedllm_event_loop_tasks", "Asyncio tasks alive on the serving event loop", len(asyncio.all_tasks())),
    )
    return "".join(f"# HELP {name} {doc}\n# TYPE {name} gauge\n{name}{{model_name=\"{label}\"}} {value}\n"
                   for name, doc, value in gauges)
