"""The release commands: `smoke`, `report` and `gate` (registered on the app by `cli/__init__.py`)."""

from pathlib import Path
from typing import Annotated

import typer

from onboard.cli.options import (
    ApiKeyOpt,
    DataOpt,
    DeviceOpt,
    EndpointOpt,
    JunitOpt,
    NumericsOpt,
    ServedModelOpt,
    check_device,
    check_numerics,
    endpoint_spec,
)
from onboard.data import existing_data
from onboard.errors import OnboardError

RunDirArg = Annotated[Path, typer.Argument(help="a run directory")]


def _run_dir(path: Path) -> Path:
    from onboard.workspace import RunDir

    return RunDir.open(path).root


def smoke(
    run_dir: Annotated[Path, typer.Argument(help="a run directory with a finished quantize stage")],
    data: DataOpt = None,
    num_prompts: Annotated[int | None, typer.Option(help="prompts (default: the recipe's)")] = None,
    max_tokens: Annotated[int | None, typer.Option(help="tokens generated per prompt (default: the recipe's)")] = None,
    device: DeviceOpt = "cpu",
    numerics: NumericsOpt = "fast",
    endpoint: EndpointOpt = None,
    served_model: ServedModelOpt = None,
    api_key: ApiKeyOpt = None,
    reference_endpoint: Annotated[
        str | None, typer.Option(help="with --endpoint: a second server as the reference (default: the local engine)")
    ] = None,
    reference_model: Annotated[str | None, typer.Option(help="with --reference-endpoint: its model id")] = None,
) -> None:
    """Token loops, run-ons, mode and entropy collapse, garbage and batch invariance: the artifact
    (with its speculator) against the unquantized reference on the same prompts; with --endpoint,
    what that server generates, into RUN_DIR/endpoints/NAME/smoke/smoke.json."""
    from onboard.recipes import with_overrides
    from onboard.smoke.stage import run_smoke
    from onboard.workspace import RunDir

    run = RunDir(_run_dir(run_dir))
    recipe = with_overrides(
        run.recipe(),
        {"--num-prompts": ("smoke.num_prompts", num_prompts), "--max-tokens": ("smoke.max_tokens", max_tokens)},
    )
    data, device = existing_data(data), check_device(device)
    spec = endpoint_spec(endpoint, served_model, api_key)
    if reference_endpoint and spec is None:
        raise OnboardError("--reference-endpoint needs --endpoint")
    reference_spec = endpoint_spec(reference_endpoint, reference_model, api_key if reference_endpoint else None)
    with run:
        run.require("quantize")
        if spec is None:
            run_smoke(run, recipe.smoke, data, device, check_numerics(numerics))
        else:
            from onboard.smoke.endpoint import run_endpoint_smoke

            run_endpoint_smoke(run, recipe.smoke, data, spec, reference_spec, device, check_numerics(numerics))


def report(run_dir: RunDirArg) -> None:
    """RUN_DIR/report.html: one self-contained page (verdict, KL, speculator, parity, smoke, timings)."""
    from onboard.console import console
    from onboard.report import write_report

    console.print(f"report: {write_report(_run_dir(run_dir))}")


def gate(
    run_dir: RunDirArg,
    junit: JunitOpt = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="override a threshold of the recipe's gate: NAME=VALUE")
    ] = None,
) -> None:
    """Check the run against the recipe's release thresholds: RUN_DIR/gate.json (and JUnit XML);
    exit 0 when every check passes, 1 when one fails, 2 when a stage it needs is missing."""
    from onboard.console import console
    from onboard.gate import evaluate_gate, exit_code, gate_table, gate_with_overrides, write_gate
    from onboard.workspace import RunDir

    run = RunDir(_run_dir(run_dir))
    thresholds = gate_with_overrides(run.recipe().gate, set_ or [])
    result = evaluate_gate(run_dir, thresholds)
    write_gate(run_dir, result, junit)
    console.print(gate_table(result))
    if result["missing"]:
        console.print(f"missing stages: {', '.join(result['missing'])}")
    for stage, reason in result["skipped"].items():
        console.print(f"{stage} skipped: {reason}")
    raise typer.Exit(exit_code(result))
