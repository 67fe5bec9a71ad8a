"""A progress bar that also shows a rate, e.g. tokens per second."""

import time

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from onboard.console import console


def rate_progress() -> Progress:
    """Description, bar, done/total, a `rate` field (set it with `progress.update(task, rate=...)`)."""
    columns = [
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
    ]
    return Progress(*columns, console=console, transient=True)


class Rate:
    """Tokens counted since it was made, as `"N tokens/s"`."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.tokens = 0

    def add(self, tokens: int) -> str:
        self.tokens += tokens
        return f"{self.tokens / max(time.perf_counter() - self.start, 1e-9):,.0f} tokens/s"
