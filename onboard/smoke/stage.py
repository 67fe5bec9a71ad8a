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
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from onboard import atomic
from onboard.budget import StagePlan, plan_stage
from onboard.console import console
from onboard.data import ChatPrompt
from onboard.engine import EngineConfig, LLMEngine
from onboard.hashing import fingerprint
from onboard.paths import CALIBRATION_DIR
from onboard.recipes import Smoke
from onboard.smoke.analysis import Side, compare, smoke_table, worst_cases
from onboard.smoke.invariance import check_invariance, check_speculative
from onboard.smoke.passes import MODES, generate, params_for
from onboard.smoke.prompts import smoke_prompts
from onboard.stage import StageContext, StageResult, engine_refusal, require_engine
from onboard.workspace import SMOKE, RunDir, Stage, folder

# Room for every prompt at once: max_num_seqs sequences of prompt + max_tokens, in 16-token blocks.
_NUM_BLOCKS = 8192


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


def run_smoke(
    run: RunDir,
    config: Smoke,
    data: Path | None,
    device: str = "cpu",
    numerics: str = "fast",
    through: str = "engine",
) -> dict[str, Any]:
    """`through` "engine" (the reference engine, in `numerics`) or "transformers" (a family the
    engine does not run: `onboard run --skip-adapt`)."""
    run.require("quantize")
    reference = run.source

    def body(stage: Stage) -> dict[str, Any]:
        torch.manual_seed(config.seed)
        if through == "transformers":
            from onboard.smoke.transformers_side import measure_transformers_smoke

            result = measure_transformers_smoke(run.artifact, reference, config, data)
        else:
            result = measure_smoke(run.artifact, reference, config, data, device, numerics)
        throughput = result.pop("throughput")  # timings vary run to run: the manifest, not smoke.json
        atomic.write_json(stage.path(SMOKE), result)
        keys = ("loop_rate", "reference_loop_rate", "no_eos_rate", "distinct_2", "entropy_ratio", "batch_invariant")
        return {**{k: result[k] for k in keys}, "throughput": throughput}

    inputs = {
        "artifact": fingerprint(run.artifact),
        "smoke": config.model_dump(),
        "numerics": numerics,
        **({"through": through} if through != "engine" else {}),
        "data": fingerprint(data) if data else f"builtin:{fingerprint(CALIBRATION_DIR)}",
    }
    entry = run.run_stage("smoke", inputs, outputs=[folder(SMOKE)], body=body)
    console.print(smoke_table(json.loads(run.path(SMOKE).read_text())))
    return entry


TRANSFORMERS = "transformers"  # the plan's path when both sides generate through transformers (--skip-adapt)


def plan(ctx: StageContext) -> StagePlan:
    """Generating holds both models whole; over the budget, only a deployment of each can run it."""
    both = bool(ctx.endpoint and ctx.reference_endpoint)
    options = "--endpoint URL --reference-endpoint URL"
    planned = plan_stage("smoke", ctx.shape, ctx.budget, 0, endpoint=both, options=options)
    if planned.path != "endpoint":  # both sides generate through the reference engine
        if ctx.skip_adapt and engine_refusal(ctx.checkpoint):
            return replace(planned, path=TRANSFORMERS, bound="both models whole, generating through transformers")
        require_engine(ctx, "smoke")
    return planned


def run(run_dir: RunDir, ctx: StageContext) -> StageResult:
    path = plan(ctx).path
    if path == "endpoint":
        from onboard.smoke.endpoint import run_endpoint_smoke

        args = (ctx.recipe.smoke, ctx.data, ctx.endpoint, ctx.reference_endpoint, ctx.device, ctx.numerics)
        return run_endpoint_smoke(run_dir, *args)
    through = TRANSFORMERS if path == TRANSFORMERS else "engine"
    return run_smoke(run_dir, ctx.recipe.smoke, ctx.data, ctx.device, ctx.numerics, through)
