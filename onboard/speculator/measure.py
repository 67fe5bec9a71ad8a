"""Acceptance of a draft in the engine that serves: greedy, concurrency 1, against the same engine
without it on the same prompts (wall-clock speed-up, losslessness by adapt's near-tie rule)."""

import time
from pathlib import Path
from typing import Any

import torch
from rich.table import Table

from onboard.adapt.parity import compare_greedy
from onboard.data.builtin import builtin_records
from onboard.data.load import load_records
from onboard.data.prompts import ChatPrompt, chat_prompts
from onboard.data.record import Record

TOP = 5  # top log-probabilities per token: what the near-tie rule compares


def held_out_prompts(
    tokenizer, traffic: list[str], records: list[Record] | None, count: int, max_tokens: int = 256
) -> list[ChatPrompt]:
    """`count` chat prompts from `records`, or from the eval split (never trained on) round-robin
    by type when None. Longer ones are skipped, not cut, as in training (`training_prompts`)."""
    if records is None:
        records = builtin_records("eval", traffic, stdlib_files=0)
    return chat_prompts(records, tokenizer, max_tokens=max_tokens, fit="skip", limit=count)


def _looping(token_ids: list[int], n: int = 8, repeats: int = 3) -> bool:
    """Whether an output repeats some n-token run `repeats` times (the 135M model's loops, which
    a draft predicts easily): acceptance on them is reported apart from the rest."""
    counts: dict[tuple[int, ...], int] = {}
    for i in range(len(token_ids) - n + 1):
        gram = tuple(token_ids[i : i + n])
        counts[gram] = counts.get(gram, 0) + 1
        if counts[gram] >= repeats:
            return True
    return False


def measure_acceptance(engine, draft: torch.nn.Module, k: int, prompts: list[ChatPrompt], max_tokens: int):
    """Greedy, concurrency 1, in the engine: acceptance per traffic type (and on looping and
    non-looping outputs), and wall-clock speed-up against the same engine without the draft on
    the same prompts."""
    from onboard.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=TOP)
    groups: dict[str, list[int]] = {}  # name -> [drafts, accepted, accepted at position 1..k]
    plain_s = spec_s = 0.0
    exact = near_ties = tokens = 0
    for prompt in prompts:
        engine.set_speculator(None, 0)
        start = time.perf_counter()
        (plain,) = engine.generate([prompt.token_ids], params)
        plain_s += time.perf_counter() - start
        engine.set_speculator(draft, k)
        start = time.perf_counter()
        (spec,) = engine.generate([prompt.token_ids], params)
        spec_s += time.perf_counter() - start
        verdict = compare_greedy(spec.token_ids, plain.token_ids, _top(spec), _top(plain))
        exact += verdict.matched
        near_ties += verdict.near_tie
        tokens += len(spec.token_ids)
        stats = engine.speculator.stats
        counts = [stats.num_drafts, stats.num_accepted_tokens, *stats.accepted_per_position]
        for name in (prompt.traffic, "looping" if _looping(spec.token_ids) else "not looping", "all"):
            groups[name] = [a + b for a, b in zip(groups.get(name, [0] * len(counts)), counts, strict=True)]
    engine.set_speculator(None, 0)

    def summary(counts: list[int]) -> dict[str, Any]:
        drafts = max(counts[0], 1)
        return {
            "acceptance_length": 1 + counts[1] / drafts,
            "per_position_acceptance": [c / drafts for c in counts[2:]],
            "num_drafts": counts[0],
        }

    everything = groups.pop("all", [0] * (k + 2))
    by_loop = {name: summary(groups.pop(name)) for name in ("looping", "not looping") if name in groups}
    return {
        **summary(everything),
        "num_speculative_tokens": k,
        "speedup": plain_s / spec_s if spec_s else 0.0,
        "spec_greedy_exact_rate": exact / max(len(prompts), 1),
        # Identical, or first diverging at a near-tie (adapt's rule): what batching noise allows.
        "spec_lossless_greedy": near_ties == len(prompts),
        "spec_lossless_prompts": near_ties,  # of num_prompts: identical, or parted at a near-tie
        "num_prompts": len(prompts),
        "num_tokens": tokens,
        "by_traffic": {kind: summary(counts) for kind, counts in sorted(groups.items())},
        "by_looping": by_loop,
    }


def _top(completion) -> list[list[int]]:
    return [[token for token, _ in entry["top"]] for entry in completion.logprobs]


def acceptance_table(metrics: dict[str, Any], title: str = "speculator") -> Table:
    k = metrics["num_speculative_tokens"]
    table = Table(title=f"{title} in the engine (K = {k}, greedy, concurrency 1)", title_justify="left")
    table.add_column("traffic")
    table.add_column("acceptance length", justify="right")
    for i in range(k):
        table.add_column(f"pos {i + 1}", justify="right")
    rows = [*metrics["by_traffic"].items(), *metrics.get("by_looping", {}).items(), ("all", metrics)]
    for name, row in rows:
        table.add_row(name, f"{row['acceptance_length']:.2f}", *(f"{p:.0%}" for p in row["per_position_acceptance"]))
    table.caption = (
        f"speed-up {metrics['speedup']:.2f}x over the engine without it; "
        f"greedy identical on {metrics['spec_greedy_exact_rate']:.0%} of prompts"
    )
    return table


def run_spec_bench(
    artifact: Path,
    draft_dir: Path,
    others: list[Path],
    data: Path | None,
    num_prompts: int,
    max_tokens: int,
    device: str = "cpu",
    numerics: str = "fast",
) -> dict[str, Any]:
    """`onboard bench --speculator`: the run's draft (an export, or `mtp`: the artifact's MTP layers)
    and any `others` on the same held-out prompts, in the numerics that serve."""
    from onboard.console import console
    from onboard.engine import EngineConfig, LLMEngine
    from onboard.speculator.drafts import load_draft

    engine = LLMEngine(artifact, EngineConfig(device=device, numerics=numerics, enable_prefix_caching=False))
    records = load_records(data) if data is not None else None
    prompts = held_out_prompts(engine.tokenizer, ["chat", "code", "math"], records, num_prompts)
    results = {}
    for path in [draft_dir, *others]:
        draft, k = load_draft(path, artifact, engine)
        console.print(f"bench: speculator {path} (K = {k}) on {len(prompts)} prompts ...")
        results[str(path)] = measure_acceptance(engine, draft.float(), k, prompts, max_tokens)
        console.print(acceptance_table(results[str(path)], title=str(path)))
    main = results[str(draft_dir)]
    return {
        "spec_acceptance_length": main["acceptance_length"],
        "spec_per_position_acceptance": main["per_position_acceptance"],
        "spec_speedup": main["speedup"],
        "spec_lossless_greedy": main["spec_lossless_greedy"],
        "spec_greedy_exact_rate": main["spec_greedy_exact_rate"],
        "numerics": numerics,
        "speculators": results,
    }
