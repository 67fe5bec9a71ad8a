"""`onboard smoke RUN_DIR`: what customers would see first, artifact against reference.

Both models generate through the reference engine on the same prompts, greedy and with seeded
sampling, all requests at once. The detectors (`detectors.py`) give a rate for each side;
`smoke/smoke.json` holds both, their differences, the worst examples, the batch-invariance check
and, when a speculator was exported, whether greedy speculative decoding gives the same tokens.
(The long passes run without the draft: its per-sequence proposals make large batches several
times slower on the CPU, and its greedy tokens are checked to equal plain decoding's anyway.)
"""

import gc
import json
from pathlib import Path
from typing import Any

import torch
from rich.table import Table

from onboard import atomic
from onboard.console import console
from onboard.data import ChatPrompt, builtin_records, chat_prompts, load_records
from onboard.engine import EngineConfig, LLMEngine
from onboard.hashing import fingerprint
from onboard.paths import CALIBRATION_DIR
from onboard.recipes import Smoke
from onboard.smoke.analysis import Side, compare, worst_cases
from onboard.smoke.invariance import check_invariance, check_speculative
from onboard.smoke.passes import generate, params_for
from onboard.workspace import SMOKE, RunDir, Stage, folder

MODES = ("greedy", "sampled")
MAX_PROMPT_TOKENS = 1024
# Room for every prompt at once: max_num_seqs sequences of prompt + max_tokens, in 16-token blocks.
_NUM_BLOCKS = 8192


def smoke_prompts(tokenizer, config: Smoke, data: Path | None) -> list[ChatPrompt]:
    """`num_prompts` chat prompts: DATA's, or the built-in sets (eval split first, every traffic
    type interleaved). Prompts longer than MAX_PROMPT_TOKENS are skipped, not cut: a cut chat
    prompt loses its assistant header and the model would continue the user's text."""
    records = (
        load_records(data)
        if data
        else builtin_records("eval", stdlib_files=0) + builtin_records("calib", stdlib_files=0)
    )
    return chat_prompts(records, tokenizer, max_tokens=MAX_PROMPT_TOKENS, fit="skip", limit=config.num_prompts)


def _side(engine: LLMEngine, prompts: list[ChatPrompt], config: Smoke, label: str) -> tuple[dict, float]:
    by_mode, tps = {}, {}
    for mode in MODES:
        params = [
            params_for(mode, config.max_tokens, config.temperature, config.top_p, config.seed + i)
            for i in range(len(prompts))
        ]
        result = generate(engine, [p.token_ids for p in prompts], params, f"{label}, {mode}")
        by_mode[mode], tps[mode] = result.outputs, result.tokens_per_s
    return by_mode, tps


def _engine(path: Path, device: str, numerics: str) -> LLMEngine:
    return LLMEngine(path, EngineConfig(device=device, numerics=numerics, num_blocks=_NUM_BLOCKS))


def measure_smoke(
    artifact: Path, reference: Path, config: Smoke, data: Path | None, device: str = "cpu", numerics: str = "fast"
) -> dict[str, Any]:
    """Both sides in `numerics` (what serves); batch invariance is measured in it too."""
    engine = _engine(reference, device, numerics)
    prompts = smoke_prompts(engine.tokenizer, config, data)
    reference_outputs, reference_tps = _side(engine, prompts, config, "reference")
    del engine
    gc.collect()

    engine = _engine(artifact, device, numerics)
    invariance = check_invariance(engine, [p.token_ids for p in prompts], config)
    baseline = invariance.pop("baseline")
    artifact_outputs, artifact_tps = _side(engine, prompts, config, "artifact")
    draft_dir = artifact / "speculator"
    speculative = None
    if (draft_dir / "config.json").is_file() and baseline:
        speculative = check_speculative(engine, draft_dir, [p.token_ids for p in prompts], baseline, config)
        invariance["compositions"].append(speculative["composition"])
        invariance["diverged"] += speculative.pop("diverged")

    mine, theirs = Side(artifact_outputs, config), Side(reference_outputs, config)
    decode = lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    return {
        "num_prompts": len(prompts),
        "max_tokens": config.max_tokens,
        "numerics": numerics,
        "modes": list(MODES),
        "speculator": speculative is not None,
        **compare(mine, theirs, MODES),
        "batch_invariant": not invariance["diverged"],
        "invariance": invariance,
        "speculative": speculative,
        "throughput": {
            **{f"artifact_{m}_tokens_per_s": v for m, v in artifact_tps.items()},
            **{f"reference_{m}_tokens_per_s": v for m, v in reference_tps.items()},
        },
        "cases": worst_cases(mine, theirs, prompts, decode, config.num_examples),
    }


def smoke_table(result: dict[str, Any]) -> Table:
    table = Table(title=f"smoke: {result['num_prompts']} prompts x {', '.join(result['modes'])}", title_justify="left")
    for column in ("detector", "artifact", "reference", "difference"):
        table.add_column(column, justify="left" if column == "detector" else "right")
    for row in result["detectors"]:
        table.add_row(row["name"], f"{row['artifact']:.3f}", f"{row['reference']:.3f}", f"{row['difference']:+.3f}")
    diverged = result["invariance"]["diverged"]
    table.add_row("batch invariant", str(result["batch_invariant"]), "", f"{len(diverged)} divergences")
    return table


def run_smoke(
    run: RunDir, config: Smoke, data: Path | None, device: str = "cpu", numerics: str = "fast"
) -> dict[str, Any]:
    run.require("quantize")
    reference = run.source

    def body(stage: Stage) -> dict[str, Any]:
        torch.manual_seed(config.seed)
        result = measure_smoke(run.artifact, reference, config, data, device, numerics)
        throughput = result.pop("throughput")  # timings vary run to run: the manifest, not smoke.json
        atomic.write_json(stage.path(SMOKE), result)
        keys = ("loop_rate", "reference_loop_rate", "no_eos_rate", "distinct_2", "entropy_ratio", "batch_invariant")
        return {**{k: result[k] for k in keys}, "throughput": throughput}

    inputs = {
        "artifact": fingerprint(run.artifact),
        "smoke": config.model_dump(),
        "numerics": numerics,
        "data": fingerprint(data) if data else f"builtin:{fingerprint(CALIBRATION_DIR)}",
    }
    entry = run.run_stage("smoke", inputs, outputs=[folder(SMOKE)], body=body)
    console.print(smoke_table(json.loads(run.path(SMOKE).read_text())))
    return entry
