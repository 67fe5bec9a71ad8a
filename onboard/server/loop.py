"""The engine loop: ONE thread owns the `LLMEngine` (it is not thread-safe) and the HTTP side talks to
it only through a thread-safe command queue.

- Handlers (asyncio) put commands: add a request, abort one, or run a function on the engine (a
  test hook). `add` answers through a `concurrent.futures.Future`, so a `ValueError` from
  `LLMEngine.add_request` (bad values, a prompt too long, an invalid grammar) reaches the handler,
  which turns it into a 400.
- The thread steps the engine while any request is unfinished and otherwise sleeps on the queue.
  Between steps it drains every pending command, so aborts take effect before the next step.
- Each `RequestOutput` goes to its request's `asyncio.Queue` with `loop.call_soon_threadsafe`.
- If a step raises, the engine's state is unknown: every request gets the error, later adds are
  refused, and /health reports 503.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from onboard.engine import GrammarSpec, LLMEngine, RequestOutput, SamplingParams
from onboard.server.metrics import EngineStats, Metrics

log = logging.getLogger("onboard.server")


class EngineDeadError(RuntimeError):
    """The engine thread stopped (a step failed, or the server shuts down)."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float  # time.monotonic() when the HTTP request came in
    num_prompt_tokens: int
    last_token_at: float | None = None
    num_generated: int = 0


@dataclass
class _Add:
    prompt_token_ids: list[int]
    params: SamplingParams
    grammar: GrammarSpec | None
    stream: _Stream
    future: concurrent.futures.Future


@dataclass
class _Abort:
    request_id: int


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    future: concurrent.futures.Future


_STOP = object()


class RequestHandle:
    """The asyncio side of one request: its outputs, in order, and an idempotent abort."""

    def __init__(self, engine_loop: EngineLoop, request_id: int, stream: _Stream) -> None:
        self._engine_loop = engine_loop
        self.request_id = request_id
        self._queue = stream.queue
        self.finished = False

    async def outputs(self, disconnected: Callable[[], Any] | None = None, poll_s: float = 0.5) -> AsyncIterator:
        """Yield `RequestOutput`s until the finished one; with `disconnected` (an async predicate), poll it
        while waiting and abort when it says the client is gone."""
        while not self.finished:
            if disconnected is None:
                item = await self._queue.get()
            else:
                try:
                    item = await asyncio.wait_for(self._queue.get(), poll_s)
                except TimeoutError:
                    if await disconnected():
                        self.abort()
                        return
                    continue
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            self.finished = item.finished
            yield item

    def abort(self) -> None:
        """Free the request's KV blocks unless it already finished (safe to call twice)."""
        if not self.finished:
            self.finished = True
            self._engine_loop.abort(self.request_id)


