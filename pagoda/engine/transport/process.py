"""The engine in a spawned child process (`pagoda serve`'s default).

Its own GIL, so the engine's steps do not wait on the front's Python (the HTTP side, streaming
tokens) as on the thread transport, and an engine crash leaves the front alive to report it.
Each step's output crosses the pipe as it is (deltas, not whole outputs), so the cost per step
does not grow with output length. Both directions, and the child's startup arguments, are bytes
of an explicit encoding (encoding.py): neither side unpickles what the pipe carries. Being
spawned, the child re-imports the parent's `__main__`: scripts that use this transport need an
`if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import signal
import threading
from typing import TYPE_CHECKING

from pagoda.config import EngineConfig
from pagoda.engine.parent_watch import exit_when_parent_dies
from pagoda.engine.transport.base import EngineFactory, EngineInfo, EngineTransport, OnDeath, OnEmitted
from pagoda.engine.transport.encoding import (
    Batch,
    Dead,
    Failed,
    FromEngine,
    Ready,
    decode_config,
    decode_message,
    decode_reply,
    encode_config,
    encode_message,
    encode_reply,
    factory_reference,
    resolve_factory,
)
from pagoda.engine.transport.engine_loop import EngineInbox, build_engine, report_worker_failures, run_engine_loop
from pagoda.engine.transport.messages import Shutdown, ToEngine

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from pagoda.engine.llm_engine import EngineStats
    from pagoda.engine.step_output import EngineStepOutput

logger = logging.getLogger(__name__)

# How long the reader waits for an engine whose pipe closed to exit.
REAP_TIMEOUT_S = 5.0


class ProcessTransport(EngineTransport):
    kind = "process"

    def __init__(
        self,
        config: EngineConfig,
        factory: EngineFactory | None,
        on_emitted: OnEmitted,
        on_death: OnDeath,
        *,
        startup_timeout: float | None = None,
    ) -> None:
        """`factory` must be a module-level function or class: the engine process imports it."""
        super().__init__(config, on_emitted, on_death)
        context = multiprocessing.get_context("spawn")
        conn, child_conn = context.Pipe()
        # Only bytes and plain values cross to the child (encoding.py), never a pickled object.
        process = context.Process(
            target=_engine_process_main,
            name="pagoda-engine",
            args=(child_conn, encode_config(config), factory_reference(factory), os.getpid()),
            daemon=True,
        )
        process.start()
        child_conn.close()
        from pagoda.tokenizer import Tokenizer  # loaded here while the child loads the model

        try:
            self.tokenizer = Tokenizer.from_pretrained(config.tokenizer or config.model)
        except BaseException:
            process.kill()
            raise
        if not conn.poll(startup_timeout):
            process.kill()
            raise TimeoutError("the engine did not start in time")
        try:
            message: FromEngine = decode_reply(conn.recv_bytes())
        except EOFError:
            message = Failed(f"the engine process exited with code {process.exitcode}")
        except ValueError as error:
            process.kill()
            message = Failed(f"the engine process sent {error}")
        if not isinstance(message, Ready):
            process.join(5)
            reason = message.reason if isinstance(message, (Failed, Dead)) else "it reported a step before it was ready"
            raise RuntimeError("the engine failed to start") from RuntimeError(reason)
        self.info = message.info()
        self.process = process
        self._conn = conn
        self._stopping = False
        # A sender thread, so the event loop never blocks on a full pipe (a long prompt while
        # the engine is busy stepping).
        # Messages are encoded by send(), so that one that cannot be is the caller's error.
        self._outbox: queue.SimpleQueue[tuple[bytes, bool]] = queue.SimpleQueue()  # (message, is it the last)
        for target, name in ((self._read, "pagoda-engine-reader"), (self._write, "pagoda-engine-writer")):
            threading.Thread(target=target, name=name, daemon=True).start()

    def send(self, message: ToEngine) -> None:
        self._outbox.put((encode_message(message), isinstance(message, Shutdown)))

    def is_alive(self) -> bool:
        return self.process.is_alive()

    @property
    def engine_pid(self) -> int | None:
        return self.process.pid

    def shutdown(self, timeout: float | None) -> None:
        self._stopping = True
        self.send(Shutdown())
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self._conn.close()

    def _write(self) -> None:
        while True:
            payload, last = self._outbox.get()
            try:
                self._conn.send_bytes(payload)
            except (OSError, ValueError):
                return  # the engine process is gone; the reader reports it
            if last:
                return

    def _read(self) -> None:
        while True:
            try:
                message = decode_reply(self._conn.recv_bytes())
            except ValueError as error:  # not the engine speaking: its state is unknown, stop it
                logger.error("engine process: refused a message on its pipe: %s", error)
                self._stopping = True
                self.process.kill()
                self._on_death(RuntimeError(f"the engine process sent {error}"))
                return
            except (EOFError, OSError):
                if not self._stopping:
                    # The pipe closes as the process exits: wait for the exit itself, so the
                    # child is reaped (no zombie) and its exit code is known.
                    self.process.join(REAP_TIMEOUT_S)
                    self._on_death(RuntimeError(f"the engine process {describe_exit(self.process.exitcode)}"))
                return
            if isinstance(message, Batch):
                self._on_emitted(message.output, message.stats)
            elif isinstance(message, Dead):
                self._on_death(RuntimeError(message.reason))
                return


def describe_exit(exitcode: int | None) -> str:
    """How a process ended, from its exit code (negative: the signal that killed it)."""
    if exitcode is None:
        return "closed its pipe but has not exited"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name} (exit code {exitcode})"
    return f"exited with code {exitcode}"


def _engine_process_main(conn: Connection, config_bytes: bytes, factory_name: str | None, parent_pid: int) -> None:
    """Entry point of the engine process.

    Its lifetime is the server's: Ctrl-C in a terminal (SIGINT to the whole process group) or a
    SIGTERM to the group must not kill it under running requests while the server drains, so
    both are ignored here; the server stops it through the pipe and escalates to SIGKILL, and
    it exits by itself when the server dies (parent_watch)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    exit_when_parent_dies(parent_pid)
    try:
        engine = build_engine(decode_config(config_bytes), resolve_factory(factory_name))
    except BaseException as exc:
        conn.send_bytes(encode_reply(Failed(f"{type(exc).__name__}: {exc}")))
        return
    conn.send_bytes(encode_reply(Ready.of(EngineInfo.of(engine))))
    sending = threading.Lock()  # the loop's batches and a worker-failure report share the pipe

    def report_failure(reason: str) -> None:
        with sending:
            try:
                conn.send_bytes(encode_reply(Dead(reason)))
            except OSError:
                pass

    report_worker_failures(engine, report_failure)

    # The pipe is read on a thread of its own into the inbox, where the engine's KV handoff
    # threads post their wake-ups too; a closed pipe (the front went away) stops the engine.
    # The front's messages arrive explicitly encoded (encoding.py), never pickled.
    inbox = EngineInbox()

    def forward() -> None:
        while True:
            try:
                message = decode_message(conn.recv_bytes())
            except (EOFError, OSError):
                inbox.put(Shutdown())
                return
            except ValueError as error:  # not the front speaking: refused, nothing built from it
                logger.error("engine process: refused a message on its pipe: %s", error)
                continue
            inbox.put(message)
            if isinstance(message, Shutdown):
                return

    threading.Thread(target=forward, name="pagoda-engine-inbox", daemon=True).start()

    def emit(output: EngineStepOutput, stats: EngineStats) -> None:
        with sending:
            conn.send_bytes(encode_reply(Batch(output, stats)))

    try:
        run_engine_loop(engine, inbox, emit)
    except (EOFError, BrokenPipeError):
        return  # the front went away
    except BaseException as exc:
        logger.exception("engine loop died")
        report_failure(f"{type(exc).__name__}: {exc}")
