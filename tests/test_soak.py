"""The soak, then security and a graceful shutdown, on one real `bentoml serve service:svc` (default model, CPU).

64 concurrent streaming clients (soak.py) for PAGEDLLM_SOAK_SECONDS (40 s in `make test`; README's figures come
from a run of several minutes: `PAGEDLLM_SOAK_SECONDS=600 PAGEDLLM_SOAK_REPORT=soak.json pytest tests/test_soak.py`).
The server runs with an API key, a cap on waiting requests, a time limit per request, the fault-injection hook
and CORS for one origin. After the run, /metrics must show nothing left behind (requests, KV blocks, streams,
event-loop tasks) and account for every admitted request; the worker's memory must have stopped growing.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import subprocess
import threading
import time

import httpx
import psutil
import pytest
from bad_inputs import bad_inputs
from server_helpers import MODEL, BentoServer
from soak import DISCONNECT_OUTCOMES, FAULT_SEED, SoakPlan, run_soak

SOAK_SECONDS = float(os.environ.get("PAGEDLLM_SOAK_SECONDS", "40"))
CLIENTS = int(os.environ.get("PAGEDLLM_SOAK_CLIENTS", "64"))
REPORT = os.environ.get("PAGEDLLM_SOAK_REPORT")
API_KEY = "soak-secret-key-5b0c9e"
WRONG_KEY = "soak-wrong-key-77aa31"
REQUEST_TIMEOUT_S = 30
GRACE_S = 6
MAX_MODEL_LEN = 2048
MAX_WAITING = 48
ALLOWED_ORIGIN = "https://allowed.example"
SERVER_ENV = {
    "PAGEDLLM_NUM_KV_BLOCKS": "512", "PAGEDLLM_MAX_MODEL_LEN": str(MAX_MODEL_LEN),
    "PAGEDLLM_MAX_WAITING_REQUESTS": str(MAX_WAITING), "PAGEDLLM_REQUEST_TIMEOUT_SECONDS": str(REQUEST_TIMEOUT_S),
    "PAGEDLLM_SHUTDOWN_GRACE_SECONDS": str(GRACE_S), "PAGEDLLM_FAULT_INJECTION_SEED": str(FAULT_SEED),
    "PAGEDLLM_FAULT_INJECTION_AFTER_TOKENS": "2", "PAGEDLLM_CORS_ALLOW_ORIGINS": ALLOWED_ORIGIN,
    # NOTE: the engine in its own process, as on CUDA (conftest's session server keeps the CPU default, a
    # thread), so faults, time limits and the SIGTERM drain are tested through both
    "PAGEDLLM_ENGINE_PROCESS": "true",
}
COUNTERS = ["pagedllm_requests_finished_total", "pagedllm_requests_aborted_total",
            "pagedllm_requests_timed_out_total", "pagedllm_requests_failed_total",
            "pagedllm_requests_rejected_total", "pagedllm_generation_tokens_total"]
IDLE_GAUGES = ["pagedllm_requests_unfinished", "pagedllm_requests_running", "pagedllm_requests_waiting",
               "pagedllm_kv_blocks_used", "pagedllm_open_streams", "pagedllm_event_loop_tasks"]
pytestmark = pytest.mark.timeout(max(900, SOAK_SECONDS * 3 + 600))


@pytest.fixture(scope="module")
def server(smollm2_model, tmp_path_factory):
    server = BentoServer.start(tmp_path_factory.mktemp("soak"), API_KEY, SERVER_ENV)
    yield server
    server.stop()


def tree_rss(process) -> int:
    """Resident bytes of a process and its children (the engine process)."""
    return sum(p.memory_info().rss for p in [process, *process.children(recursive=True)])


class MemorySampler:
    """The serving worker's resident memory with its engine process's, sampled every second on a thread
    while the soak runs."""

    def __init__(self, server: BentoServer) -> None:
        self.worker = server.worker()
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "MemorySampler":
        self._start = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self.samples.append((time.monotonic() - self._start, tree_rss(self.worker)))

    def mib_at(self, fraction: float) -> float:
        """The largest resident size up to `fraction` of the run, in MiB."""
        end = self.samples[-1][0] * fraction
        return max(rss for t, rss in self.samples if t <= end) / 2**20


def wait_until_idle(server: BentoServer, tasks_when_idle: float, timeout: float = 60) -> dict[str, float]:
    """The idle gauges once nothing is left, or what is left after `timeout`."""
    deadline = time.time() + timeout
    while True:
        gauges = server.metrics(IDLE_GAUGES)
        idle = all(gauges[name] == 0 for name in IDLE_GAUGES[:-1])
        if (idle and gauges["pagedllm_event_loop_tasks"] == tasks_when_idle) or time.time() > deadline:
            return gauges
        time.sleep(0.5)


def test_soak(server):
    server.wait_idle()
    idle_before = server.metrics(IDLE_GAUGES)
    before = server.metrics(COUNTERS)
    cases = bad_inputs(MODEL, max_body_bytes=4 << 20, vocab_size=49152, model_path="/models/smollm2")
    plan = SoakPlan(server.base, API_KEY, CLIENTS, SOAK_SECONDS, REQUEST_TIMEOUT_S, MAX_MODEL_LEN, cases)
    start = time.monotonic()
    with MemorySampler(server) as memory:
        tally = asyncio.run(run_soak(plan))
    held_s = time.monotonic() - start
    idle_after = wait_until_idle(server, idle_before["pagedllm_event_loop_tasks"])
    after = server.metrics(COUNTERS)
    delta = {name: after[name] - before[name] for name in COUNTERS}
    outcomes = tally.outcomes
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": f"PAGEDLLM_SOAK_SECONDS={SOAK_SECONDS:g} pytest tests/test_soak.py",
        "clients": CLIENTS, "seconds_requested": SOAK_SECONDS, "seconds_held": round(held_s, 1),
        "requests": tally.requests, "outcomes": dict(sorted(outcomes.items())), "endpoints": dict(tally.paths),
        "disconnects": sum(outcomes[name] for name in DISCONNECT_OUTCOMES),
        "injected_faults_survived": outcomes["failed_as_injected"], "timeouts": outcomes["timed_out"],
        "rejected_503": outcomes["rejected"], "bad_inputs_tried": outcomes["bad_input_refused"],
        "requests_lost": len(tally.lost), "lost": tally.lost[:20],
        "kv_blocks_leaked": idle_after["pagedllm_kv_blocks_used"],
        "requests_left": idle_after["pagedllm_requests_unfinished"],
        "streams_left": idle_after["pagedllm_open_streams"],
        "tasks_left": idle_after["pagedllm_event_loop_tasks"] - idle_before["pagedllm_event_loop_tasks"],
        "tokens_generated": int(delta["pagedllm_generation_tokens_total"]),
        "metrics_delta": {name.removeprefix("pagedllm_requests_").removesuffix("_total"): int(value)
                          for name, value in delta.items() if name.startswith("pagedllm_requests_")},
        "admitted": tally.admitted,
        "worker_rss_mib": {"after_first_third": round(memory.mib_at(1 / 3), 1),
                           "peak": round(memory.mib_at(1.0), 1),
                           "idle_after": round(tree_rss(server.worker()) / 2**20, 1)},
    }
    print("\nsoak report:", json.dumps(report, indent=1))
    if REPORT:
        with open(REPORT, "w") as f:
            json.dump(report, f, indent=1)

    # nothing lost: every request ended complete or with a clean error, and the clients tried every behaviour
    assert tally.lost == [], tally.lost[:10]
    assert outcomes["complete"] > CLIENTS and outcomes["failed_as_injected"] > 0 and report["disconnects"] > 0
    assert outcomes["bad_input_refused"] > 0 and len(tally.paths) == 3  # completions, chat, responses
    # nothing left behind, by /metrics: no request, KV block, stream or event-loop task
    assert report["kv_blocks_leaked"] == 0 and report["requests_left"] == 0 and report["streams_left"] == 0
    assert report["tasks_left"] == 0 and idle_after["pagedllm_requests_running"] == 0
    # every admitted request ended exactly one way, and the server counted each failure and refusal
    ended = sum(delta[f"pagedllm_requests_{how}_total"] for how in ("finished", "aborted", "timed_out", "failed"))
    assert ended == tally.admitted, (delta, tally.admitted)
    assert delta["pagedllm_requests_failed_total"] == outcomes["failed_as_injected"]
    assert delta["pagedllm_requests_rejected_total"] == outcomes["rejected"]
    assert delta["pagedllm_requests_timed_out_total"] >= outcomes["timed_out"]
    assert delta["pagedllm_requests_aborted_total"] <= report["disconnects"]
    # memory stopped growing: the last two thirds added little to what the first third reached
    rss = report["worker_rss_mib"]
    assert rss["peak"] <= rss["after_first_third"] * 1.2 + 64, rss
    assert server.get("/readyz").status_code == 200


PATHS = ("/v1/models", "/v1/nope", "/v1/openapi.json", "/readyz", "/livez", "/healthz", "/health", "/metrics", "/",
         "/docs.json")


def test_every_route_needs_the_key_health_and_metrics_included(server):
    for path in PATHS:
        for headers in ({}, {"Authorization": f"Bearer {WRONG_KEY}"}, {"Authorization": API_KEY}):
            r = httpx.get(server.base + path, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, headers)
            assert API_KEY not in r.text
    for path in ("/v1/models", "/v1/openapi.json", "/readyz", "/health", "/metrics"):
        assert server.get(path).status_code == 200, path
    for path in ("/tokenize", "/detokenize"):  # vLLM's, at the root: POST
        r = httpx.post(server.base + path, json={"prompt": "x", "tokens": [1]})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path


def test_cors_only_for_the_configured_origin(server):
    def preflight(origin: str) -> httpx.Response:
        return httpx.options(server.base + "/v1/chat/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})

    allowed = preflight(ALLOWED_ORIGIN)
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    assert "access-control-allow-origin" not in preflight("https://evil.example").headers
    r = httpx.get(server.base + "/v1/models", headers={"Origin": ALLOWED_ORIGIN, **server.headers})
    assert r.headers["access-control-allow-origin"] == ALLOWED_ORIGIN


def test_the_key_is_never_logged(server):
    log = server.log_path.read_text()
    assert "/v1/" in log  # the access log is there, and has seen the soak's requests
    assert API_KEY not in log and WRONG_KEY not in log


async def _stream(client: httpx.AsyncClient, max_tokens: int, started: asyncio.Event) -> tuple[str, float]:
    """A streamed completion: how it ended ("done", the error code, or "cut") and when."""
    body = {"model": MODEL, "prompt": "Tell me a long story about a lighthouse.", "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line:
                continue
            started.set()
            if line == "data: [DONE]":
                return "done", time.monotonic()
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                return event["error"]["code"], time.monotonic()
    return "cut", time.monotonic()


def test_graceful_shutdown_on_sigterm(server):
    """SIGTERM: no new requests; running streams that end within the grace period end normally, the rest end
    with an error event when it is over; the server exits 0."""

    async def scenario():
        async with httpx.AsyncClient(base_url=server.base, headers=server.headers, timeout=120) as client:
            started = [asyncio.Event() for _ in range(7)]
            tokens = [24] * 4 + [1500] * 3
            streams = [asyncio.create_task(_stream(client, n, event)) for n, event in zip(tokens, started)]
            for event in started:
                await event.wait()
            signalled = time.monotonic()
            server.terminate()
            await asyncio.sleep(0.5)
            late = []
            for probe in ("/readyz", "/health"):  # BentoML's and vLLM's: both out of the pool while draining
                try:
                    late.append((await client.get(probe, timeout=5)).status_code)
                except httpx.TransportError as error:
                    late.append(type(error).__name__)
            return signalled, late, await asyncio.gather(*streams)

    descendants = psutil.Process(server.proc.pid).children(recursive=True)  # the worker and its engine process
    assert any("spawn_main" in " ".join(p.cmdline()) for p in descendants), [p.cmdline() for p in descendants]
    signalled, late, ends = asyncio.run(scenario())
    assert all(status in (503, "ConnectError", "ConnectTimeout", "ReadTimeout", "RemoteProtocolError", "ReadError")
               for status in late), late
    short, long = ends[:4], ends[4:]
    assert all(how == "done" for how, _ in short), short
    assert all(how == "server_shutting_down" for how, _ in long), long
    assert all(GRACE_S - 1 <= at - signalled <= GRACE_S + 15 for _, at in long), [at - signalled for _, at in long]
    try:
        assert server.proc.wait(timeout=60) == 0
    except subprocess.TimeoutExpired:
        pytest.fail("the server did not exit within 60 s of SIGTERM")
    assert "Traceback" not in server.log_path.read_text()
    assert not [p for p in descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]  # none left