class EngineLoop:
    def __init__(self, engine: LLMEngine, metrics: Metrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics or Metrics()
        self.error: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[int, _Stream] = {}  # engine thread only
        self._thread = threading.Thread(target=self._run, name="onboard-engine", daemon=True)
        self._publish()

    # -- any thread ---------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        if self._thread.is_alive():
            self._commands.put(_STOP)
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def abort(self, request_id: int) -> None:
        self._commands.put(_Abort(request_id))

    def call(self, fn: Callable[[LLMEngine], Any]) -> concurrent.futures.Future:
        """Run `fn(engine)` on the engine thread between steps (inspection, tests); a future of its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if not self._thread.is_alive():
            future.set_exception(EngineDeadError("the engine loop is not running"))
        else:
            self._commands.put(_Call(fn, future))
        return future

    # -- asyncio side -------------------------------------------------------------------------

    async def add(
        self, prompt_token_ids: list[int], params: SamplingParams, grammar: GrammarSpec | None, arrival: float
    ) -> RequestHandle:
        """Queue a request; raises ValueError when the engine refuses it, EngineDeadError when it is gone."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue(), arrival, len(prompt_token_ids))
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(_Add(prompt_token_ids, params, grammar, stream, future))
        try:
            request_id = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            # The handler went away while the engine thread was adding: abort whatever it added.
            future.add_done_callback(lambda f: f.cancelled() or f.exception() or self.abort(f.result()))
            raise
        return RequestHandle(self, request_id, stream)

    # -- engine thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                busy = self.engine.has_unfinished()
                for command in self._drain(block=not busy):
                    if command is _STOP:
                        stopped = EngineDeadError("the server is shutting down")
                        self._fail_all(stopped)
                        for rest in self._drain(block=False):
                            self._refuse(rest, stopped)
                        return
                    self._handle(command)
                outputs = self.engine.step() if self.engine.has_unfinished() else []
                # Counters first: a client that reads /metrics right after its answer sees this step.
                self._publish()
                for output in outputs:
                    self._deliver(output)
                if outputs:
                    self._publish()  # and the streams that just finished
        except Exception as err:  # the engine's state is unknown now: fail everything, serve no more
            log.exception("engine loop failed")
            self.error = err
            dead = EngineDeadError(f"engine failure: {type(err).__name__}: {err}")
            self._fail_all(dead)
            # Stay up to refuse what still comes in, so no handler waits forever on a future.
            while (command := self._commands.get()) is not _STOP:
                self._refuse(command, dead)

    def _drain(self, block: bool) -> list:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _handle(self, command: Any) -> None:
        if isinstance(command, _Add):
            if not command.future.set_running_or_notify_cancel():
                return  # the handler gave up before we got here
            try:
                request_id = self.engine.add_request(command.prompt_token_ids, command.params, command.grammar)
            except Exception as err:  # ValueError -> 400 in the handler; anything else -> 500
                command.future.set_exception(err)
                return
            self._streams[request_id] = command.stream
            command.future.set_result(request_id)
        elif isinstance(command, _Abort):
            stream = self._streams.pop(command.request_id, None)
            self.engine.abort(command.request_id)
            if stream is not None:
                self._finished(stream, "abort")
        elif isinstance(command, _Call) and command.future.set_running_or_notify_cancel():
            try:
                command.future.set_result(command.fn(self.engine))
            except Exception as err:
                command.future.set_exception(err)

    def _deliver(self, output: RequestOutput) -> None:
        stream = self._streams.get(output.request_id)
        if stream is None:
            return
        now = time.monotonic()
        new = len(output.new_token_ids)
        if stream.last_token_at is None:
            self.metrics.observe_first_token(now - stream.arrival)
            if new > 1:
                self.metrics.observe_next_tokens(0.0, new - 1)
        elif new:
            self.metrics.observe_next_tokens(now - stream.last_token_at, new)
        stream.last_token_at = now
        stream.num_generated = output.num_completion_tokens
        if output.finished:
            del self._streams[output.request_id]
            self._finished(stream, output.finish_reason or "stop")
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, output)
        except RuntimeError:  # its event loop is closed: nobody will read this request
            if not output.finished:
                self._streams.pop(output.request_id, None)
                self.engine.abort(output.request_id)

    def _finished(self, stream: _Stream, reason: str) -> None:
        elapsed = time.monotonic() - stream.arrival
        self.metrics.observe_finished(reason, elapsed, stream.num_prompt_tokens, stream.num_generated)

    def _fail_all(self, err: BaseException) -> None:
        for request_id, stream in list(self._streams.items()):
            self._finished(stream, "error")
            try:
                self.engine.abort(request_id)
            except Exception:  # the engine may be what failed; the requests end either way
                log.exception("abort after failure")
            with contextlib.suppress(RuntimeError):
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, err)
        self._streams.clear()
        with contextlib.suppress(Exception):  # stats of a broken engine may not be readable
            self._publish()

    @staticmethod
    def _refuse(command: Any, err: BaseException) -> None:
        future = getattr(command, "future", None)
        if future is not None and future.set_running_or_notify_cancel():
            future.set_exception(err)

    def _publish(self) -> None:
        spec = self.engine.speculator.stats if self.engine.speculator is not None else None
        speculative = (
            {
                "spec_num_drafts": spec.num_drafts,
                "spec_num_draft_tokens": spec.num_draft_tokens,
                "spec_num_accepted_tokens": spec.num_accepted_tokens,
                "spec_accepted_per_position": tuple(spec.accepted_per_position),
            }
            if spec is not None
            else {}
        )
        self.metrics.publish(
            EngineStats(
                **self.engine.stats(),
                num_in_flight=len(self._streams),
                **speculative,
            )
        )
