"""Generation passes for the smoke stage: many prompts through one engine, with a progress bar."""

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from onboard.console import console
from onboard.engine import SamplingParams

# Every smoke side generates each prompt twice: greedy, and with seeded sampling.
MODES = ("greedy", "sampled")


@dataclass
class Output:
    token_ids: list[int]
    text: str
    finish_reason: str | None
    entropies: list[float] = field(default_factory=list)  # raw-model entropy at each generated step


@dataclass
class Pass:
    outputs: list[Output]
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return sum(len(o.token_ids) for o in self.outputs) / max(self.seconds, 1e-9)


def params_for(mode: str, max_tokens: int, temperature: float, top_p: float, seed: int) -> SamplingParams:
    """Greedy, or seeded sampling; logprobs=0 asks only for the chosen token's, which brings the entropy."""
    if mode == "greedy":
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0)
    return SamplingParams(temperature=temperature, top_p=top_p, seed=seed, max_tokens=max_tokens, logprobs=0)


def generate(
    engine,
    prompts: Sequence[list[int]],
    params: Sequence[SamplingParams],
    label: str,
    entropy: Callable[[dict], float] = lambda entry: entry["entropy"],
) -> Pass:
    """All prompts submitted at once (continuous batching); outputs in prompt order. `entropy` reads
    a step's entropy from its logprobs entry (the raw model's, by default)."""
    start = time.perf_counter()
    ids = [engine.add_request(list(p), q) for p, q in zip(prompts, params, strict=True)]
    outputs = {i: Output([], "", None) for i in ids}
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(label, total=len(ids))
        while engine.has_unfinished():
            for out in engine.step():
                done = outputs[out.request_id]
                done.token_ids += out.new_token_ids
                done.text += out.new_text
                done.entropies += [entropy(entry) for entry in out.logprobs]
                if out.finished:
                    done.finish_reason = out.finish_reason
                    progress.advance(task)
    return Pass([outputs[i] for i in ids], time.perf_counter() - start)
