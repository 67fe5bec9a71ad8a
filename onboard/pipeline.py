"""`onboard run` and `onboard demo`: a loop over the stage table, finished stages resumed, ending in a verdict."""

import importlib
from pathlib import Path

from onboard.budget import StagePlan, resolve_budget
from onboard.errors import OnboardError
from onboard.stage import SKIPPED, StageContext, StageModule

# The stages that work in the run directory, in the order they run: each module has the pair
# `plan(ctx)` and `run(run_dir, ctx)` (`onboard/stage.py`). A new stage is a package and a row here.
STAGE_MODULES: dict[str, str] = {
    "quantize": "onboard.quantize.stage",
    "eval": "onboard.evaluate.stage",
    "speculator": "onboard.speculator.stage",
    "adapt": "onboard.adapt.stage",
    "smoke": "onboard.smoke.stage",
}
# Then the run is judged: the verdict (gate.json) and the page that shows it (report.html).
STAGES = (*STAGE_MODULES, "report", "gate")
# The demo model's searched mixed-precision selection, pinned: the demo reproduces it, no search.
DEMO_RECIPE = "smollm2-mixed.yaml"

# The quick profile keeps CI and a first look short; full uses the recipe's own numbers.
DEMO_PROFILES: dict[str, dict[str, object]] = {
    "quick": {
        "quantize.calibration.num_samples": 16,
        "eval.max_tokens": 4096,
        "eval.per_layer_tokens": 1024,
        "speculator.num_prompts": 48,
        "speculator.max_new_tokens": 64,
        "speculator.responses_per_prompt": 1,
        "speculator.stdlib_files": 4,
        "speculator.epochs": 3,
        "speculator.eval_prompts": 12,
        "speculator.eval_max_tokens": 32,
        # Eight parity prompts instead of the recipe's 16 halve adapt (388 s here, 24 s a prompt).
        "adapt.num_prompts": 8,
        "smoke.num_prompts": 20,
        "smoke.max_tokens": 128,
        "smoke.invariance_prompts": 4,
        "smoke.invariance_max_tokens": 48,
        # Three epochs on ~8k tokens check that the stage works, not how good a draft gets: a draft
        # that learned nothing (misaligned states, a broken export) stays at ~1.0. Half that
        # (24 prompts, 2 epochs, 6 eval prompts) measured 1.04-1.09 depending on the artifact.
        "gate.min_acceptance_length": 1.05,
        # 40 outputs a side: one loop or run-on moves a rate by 2.5 pp and the excess carries about
        # +-8 pp of noise; the full profile (200 outputs a side) gates at the recipe's 0.1.  Two
        # correct artifacts of one recipe (calibration summed in another order, on two CPUs)
        # measured run-on excesses of 0.05 and 0.15 against that 0.1.
        "gate.max_loop_rate_excess": 0.2,
        "gate.max_run_on_excess": 0.2,
    },
    # Two responses per speculator prompt instead of the recipe's four, and 100 smoke prompts
    # instead of 120, keep the whole demo within 45 minutes on 2 cores.
    "full": {"speculator.responses_per_prompt": 2, "smoke.num_prompts": 100},
}


def profile_overrides(profile: str) -> dict[str, tuple[str, object]]:
    if profile not in DEMO_PROFILES:
        raise OnboardError(f"--profile {profile!r} is not one of {', '.join(DEMO_PROFILES)}")
    return {f"--profile {profile} ({key})": (key, value) for key, value in DEMO_PROFILES[profile].items()}


def stage_module(name: str) -> StageModule:
    return importlib.import_module(STAGE_MODULES[name])  # type: ignore[return-value]


