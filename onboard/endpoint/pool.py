"""Many requests in flight against one endpoint, with a progress bar, as production traffic is.

Threads, not asyncio: each request is a blocking `httpx.Client` call (the client is thread-safe)
and the work per answer is small, so a pool keeps the checks' code synchronous.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import TypeVar

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from onboard.console import console

Item = TypeVar("Item")
Result = TypeVar("Result")


def in_flight(items: Sequence[Item], fn: Callable[[Item], Result], concurrency: int, label: str) -> list[Result]:
    """fn(item) for every item, `concurrency` at a time; results in item order. The first failure
    cancels what has not started and is raised (finished work was already kept by `fn`)."""
    columns = (
        TextColumn(label),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=True) as progress, ThreadPoolExecutor(concurrency) as pool:
        task = progress.add_task(label, total=len(items))
        futures = {pool.submit(fn, item): index for index, item in enumerate(items)}
        for future in futures:
            future.add_done_callback(lambda _: progress.advance(task))
        done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        failed = [f for f in done if f.exception() is not None]
        if failed:
            for future in pending:
                future.cancel()
            raise failed[0].exception()  # type: ignore[misc]
        results = {futures[f]: f.result() for f in done}
    return [results[i] for i in range(len(items))]
