"""Ranks 1..size-1 of a tensor-parallel engine: one spawned process each, driven by rank 0.

Rank 0 (the engine's own process) owns the scheduler, the block manager and sampling. Every step it
sends the step's host inputs (`ModelRunner.prepare`) to each worker over a pipe; each worker runs
`ModelRunner.launch` on them, which takes
part in the model's collectives (the all-reduces of the row-parallel layers and of the embedding, the
gather of the logits to rank 0, and under async scheduling the broadcast of the sampled token ids).

NOTE: the inputs travel over a pipe, not a collective, so an idle worker blocks in `recv` for as long as the
server is idle: a collective would hit the process group's timeout (and NCCL's watchdog) after minutes
without requests. Collectives carry only tensors, in lockstep inside a step.
"""

from __future__ import annotations

import logging
import os
import pickle
import time
import weakref
from dataclasses import dataclass, replace

import torch
import torch.multiprocessing as mp

from ..config import EngineConfigs
from ..loader import ModelSource
from ..model_runner import HostInputs, ModelRunner
from .parallel_state import ParallelConfig, leave_group, driver_store, init_group, worker_store

logger = logging.getLogger(__name__)

_HOST = "127.0.0.1"
_JOIN_SECONDS = 30.0


def rank_device(device: torch.device, rank: int) -> torch.device:
    """One GPU per rank (cuda:rank, within CUDA_VISIBLE_DEVICES); every CPU rank shares the CPU."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def rank_configs(configs: EngineConfigs, rank: int) -> EngineConfigs:
    return replace(configs, device=replace(configs.device, device=rank_device(configs.device.device, rank)))


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process needs to build its shard (pickled to the spawned process)."""

    configs: EngineConfigs
    source: ModelSource | None  # None: dummy weights
    rank: int
    port: int  # rank 0's rendezvous store
    log_level: int = logging.WARNING  # rank 0's, for this package's loggers


class WorkerStepTimes:
    """Where a worker's host time goes, per step: waiting for the inputs, unpickling them, launching.

    Why: rank 0 cannot see a worker's host. A worker that launches late holds rank 0's device inside the
    step's first collective, which rank 0's timeline counts as busy; these times show it (logged at exit).
    """

    def __init__(self) -> None:
        self.steps = 0
        self.totals = [0.0, 0.0, 0.0]  # seconds: waiting, unpickling, launching
        self.slowest_launch = 0.0

    def add(self, waiting: float, unpickling: float, launching: float) -> None:
        self.steps += 1
        for i, seconds in enumerate((waiting, unpickling, launching)):
            self.totals[i] += seconds
        self.slowest_launch = max(self.slowest_launch, launching)

    def summary(self) -> str:
        per_step = [f"{1e3 * total / max(1, self.steps):.3f}" for total in self.totals]
        return (f"{self.steps} steps; per step, ms: waiting {per_step[0]}, unpickling {per_step[1]}, launching "
                f"{per_step[2]} (slowest {1e3 * self.slowest_launch:.1f})")


def worker_main(spec: WorkerSpec, conn) -> None:
    """A worker's life: join the group, build its shard and runner, then run every step rank 0 sends
    until it sends None (or the pipe closes: rank 0 is gone)."""
    from ..engine import build_model, quiet_garbage_collector  # NOTE: here: the engine imports this module

    logging.basicConfig(level=spec.log_level, format=f"%(asctime)s rank{spec.rank} %(name)s %(levelname)s %(message)s")
    configs = rank_configs(spec.configs, spec.rank)
    size = configs.tensor_parallel_size
    if configs.device.device.type == "cpu":
        # NOTE: the ranks share the CPU's cores; oversubscribing them slows every collective's slowest rank
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    parallel = init_group(size, spec.rank, worker_store(size, _HOST, spec.port), configs.device.device,
                          configs.device.dtype, configs.peer_all_reduce)
    runner = None
    times = WorkerStepTimes()
    try:
        runner = ModelRunner(configs, build_model(configs, spec.source, parallel), parallel)
        # NOTE: this process is the engine's alone (as the engine process is): each step makes thousands
        # of short-lived objects (the inputs' lists), and the collector's default passes over the model's
        # heap would delay launches, holding rank 0 inside the step's first collective
        quiet_garbage_collector()
        while True:
            waiting = time.perf_counter()
            try:
                payload = conn.recv_bytes()
            except EOFError:
                break
            unpickling = time.perf_counter()
            inputs: HostInputs | None = pickle.loads(payload)
            if inputs is None:
                break
            launching = time.perf_counter()
            runner.launch(None, inputs)
            times.add(unpickling - waiting, launching - unpickling, time.perf_counter() - launching)
    except Exception:
        logger.exception("tensor-parallel worker %d failed", spec.rank)
        raise
    finally:
        logger.info("tensor-parallel worker %d: %s", spec.rank, times.summary())
        if runner is not None:
            runner.release_graphs()
        leave_group()
        conn.close()


class TensorParallelWorkers:
    """Rank 0's side: spawns the workers, joins the group with them, and sends them each step's plan.

    `parallel` is rank 0's handle, for its own model and runner. `shutdown` (also run when this object is
    garbage-collected, and at interpreter exit) stops the workers and leaves the group.
    """

    def __init__(self, configs: EngineConfigs, source: ModelSource | None) -> None:
        size = configs.tensor_parallel_size
        context = mp.get_context("spawn")
        store = driver_store(size, _HOST)
        self._conns = []
        self._procs = []
        for rank in range(1, size):
            parent, child = context.Pipe()
            proc = context.Process(
                target=worker_main,
                args=(WorkerSpec(configs, source, rank, store.port, logger.getEffectiveLevel()), child),
                name=f"pagedllm-tp-rank{rank}", daemon=True,
            )
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self._finalizer = weakref.finalize(self, _shutdown, self._conns, self._procs)
        try:
            self.parallel: ParallelConfig = init_group(size, 0, store, rank_device(configs.device.device, 0),
                                                       configs.device.dtype, configs.peer_all_reduce)
        except BaseException:
            self.shutdown()
            raise
        logger.info("tensor parallelism: %d ranks (%s)", size, [p.pid for p in self._procs])

    def send_step(self, inputs: HostInputs) -> None:
        """Every worker runs this step next (they enter its collectives when rank 0 does).

        NOTE: pickled once for all workers.
        """
        payload = pickle.dumps(inputs, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self._conns, start=1):
            try:
                conn.send_bytes(payload)
            except (BrokenPipeError, ConnectionResetError, OSError) as error:
                raise RuntimeError(f"tensor-parallel worker {rank} is gone") from error

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def shutdown(self) -> None:
        self._finalizer()


def _shutdown(conns, procs) -> None:
    """Ask each worker to stop, leave the group with them, and wait for them (terminate one that hangs).

    NOTE: rank 0 leaves the group while the workers, which got the stop, leave theirs; leaving waits for
    no other rank (see `leave_group`), so a dead worker cannot hang it.
    """
    stop = pickle.dumps(None)
    for conn in conns:
        try:
            conn.send_bytes(stop)
        except (BrokenPipeError, ConnectionResetError, OSError):
            pass  # already gone
    leave_group()
    for proc in procs:
        proc.join(_JOIN_SECONDS)
        if proc.is_alive():
            logger.warning("tensor-parallel worker %s did not stop: terminating it", proc.name)
            proc.terminate()
            proc.join(_JOIN_SECONDS)
    for conn in conns:
        conn.close()
