"""Acceptance of a draft in the engine that serves: greedy, concurrency 1, against the same engine
without it on the same prompts (wall-clock speed-up, losslessness by adapt's near-tie rule)."""

import json
import time
from pathlib import Path
from typing import Any

from rich.table import Table

from onboard.adapt.parity import compare_greedy
from onboard.data.builtin import builtin_records
from onboard.data.load import load_records
from onboard.data.render import tokenize_records
from onboard.engine.spec_decode import TOP, SpeculativeDecoder
from onboard.speculator.draft import Eagle3Draft


def held_out_prompts(tokenizer, traffic: list[str], data: Path | None, count: int, max_tokens: int = 256):
    """(prompt ids, traffic type) from DATA or the eval split (never trained on), round-robin by type."""
    records = load_records(data) if data is not None else builtin_records("eval", traffic, stdlib_files=0)
    out = []
    for record in records:
        if len(out) >= count:
            break
        ids = tokenize_records([record], tokenizer, chat=True, max_length=max_tokens)
        if ids:
            out.append((ids[0], record.traffic))
    return out


def measure_acceptance(engine, draft: Eagle3Draft, k: int, prompts: list[tuple[list[int], str]], max_tokens: int):
    """Greedy, concurrency 1, in the engine: acceptance per traffic type, and wall-clock speed-up
    against the same engine decoding without the draft on the same prompts."""
    from onboard.engine.sampler import SamplingParams

    decoder = SpeculativeDecoder(engine, draft, k)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=TOP)
    eos = engine.eos_ids
    rounds: dict[str, list[int]] = {}
    plain_s = spec_s = 0.0
    exact = near_ties = tokens = 0
    for prompt, kind in prompts:
        start = time.perf_counter()
        (plain,) = engine.generate([prompt], params)
        plain_s += time.perf_counter() - start
        start = time.perf_counter()
        spec = decoder.generate(prompt, max_tokens, eos)
        spec_s += time.perf_counter() - start
        plain_top = [[token for token, _ in entry["top"]] for entry in plain.logprobs]
        verdict = compare_greedy(spec.token_ids, plain.token_ids, spec.top, plain_top)
        exact += verdict.matched
        near_ties += verdict.near_tie
        tokens += len(spec.token_ids)
        rounds.setdefault(kind, []).extend(spec.accepted)
    everything = [a for r in rounds.values() for a in r]

    def summary(accepted: list[int]) -> dict[str, Any]:
        n = max(len(accepted), 1)
        return {
            "acceptance_length": sum(a + 1 for a in accepted) / n,
            "per_position_acceptance": [sum(a > i for a in accepted) / n for i in range(k)],
        }

    return {
        **summary(everything),
        "num_speculative_tokens": k,
        "speedup": plain_s / spec_s if spec_s else 0.0,
        "spec_greedy_exact_rate": exact / max(len(prompts), 1),
        # Identical, or first diverging at a near-tie (adapt's rule): what batching noise allows.
        "spec_lossless_greedy": near_ties == len(prompts),
        "num_prompts": len(prompts),
        "num_tokens": tokens,
        "by_traffic": {kind: summary(acc) for kind, acc in sorted(rounds.items())},
    }


def acceptance_table(metrics: dict[str, Any], title: str = "speculator") -> Table:
    k = metrics["num_speculative_tokens"]
    table = Table(title=f"{title} in the engine (K = {k}, greedy, concurrency 1)", title_justify="left")
    table.add_column("traffic")
    table.add_column("acceptance length", justify="right")
    for i in range(k):
        table.add_column(f"pos {i + 1}", justify="right")
    rows = [*metrics["by_traffic"].items(), ("all", metrics)]
    for name, row in rows:
        table.add_row(name, f"{row['acceptance_length']:.2f}", *(f"{p:.0%}" for p in row["per_position_acceptance"]))
    table.caption = (
        f"speed-up {metrics['speedup']:.2f}x over the engine without it; "
        f"greedy identical on {metrics['spec_greedy_exact_rate']:.0%} of prompts"
    )
    return table


def run_spec_bench(
    artifact: Path, draft_dir: Path, others: list[Path], data: Path | None, num_prompts: int, max_tokens: int
) -> dict[str, Any]:
    """`onboard bench --speculator`: the run's draft (and any `others`) on the same held-out prompts."""
    from onboard.engine.config import EngineConfig
    from onboard.engine.llm_engine import LLMEngine
    from onboard.speculator.export import load_speculator
    from onboard.workspace import console

    engine = LLMEngine(artifact, EngineConfig(enable_prefix_caching=False))
    prompts = held_out_prompts(engine.tokenizer, ["chat", "code", "math"], data, num_prompts)
    results = {}
    for path in [draft_dir, *others]:
        draft = load_speculator(path)
        k = _speculative_tokens(path)
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
        "speculators": results,
    }


def _speculative_tokens(path: Path) -> int:
    config = json.loads((path / "config.json").read_text())
    methods = config["speculators_config"]["proposal_methods"]
    return int(methods[0]["speculative_tokens"])