def stage_context(
    model: Path,
    recipe: Path | None,
    overrides: dict[str, tuple[str, object]],
    *,
    calib: Path | None = None,
    data: Path | None = None,
    allow_pickle: bool = False,
    trust_remote_code: bool = False,
    device: str = "cpu",
    numerics: str = "fast",
    max_memory: int | None = None,
    skip_adapt: bool = False,
) -> StageContext:
    """Everything the user gave, checked before any run directory is touched: the model, the recipe
    with `overrides`, the data files, the budget (`max_memory` bytes; None: the default) and the
    recipe's (or the command line's) deployment."""
    from onboard.data import existing_data
    from onboard.models import resolve_model

    checkpoint = resolve_model(model, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)
    resolved = recipe_with_overrides(checkpoint, recipe, overrides)
    spec, reference_spec = deployment_specs(resolved.deployment)
    return StageContext(
        checkpoint=checkpoint,
        recipe=resolved,
        budget=resolve_budget(max_memory),
        device=device,
        numerics=numerics,
        endpoint=spec,
        reference_endpoint=reference_spec,
        calib=existing_data(calib),
        data=existing_data(data),
        skip_adapt=skip_adapt,
    )


def recipe_with_overrides(checkpoint, recipe_path: Path | None, overrides: dict[str, tuple[str, object]]):
    """The recipe (explicit or matched by architecture) with overrides, {"--flag": ("dotted.key", value)},
    applied (None values are skipped)."""
    from onboard.console import console
    from onboard.recipes import load_recipe, recipe_for, with_overrides

    if recipe_path:
        recipe = load_recipe(recipe_path)
    else:
        recipe, recipe_path = recipe_for(checkpoint.architectures)
    console.print(f"recipe: {recipe_path or 'built-in defaults'} ({recipe.name})")
    return with_overrides(recipe, overrides)


def run_pipeline(ctx: StageContext, out: Path, stages: list[str], junit: Path | None = None) -> int:
    """Run `stages` of STAGES in table order (engines on `ctx.device`, serving in `ctx.numerics`;
    adapt judges both), each in memory or streamed as its plan under `ctx.budget` says; the
    gate's exit code when it ran, else 0."""
    from onboard.workspace import RunDir

    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise OnboardError(f"unknown stage {unknown[0]!r}; stages are {', '.join(STAGES)}")
    plans = run_plan(ctx, stages)  # a stage that fits no path refuses here, before the run directory exists
    with RunDir(out) as run:
        run.record_recipe(ctx.recipe)
        for plan in plans:
            if plan.path == SKIPPED:
                run.record_skipped(plan.stage, plan.bound)
            else:
                stage_module(plan.stage).run(run, ctx)
        return finish(run.root, "report" in stages, "gate" in stages, junit)


def deployment_specs(deployment):
    """The recipe's (or the command line's) servers as EndpointSpecs, None where not given."""
    from onboard.endpoint import EndpointSpec

    spec = EndpointSpec(deployment.endpoint, deployment.served_model, None) if deployment.endpoint else None
    reference = deployment.reference_endpoint
    reference_spec = EndpointSpec(reference, deployment.reference_model, None) if reference else None
    return spec, reference_spec


def run_plan(ctx: StageContext, stages: list[str]) -> list[StagePlan]:
    """Each chosen stage's path under the budget, printed as a table before anything runs."""
    from onboard.budget import plan_table
    from onboard.console import console

    plans = [stage_module(name).plan(ctx) for name in STAGE_MODULES if name in stages]
    console.print(plan_table(plans, ctx.budget, ctx.shape))
    return plans


def finish(run_dir: Path, report: bool, gate: bool, junit: Path | None = None) -> int:
    """The verdict first (so the report's card shows it), then the report; the gate's exit code."""
    from onboard.console import console
    from onboard.gate import evaluate_gate, exit_code, gate_table, write_gate

    code = 0
    if gate:
        result = evaluate_gate(run_dir)
        write_gate(run_dir, result, junit)
        code = exit_code(result)
    if report:
        from onboard.report import write_report

        console.print(f"report: {write_report(run_dir)}")
    if gate:
        console.print(gate_table(result))
        for stage, reason in result["skipped"].items():
            console.print(f"{stage} skipped: {reason}")
    return code
