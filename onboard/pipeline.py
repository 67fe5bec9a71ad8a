"""`onboard run` and `onboard demo`: every stage in order, finished ones resumed, ending in a verdict."""

from pathlib import Path

from onboard.budget import resolve_budget
from onboard.errors import OnboardError

STAGES = ("quantize", "eval", "speculator", "adapt", "smoke", "report", "gate")
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
        # 40 outputs a side: one loop moves a rate by 2.5 pp and the excess carries about +-8 pp of
        # noise; the full profile (200 outputs a side) gates at the recipe's 0.1.
        "gate.max_loop_rate_excess": 0.2,
    },
    # Two responses per speculator prompt instead of the recipe's four, and 100 smoke prompts
    # instead of 120, keep the whole demo within 45 minutes on 2 cores.
    "full": {"speculator.responses_per_prompt": 2, "smoke.num_prompts": 100},
}


def profile_overrides(profile: str) -> dict[str, tuple[str, object]]:
    if profile not in DEMO_PROFILES:
        raise OnboardError(f"--profile {profile!r} is not one of {', '.join(DEMO_PROFILES)}")
    return {f"--profile {profile} ({key})": (key, value) for key, value in DEMO_PROFILES[profile].items()}


def run_pipeline(
    model: Path,
    out: Path,
    stages: list[str],
    recipe: Path | None,
    overrides: dict[str, tuple[str, object]],
    calib: Path | None = None,
    data: Path | None = None,
    allow_pickle: bool = False,
    trust_remote_code: bool = False,
    junit: Path | None = None,
    device: str = "cpu",
    numerics: str = "fast",
    max_memory: int | None = None,
) -> int:
    """Run `stages` of STAGES in order (engines on `device`, serving in `numerics`; adapt judges both),
    each in memory or streamed as the plan for `max_memory` (bytes; None: the default budget) says;
    the gate's exit code when it ran, else 0."""
    from onboard.cli_options import existing_data, recipe_with_overrides
    from onboard.models import resolve_model
    from onboard.workspace import RunDir

    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise OnboardError(f"unknown stage {unknown[0]!r}; stages are {', '.join(STAGES)}")
    # Everything the user gave is checked before the run directory is touched.
    checkpoint = resolve_model(model, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)
    resolved = recipe_with_overrides(checkpoint, recipe, overrides)
    calib, data = existing_data(calib), existing_data(data)
    budget = resolve_budget(max_memory)
    plans = {plan.stage: plan for plan in run_plan(checkpoint, resolved, stages, budget)}
    spec, reference_spec = deployment_specs(resolved.deployment)
    with RunDir(out) as run:
        run.record_recipe(resolved)
        if "quantize" in stages:
            from onboard.quantize.stage import run_quantize

            run_quantize(run, checkpoint, resolved.quantize, calib, budget)
        if "eval" in stages:
            from onboard.evaluate.stage import run_eval

            run_eval(run, resolved.eval, data, max_memory=budget)
        if "speculator" in stages:
            from onboard.speculator.stage import run_speculator

            run_speculator(
                run, resolved.speculator, None, device=device, numerics=numerics, max_memory=budget, endpoint=spec
            )
        if "adapt" in stages:
            from onboard.adapt.stage import run_adapt, run_layerwise
            from onboard.models import inspect_checkpoint

            run.require("quantize")
            streamed = plans["adapt"].path == "streamed"
            (run_layerwise if streamed else run_adapt)(run, inspect_checkpoint(run.artifact), device)
        if "smoke" in stages:
            if plans["smoke"].path == "endpoint":
                from onboard.smoke.endpoint import run_endpoint_smoke

                run_endpoint_smoke(run, resolved.smoke, data, spec, reference_spec, device, numerics)
            else:
                from onboard.smoke.stage import run_smoke

                run_smoke(run, resolved.smoke, data, device, numerics)
        return finish(run.root, "report" in stages, "gate" in stages, junit)


def deployment_specs(deployment):
    """The recipe's (or the command line's) servers as EndpointSpecs, None where not given."""
    from onboard.endpoint import EndpointSpec

    spec = EndpointSpec(deployment.endpoint, deployment.served_model, None) if deployment.endpoint else None
    reference = deployment.reference_endpoint
    reference_spec = EndpointSpec(reference, deployment.reference_model, None) if reference else None
    return spec, reference_spec


def run_plan(checkpoint, recipe, stages: list[str], budget: int) -> list:
    """Each chosen stage's path under `budget`, printed as a table before anything runs; a stage
    that fits no path refuses in one line here, before the run directory is touched.  Estimates
    use the unquantized checkpoint for both sides (the artifact is smaller)."""
    from onboard.budget import model_shape, plan_stage, plan_table
    from onboard.console import console
    from onboard.quantize.stage import quantize_plan

    shape = model_shape(checkpoint.path)
    deployment = recipe.deployment
    plans = []
    if "quantize" in stages:
        plans.append(quantize_plan(checkpoint, recipe.quantize, budget))
    if "eval" in stages:
        tokens = recipe.eval.max_tokens + shape.num_layers * recipe.eval.per_layer_tokens
        plans.append(plan_stage("eval", shape, budget, tokens))
    if "speculator" in stages:
        from onboard.speculator.stage import speculator_plan

        # over the budget: trained on streamed data, measured on --endpoint when given
        plans.append(speculator_plan(checkpoint.path, recipe.speculator, budget, bool(deployment.endpoint)))
    if "adapt" in stages:
        from onboard.adapt.stage import adapt_plan

        plans.append(adapt_plan(checkpoint, budget))
    if "smoke" in stages:
        both = bool(deployment.endpoint and deployment.reference_endpoint)
        options = "--endpoint URL --reference-endpoint URL"
        plans.append(plan_stage("smoke", shape, budget, 0, endpoint=both, options=options))
    console.print(plan_table(plans, budget))
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
    return code
