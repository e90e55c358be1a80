"""A real `bentoml serve service:svc` in a subprocess on loopback, for the tests that need the whole server."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
MODEL = "smollm2-135m-instruct"
# conftest's session server (the service and browser tests share it)
API_KEY = "test-key-123"
MAX_MODEL_LEN = 2048
SESSION_ENV = {
    "PAGEDLLM_NUM_KV_BLOCKS": "512", "PAGEDLLM_MAX_MODEL_LEN": str(MAX_MODEL_LEN),
    # NOTE: health and metrics open here (the soak's server keeps them behind the key)
    "PAGEDLLM_OPEN_HEALTH_AND_METRICS": "true",
    # NOTE: async scheduling as on CUDA (the CPU default is off), so the service path is tested with it
    "PAGEDLLM_ASYNC_SCHEDULING": "true",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class BentoServer:
    proc: subprocess.Popen
    base: str
    log_path: Path
    api_key: str | None

    @classmethod
    def start(cls, log_dir: Path, api_key: str | None, env: dict[str, str], ready_timeout: float = 300) -> "BentoServer":
        """Start the server with the default model on the CPU (`env` adds PAGEDLLM_* settings); wait until ready."""
        port = free_port()
        log_path = log_dir / "serve.log"
        full_env = dict(os.environ, PAGEDLLM_DEVICE="cpu", PATH=f"{BIN}:{os.environ['PATH']}",
                        PROMETHEUS_MULTIPROC_DIR=str(log_dir / "prometheus"), **env)
        if api_key:
            full_env["PAGEDLLM_API_KEY"] = api_key
        os.makedirs(full_env["PROMETHEUS_MULTIPROC_DIR"], exist_ok=True)
        with open(log_path, "w") as log:
            proc = subprocess.Popen([os.path.join(BIN, "bentoml"), "serve", "service:svc", "--port", str(port),
                                     "--host", "127.0.0.1"], cwd=REPO, env=full_env, stdout=log,
                                    stderr=subprocess.STDOUT)
        server = cls(proc, f"http://127.0.0.1:{port}", log_path, api_key)
        server._wait_ready(ready_timeout)
        return server

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while True:
            try:
                if self.get("/readyz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise RuntimeError(f"server did not become ready:\n{self.log_path.read_text()[-4000:]}")
            time.sleep(0.5)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def get(self, path: str, **kwargs) -> httpx.Response:
        return httpx.get(self.base + path, headers=self.headers, **{"timeout": 10, **kwargs})

    def metric(self, name: str) -> float:
        """The value of a metric on /metrics (summed over its labels)."""
        return self.metrics([name])[name]

    def metrics(self, names: list[str]) -> dict[str, float]:
        """Several metrics from one scrape of /metrics."""
        text = self.get("/metrics").text
        found = {}
        for name in names:
            values = [float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)]
            assert values, f"{name} missing from /metrics"
            found[name] = sum(values)
        return found

    def wait_idle(self, timeout: float = 30.0) -> None:
        """No request in the engine and no KV block in use (aborts are processed at the engine's next turn)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.metric("pagedllm_requests_unfinished") == 0 and self.metric("pagedllm_kv_blocks_used") == 0:
                return
            time.sleep(0.2)
        raise AssertionError("requests or KV blocks left behind")

    def worker(self) -> psutil.Process:
        """The serving worker (BentoML's supervisor runs it as a child process)."""
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            if "_bentoml_impl.worker.service" in " ".join(child.cmdline()):
                return child
        raise AssertionError("no serving worker")

    def terminate(self) -> None:
        """SIGTERM, as an orchestrator stops a container."""
        self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
