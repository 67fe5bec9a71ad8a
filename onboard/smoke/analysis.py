"""Detector rates for the artifact and the reference on the same prompts, and the worst examples."""

from collections.abc import Callable, Sequence
from typing import Any

from rich.table import Table

from onboard.data import ChatPrompt
from onboard.recipes import Smoke
from onboard.smoke.detectors import (
    Loop,
    distinct_n,
    find_loop,
    garbage,
    mean_entropy,
    near_duplicate_rate,
    near_duplicates,
)
from onboard.smoke.passes import Output

DETECTORS = (
    ("token loops", "loop_rate"),
    ("run-ons (no EOS where the other stopped)", "run_on_rate"),
    ("hit max_tokens", "no_eos_rate"),
    ("distinct-2 (higher is more varied)", "distinct_2"),
    ("near-identical answers to different prompts", "near_duplicate_rate"),
    ("mean entropy per step (nats)", "mean_entropy"),
    ("garbage (bad UTF-8, control characters)", "garbage_rate"),
)
SHOWN_PROMPT_CHARS = 600  # of a prompt's text, in the report


def _rate(flags: Sequence[bool]) -> float:
    return sum(flags) / len(flags) if flags else 0.0


def _ran_on(mine: Output, other: Output) -> bool:
    return mine.finish_reason == "length" and other.finish_reason == "stop"


class Side:
    """One model's outputs in every mode, with each detector's per-output findings."""

    def __init__(self, by_mode: dict[str, list[Output]], config: Smoke):
        self.by_mode = by_mode
        self.loops = {
            mode: [
                find_loop(
                    o.token_ids,
                    config.loop_min_period,
                    config.loop_max_period,
                    config.loop_min_repeats,
                    config.loop_min_span,
                )
                for o in outputs
            ]
            for mode, outputs in by_mode.items()
        }
        self.garbage = {mode: [garbage(o.text) for o in outputs] for mode, outputs in by_mode.items()}
        self.duplicates = {
            mode: near_duplicates([o.token_ids for o in outputs], config.near_duplicate_similarity)
            for mode, outputs in by_mode.items()
        }
        self.threshold = config.near_duplicate_similarity

    def rates(self, other: "Side", modes: Sequence[str]) -> dict[str, float]:
        outputs = [o for m in modes for o in self.by_mode[m]]
        pairs = [(o, t) for m in modes for o, t in zip(self.by_mode[m], other.by_mode[m], strict=True)]
        return {
            "loop_rate": _rate([loop is not None for m in modes for loop in self.loops[m]]),
            "no_eos_rate": _rate([o.finish_reason == "length" for o in outputs]),
            "run_on_rate": _rate([_ran_on(o, t) for o, t in pairs]),
            "distinct_2": distinct_n([o.token_ids for o in outputs], 2),
            "near_duplicate_rate": sum(
                near_duplicate_rate([o.token_ids for o in self.by_mode[m]], self.threshold) for m in modes
            )
            / len(modes),
            "mean_entropy": mean_entropy([o.entropies for o in outputs]),
            "garbage_rate": _rate([bool(reasons) for m in modes for reasons in self.garbage[m]]),
        }


def compare(artifact: Side, reference: Side, modes: Sequence[str]) -> dict[str, Any]:
    """The contract keys (`loop_rate`, `reference_loop_rate`, ...), pooled over modes and by mode."""

    def both(selected: Sequence[str]) -> dict[str, float]:
        mine, theirs = artifact.rates(reference, selected), reference.rates(artifact, selected)
        out = {**mine, **{f"reference_{k}": v for k, v in theirs.items()}}
        out["entropy_ratio"] = mine["mean_entropy"] / theirs["mean_entropy"] if theirs["mean_entropy"] else 1.0
        return out

    pooled = both(modes)
    detectors = [
        {
            "name": name,
            "key": key,
            "artifact": pooled[key],
            "reference": pooled[f"reference_{key}"],
            "difference": pooled[key] - pooled[f"reference_{key}"],
        }
        for name, key in DETECTORS
    ]
    return {**pooled, "detectors": detectors, "by_mode": {m: both([m]) for m in modes}}


def _loop_json(loop: Loop | None, output: Output, decode: Callable[[list[int]], str]) -> dict | None:
    if loop is None:
        return None
    char_start = min(len(decode(output.token_ids[: loop.start])), len(output.text))
    return {"start": loop.start, "period": loop.period, "span": loop.span, "char_start": char_start}


def worst_cases(
    artifact: Side,
    reference: Side,
    prompts: Sequence[ChatPrompt],
    decode: Callable[[list[int]], str],
    limit: int,
) -> list[dict[str, Any]]:
    """The examples a reviewer should read first, kinds interleaved: loops the reference did not
    have (longest first), run-ons, garbage, then near-identical answers to different prompts."""
    found: dict[str, list[tuple[float, str, int]]] = {"loop": [], "run_on": [], "garbage": [], "near_duplicate": []}
    for mode, outputs in artifact.by_mode.items():
        theirs = reference.by_mode[mode]
        for i, output in enumerate(outputs):
            loop = artifact.loops[mode][i]
            if loop is not None and reference.loops[mode][i] is None:
                found["loop"].append((-loop.span, mode, i))
            if _ran_on(output, theirs[i]):
                found["run_on"].append((-len(output.token_ids), mode, i))
            if artifact.garbage[mode][i]:
                found["garbage"].append((0.0, mode, i))
        for i, _j, similarity in artifact.duplicates[mode]:
            found["near_duplicate"].append((-similarity, mode, i))
    queues = {kind: sorted(items) for kind, items in found.items()}
    cases, seen = [], set()
    while len(cases) < limit and any(queues.values()):
        for kind, queue in queues.items():
            while queue and (queue[0][1], queue[0][2]) in seen:
                queue.pop(0)
            if not queue or len(cases) >= limit:
                continue
            _, mode, i = queue.pop(0)
            seen.add((mode, i))
            mine, theirs = artifact.by_mode[mode][i], reference.by_mode[mode][i]
            cases.append(
                {
                    "kind": kind,
                    "mode": mode,
                    "traffic": prompts[i].traffic,
                    "prompt": prompts[i].text[:SHOWN_PROMPT_CHARS],
                    "artifact_text": mine.text,
                    "reference_text": theirs.text,
                    "artifact_loop": _loop_json(artifact.loops[mode][i], mine, decode),
                    "reference_loop": _loop_json(reference.loops[mode][i], theirs, decode),
                    "finish_reason": mine.finish_reason,
                    "reference_finish_reason": theirs.finish_reason,
                    "garbage": artifact.garbage[mode][i],
                }
            )
    return cases


def smoke_table(result: dict[str, Any]) -> Table:
    table = Table(title=f"smoke: {result['num_prompts']} prompts x {', '.join(result['modes'])}", title_justify="left")
    for column in ("detector", "artifact", "reference", "difference"):
        table.add_column(column, justify="left" if column == "detector" else "right")
    for row in result["detectors"]:
        table.add_row(row["name"], f"{row['artifact']:.3f}", f"{row['reference']:.3f}", f"{row['difference']:+.3f}")
    diverged = result["invariance"]["diverged"]
    if result["batch_invariant"] is None:  # through transformers: no serving engine to check
        table.add_row("batch invariant", "not measured", "", "")
    else:
        table.add_row("batch invariant", str(result["batch_invariant"]), "", f"{len(diverged)} divergences")
    return table
