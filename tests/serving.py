"""A real `bentoml serve service:svc` for the tests that need one (conftest's `server` fixture), and how they read
its /metrics."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
API_KEY = "test-key-123"
MODEL = "smollm2-135m-instruct"
NUM_KV_BLOCKS = 512
MAX_MODEL_LEN = 2048


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def bentoml_serve(log_path: Path, prometheus_dir: Path) -> Iterator[str]:
    """The default model served on the CPU with an API key, on a free loopback port; yields its base URL."""
    port = free_port()
    # NOTE: async scheduling as on CUDA (the CPU default is off), so the whole service path is tested with it
    env = dict(os.environ, PAGEDLLM_API_KEY=API_KEY, PAGEDLLM_DEVICE="cpu", PAGEDLLM_ASYNC_SCHEDULING="true",
               PAGEDLLM_OPEN_HEALTH_AND_METRICS="true",
               PAGEDLLM_NUM_KV_BLOCKS=str(NUM_KV_BLOCKS), PAGEDLLM_MAX_MODEL_LEN=str(MAX_MODEL_LEN),
               PATH=f"{BIN}:{os.environ['PATH']}", PROMETHEUS_MULTIPROC_DIR=str(prometheus_dir))
    with open(log_path, "w") as log:
        proc = subprocess.Popen([os.path.join(BIN, "bentoml"), "serve", "service:svc", "--port", str(port),
                                 "--host", "127.0.0.1"], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 240
    while True:
        try:
            if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"server did not become ready:\n{log_path.read_text()[-4000:]}")
        time.sleep(0.5)
    try:
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def metric(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    values = [float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)]
    assert values, f"{name} missing from /metrics"
    return sum(values)


def wait_idle(base: str, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if metric(base, "pagedllm_requests_unfinished") == 0 and metric(base, "pagedllm_kv_blocks_used") == 0:
            return
        time.sleep(0.2)
    raise AssertionError("requests or KV blocks left behind")
