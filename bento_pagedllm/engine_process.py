"""The engine loop in a child process: the serving process keeps the HTTP work and the engine gets a GIL of
its own (vLLM V1 splits its API server and engine core the same way).

Why: in one process, the engine thread and the event loop that writes every streamed token share one GIL;
under load the serving process is CPU-bound and both slow down (BENCHMARKS.md, "Online through HTTP").

How: the child builds the LLMEngine and runs `EngineLoop` on it. Commands go down a pipe (a forwarder
thread sends what the callers queue, so `drain` stays safe in a signal handler); each pass of the loop
comes back as one message, written by a sender thread so the loop never waits for the parent to read
(`_Sender`): the report for the metrics and the outputs as deltas (request id, the new tokens and text of
each choice, the finish). The parent rebuilds each request's cumulative
`RequestOutput` from its deltas (`OutputAssembler`), so neither side pickles whole prompts or outputs.

NOTE: the child ignores SIGINT and SIGTERM: the parent decides when it stops (a stop command, after a
drain), and a parent that dies closes the pipe, which ends the child.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import pickle
import queue
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler

from .config import EngineArgs
from .engine import LLMEngine, TokenHook
from .engine_loop import NO_COMMAND, Command, Delivery, EngineLoop, EngineReport
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .sequence import TokenLogprob

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 1800.0  # building the engine (weights, graphs) in the child may take this long at most


@dataclass(frozen=True)
class _Ready:
    """The child built its engine and runs the loop."""


@dataclass(frozen=True)
class _Failed:
    """The child could not build its engine, or its loop died: why."""

    message: str


# ---- the wire format of outputs -------------------------------------------------------------------
# A choice's delta: (index, delta_text, delta_token_ids, delta_logprobs, cumulative_logprob, finish_reason,
# stop_reason); an output's: (request_id, finished, error, metrics, choices, prompt_logprobs), the last
# sent with the request's first output only.
WireChoice = tuple[int, str, list[int], list[TokenLogprob] | None, float | None, str | None, str | int | None]
WireOutput = tuple[str, bool, str | None, tuple, list[WireChoice], list[TokenLogprob | None] | None]


def encode_output(out: RequestOutput) -> WireOutput:
    m = out.metrics
    metrics = None if m is None else (m.arrival_time, m.first_scheduled_time, m.first_token_time,
                                      m.finished_time, m.num_preemptions, m.num_cached_tokens)
    choices = [(c.index, c.delta_text, c.delta_token_ids, c.delta_logprobs, c.cumulative_logprob,
                c.finish_reason, c.stop_reason) for c in out.outputs]
    # NOTE: a request's first output is the one whose choices hold only this step's tokens (every choice
    # gets its first token in the step that completes the prompt); its prompt scores are complete there
    first = all(len(c.token_ids) == len(c.delta_token_ids) for c in out.outputs)
    return out.request_id, out.finished, out.error, metrics, choices, out.prompt_logprobs if first else None


def _picklable(error: BaseException) -> BaseException:
    try:
        pickle.dumps(error)
        return error
    except Exception:  # noqa: BLE001 - any error becomes a plain one with the same message
        return RuntimeError(f"{type(error).__name__}: {error}")


def encode_deliveries(deliveries: list[Delivery]) -> list[tuple[str, WireOutput | BaseException]]:
    return [(request_id, _picklable(item) if isinstance(item, BaseException) else encode_output(item))
            for request_id, item in deliveries]


class OutputAssembler:
    """Rebuilds one request's cumulative outputs from the deltas the engine process sends.

    NOTE: each output gets new cumulative lists (as the engine's own outputs do), so a caller may keep an
    earlier output: later steps do not change it.
    """

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int]) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self._choices: dict[int, tuple[str, list[int], list[TokenLogprob] | None]] = {}
        self._prompt_logprobs: list[TokenLogprob | None] | None = None

    def add(self, wire: WireOutput) -> RequestOutput:
        _, finished, error, metrics, wire_choices, prompt_logprobs = wire
        if prompt_logprobs is not None:
            self._prompt_logprobs = prompt_logprobs
        choices = []
        for index, delta_text, delta_ids, delta_logprobs, cumulative_logprob, reason, stop_reason in wire_choices:
            text, token_ids, logprobs = self._choices.get(index, ("", [], None))
            text, token_ids = text + delta_text, token_ids + delta_ids
            if delta_logprobs is not None:
                logprobs = (logprobs or []) + delta_logprobs
            self._choices[index] = (text, token_ids, logprobs)
            choices.append(CompletionOutput(
                index=index, text=text, token_ids=token_ids, cumulative_logprob=cumulative_logprob,
                logprobs=logprobs, finish_reason=reason, stop_reason=stop_reason, delta_text=delta_text,
                delta_token_ids=delta_ids, delta_logprobs=delta_logprobs,
            ))
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, choices, finished,
                             None if metrics is None else RequestMetrics(*metrics), error, self._prompt_logprobs)


# ---- the child ------------------------------------------------------------------------------------
class _Sender:
    """The child's messages go up the pipe from a thread of their own.

    Why: a step's message holds a delta for every running request (tens of KB at hundreds of streams),
    more than a pipe buffers, so a write waits until the parent reads; and the parent reads on a thread
    that shares its GIL with the HTTP work, which under load holds it for up to the interpreter's switch
    interval. Written from the loop, that wait would stall the next step's planning. Here the loop only
    pickles (its own CPU work) and goes on; this thread waits for the pipe, without the GIL.
    NOTE: one FIFO and one thread: messages arrive in the order the loop made them.
    """

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._payloads: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._broken: OSError | None = None
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine-sender", daemon=True)
        self._thread.start()

    def send(self, message: object) -> None:
        """Queue a message; raises the pipe's error once the parent is gone (the loop then stops)."""
        if self._broken is not None:
            raise BrokenPipeError(f"the serving process went away: {self._broken!r}")
        self._payloads.put(bytes(ForkingPickler.dumps(message)))  # NOTE: what Connection.send pickles

    def close(self, timeout_s: float = 10.0) -> None:
        """Send what is queued (for at most timeout_s), then stop the thread."""
        self._payloads.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while (payload := self._payloads.get()) is not None:
            try:
                self._conn.send_bytes(payload)
            except OSError as error:  # BrokenPipeError, ConnectionResetError: the parent is gone
                self._broken = error
                return


def _child_main(args: EngineArgs, token_hook: TokenHook | None, request_timeout_s: float | None,
                conn: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO)
    try:
        # NOTE: this process lives exactly as long as its engine: freeze its start-up heap (engine.py)
        engine = LLMEngine(dataclasses.replace(args, quiet_gc=True))
    except BaseException as error:  # noqa: BLE001 - the parent raises it
        logger.exception("the engine process could not build its engine")
        conn.send(_Failed(f"{type(error).__name__}: {error}"))
        return
    engine.token_hook = token_hook
    sender = _Sender(conn)

    def sink(report: EngineReport, deliveries: list[Delivery]) -> None:
        sender.send((report, encode_deliveries(deliveries)))

    def receive(block: bool) -> object:
        return conn.recv() if block or conn.poll() else NO_COMMAND

    try:
        sender.send(_Ready())
        EngineLoop(engine, sink, request_timeout_s).run(receive)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        logger.warning("the serving process went away: the engine process stops")
    except BaseException as error:  # noqa: BLE001 - the loop died: the parent fails the streams
        logger.exception("engine loop failed")
        try:
            sender.send(_Failed(f"engine loop failed: {error!r}"))
        except OSError:
            pass
    finally:
        sender.close()
        engine.shutdown()
        conn.close()


# ---- the parent's handle --------------------------------------------------------------------------
class EngineProcess:
    """Starts the child and waits until its engine is built (what fails there raises here); once started,
    moves commands down and reports up on two threads. `on_batch(report, deliveries)` runs on the reader thread
    with wire outputs; `on_exit(error)` runs once when the child is gone (error None after a clean stop).
    """

    def __init__(self, args: EngineArgs, token_hook: TokenHook | None, request_timeout_s: float | None,
                 on_batch: Callable[[EngineReport, list], None],
                 on_exit: Callable[[BaseException | None], None]) -> None:
        context = multiprocessing.get_context("spawn")  # NOTE: CUDA cannot be used in a forked child
        self._conn, child_conn = context.Pipe()
        # NOTE: not a daemon: the child may start tensor-parallel workers of its own
        self.process = context.Process(target=_child_main, name="pagedllm-engine-core",
                                       args=(args, token_hook, request_timeout_s, child_conn))
        self.process.start()
        child_conn.close()
        self._on_batch, self._on_exit = on_batch, on_exit
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._stopped = False
        try:
            if not self._conn.poll(START_TIMEOUT_S):
                raise TimeoutError(f"the engine process did not start within {START_TIMEOUT_S:g} s")
            first = self._conn.recv()
        except EOFError:
            # NOTE: the child died before it could say why (its stderr does): under "spawn" it re-imports the
            # parent's main module, so a script that builds the engine at module level needs the
            # `if __name__ == "__main__":` guard
            self._kill()
            raise RuntimeError(f"the engine process exited before its engine was built (exit code "
                               f"{self.process.exitcode}; its error is on stderr; a script needs the "
                               f"`if __name__ == \"__main__\":` guard)") from None
        except BaseException:
            self._kill()
            raise
        if isinstance(first, _Failed):
            self._kill()
            raise RuntimeError(f"the engine process failed to start: {first.message}")
        self._reader = threading.Thread(target=self._read, name="pagedllm-engine-reader", daemon=True)
        self._writer = threading.Thread(target=self._write, name="pagedllm-engine-writer", daemon=True)

        self._started = False

    def start(self) -> None:
        if not self._started and not self._stopped:
            self._started = True
            self._reader.start()
            self._writer.start()

    def send(self, command: Command) -> None:
        """Queue a command for the child. NOTE: reentrant (a SimpleQueue): safe in a signal handler."""
        self._commands.put(command)

    def is_alive(self) -> bool:
        return self._started and self._reader.is_alive() and self.process.is_alive()

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop the child (it ends the requests it holds) and wait for it; kill it if it does not stop."""
        if self._stopped:
            return
        self._stopped = True
        if self._started:
            self._commands.put(None)
            self._reader.join(timeout_s)
        else:  # nobody forwards the stop
            try:
                self._conn.send(None)
            except OSError:
                pass
        self.process.join(timeout_s)
        self._kill()

    def _kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._conn.close()

    def _write(self) -> None:
        while True:
            command = self._commands.get()
            try:
                self._conn.send(command)
            except (OSError, ValueError):
                return  # the child is gone: the reader reports it
            if command is None:
                return

    def _read(self) -> None:
        error: BaseException | None = None
        try:
            while True:
                message = self._conn.recv()
                if isinstance(message, _Failed):
                    error = RuntimeError(message.message)
                    break
                self._on_batch(*message)
        except (EOFError, OSError) as gone:
            if not self._stopped:
                error = RuntimeError(f"the engine process exited unexpectedly ({gone!r}, exit code "
                                     f"{self.process.exitcode})")
        except BaseException as failure:  # noqa: BLE001 - routing failed: treat as a dead engine
            logger.exception("reading the engine process failed")
            error = failure
        self._commands.put(None)  # NOTE: ends the writer if the child died
        self._on_exit(error)
