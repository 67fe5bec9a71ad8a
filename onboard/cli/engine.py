"""The engine-facing commands: `adapt`, `bench`, `bench-kv` and `serve` (registered on the app by `cli/__init__.py`)."""

from pathlib import Path
from typing import Annotated

import typer

from onboard.cli.options import (
    DeviceOpt,
    DtypeOpt,
    MaxMemoryOpt,
    NumericsOpt,
    PickleOpt,
    check_device,
    check_numerics,
    memory_budget,
    torch_dtype,
)
from onboard.data import existing_data
from onboard.deploy.artifact import MTP, is_mtp, speculator_of
from onboard.errors import OnboardError
from onboard.workspace import model_dir_of


def adapt(
    path: Annotated[Path, typer.Argument(help="a run directory (its artifact) or a checkpoint directory")],
    out: Annotated[Path | None, typer.Option(help="where adapt/parity.json goes (default: the run directory)")] = None,
    allow_pickle: PickleOpt = False,
    layerwise: Annotated[
        bool, typer.Option("--layerwise", help="compare one decoder layer at a time (checkpoints larger than memory)")
    ] = False,
    device: DeviceOpt = "cpu",
    dtype: DtypeOpt = "bf16",
    max_memory: MaxMemoryOpt = None,
) -> None:
    """Map the checkpoint onto the reference engine and prove logit parity with transformers; over
    --max-memory (both models resident), layer by layer as --layerwise."""
    from onboard.adapt.stage import adapt_plan, resolve_target, run_adapt, run_layerwise
    from onboard.budget import model_shape
    from onboard.models import inspect_checkpoint
    from onboard.stage import engine_model_for
    from onboard.workspace import RunDir

    model_dir, run_dir = resolve_target(path, out)
    torch_type, device = torch_dtype(dtype), check_device(device)
    checkpoint = inspect_checkpoint(model_dir, allow_pickle=allow_pickle)
    engine_model_for(checkpoint)  # an unsupported architecture fails before RUN_DIR is touched
    layerwise = layerwise or adapt_plan(model_shape(checkpoint.path), memory_budget(max_memory)).path == "streamed"
    if layerwise:
        from onboard.models.layers import check_layerwise

        check_layerwise(model_dir)
    with RunDir(run_dir) as run:
        (run_layerwise if layerwise else run_adapt)(run, checkpoint, device, torch_type)


def bench(
    path: Annotated[
        Path,
        typer.Argument(
            help="a run directory (its artifact), a checkpoint directory or a .gguf file; with --endpoint, only "
            "its tokenizer is used, to render the prompts every server gets"
        ),
    ],
    data: Annotated[Path | None, typer.Option(help="prompts (default: the project's eval split)")] = None,
    out: Annotated[
        Path | None,
        typer.Option(help="also write the figures to this JSON file (a run directory's: RUN_DIR/bench/bench.json)"),
    ] = None,
    speculator: Annotated[
        bool, typer.Option("--speculator", help="measure RUN_DIR/artifact/speculator against the engine alone")
    ] = False,
    compare: Annotated[
        list[Path] | None, typer.Option(help="with --speculator: other speculator exports to measure alongside")
    ] = None,
    num_prompts: Annotated[int, typer.Option(help="with --speculator: held-out prompts")] = 24,
    max_tokens: Annotated[
        int | None, typer.Option(min=1, help="tokens generated per request (--speculator: 96, --endpoint: 64)")
    ] = None,
    device: DeviceOpt = "cpu",
    endpoint: Annotated[
        list[str] | None,
        typer.Option(
            help="load-test this OpenAI-compatible server (vLLM, SGLang, onboard serve) instead; repeat it to "
            "compare servers side by side"
        ),
    ] = None,
    served_model: Annotated[
        list[str] | None,
        typer.Option(help="with --endpoint: the model id, one for all or one per --endpoint (default: the only one)"),
    ] = None,
    api_key: Annotated[
        str | None, typer.Option(help="with --endpoint: sent as `Authorization: Bearer KEY` to every server")
    ] = None,
    concurrency: Annotated[
        str | None, typer.Option(help="with --endpoint: requests in flight, a sweep, comma-separated (default: 1,4,16)")
    ] = None,
    num_requests: Annotated[
        int | None,
        typer.Option(min=1, help="with --endpoint: requests per concurrency level (default: 4 x concurrency, >= 8)"),
    ] = None,
    max_memory: MaxMemoryOpt = None,
) -> None:
    """The engine in exact and fast numerics against transformers.generate and llama.cpp (the demo's
    released GGUF, concurrency 1): tokens/s at concurrency 1, 16 and 64 with ratios, prefix-cache TTFT;
    with --speculator, the speculator's acceptance and speed-up in the engine (fast numerics) instead; with
    --endpoint, servers under load (streamed completions at each --concurrency: TTFT, inter-token
    latency, time per output token, end-to-end latency, tokens/s), side by side."""
    from onboard import atomic
    from onboard.console import console
    from onboard.models import inspect_checkpoint, resolve_model

    model_dir = model_dir_of(path)
    if endpoint:
        from onboard.bench.kv import parse_positive_ints
        from onboard.bench.serve import CONCURRENCY, MAX_TOKENS, endpoint_specs, print_table, run_serve_bench

        if speculator or compare:
            raise OnboardError("--speculator and --compare measure in the engine; --endpoint measures servers")
        if not (model_dir / "config.json").is_file():
            raise OnboardError(f"{model_dir} has no config.json: not a checkpoint (or a run without an artifact)")
        specs = endpoint_specs(endpoint, served_model, api_key)
        levels = parse_positive_ints("--concurrency", concurrency or CONCURRENCY)
        result = run_serve_bench(model_dir, specs, existing_data(data), levels, max_tokens or MAX_TOKENS, num_requests)
        print_table(result)
        if out:
            atomic.write_json(out, result)
        return
    given = {"--served-model": served_model, "--api-key": api_key, "--concurrency": concurrency}
    given["--num-requests"] = num_requests
    for flag, value in given.items():
        if value:
            raise OnboardError(f"{flag} needs --endpoint")
    gguf = path if path.suffix.lower() == ".gguf" else None
    if gguf is not None and speculator:
        raise OnboardError("--speculator measures a run directory's speculator, not a .gguf file")
    checkpoint = inspect_checkpoint(model_dir) if gguf is None else resolve_model(gguf)
    device = check_device(device)
    if gguf is None:  # the engine and its peers each hold the model: over the budget, bench the servers
        from onboard.budget import model_shape, plan_stage

        plan_stage("bench", model_shape(model_dir), memory_budget(max_memory), 0, options="--endpoint URL")
    if speculator:
        from onboard.speculator.measure import run_spec_bench

        found = speculator_of(model_dir, None, None)  # its speculator/, else its MTP layers
        if found is None:
            raise OnboardError(
                f"{model_dir} has neither a speculator/ nor MTP layers; run `onboard speculator {path}` first"
            )
        draft_dir = found.path if found.path is not None else Path(MTP)
        for other in compare or []:
            if not is_mtp(other) and not (other / "config.json").is_file():
                raise OnboardError(f"--compare {other}: not a speculator export (no config.json), nor `mtp`")
        result = run_spec_bench(
            model_dir, draft_dir, compare or [], existing_data(data), num_prompts, max_tokens or 96, device
        )
    else:
        from onboard.bench.engine import bench_table, run_bench

        result = run_bench(checkpoint, existing_data(data), device, gguf=gguf)
        console.print(bench_table(result))
        out = bench_out(path, out)
    if out:
        atomic.write_json(out, result)


def bench_kv(
    contexts: Annotated[
        str, typer.Option(help="decode contexts in tokens, comma-separated")
    ] = "1024,2048,4096,8192,16384",
    batches: Annotated[str, typer.Option(help="decode batch sizes, comma-separated")] = "1,4",
    numerics: Annotated[
        str, typer.Option(help="fast (as served), absorbed (fast with the weight-absorbed MLA decode), exact")
    ] = "fast,absorbed,exact",
    repeats: Annotated[int, typer.Option(min=1, help="timed steps per point (the median is reported)")] = 7,
    index_topk: Annotated[int, typer.Option(min=1, help="the bench model's DSA top-k")] = 2048,
    out: Annotated[Path | None, typer.Option(help="also write the figures to this JSON file")] = None,
    device: DeviceOpt = "cpu",
) -> None:
    """KV-cache bytes per token of every supported family (full-size configs), and a decode step's time
    against the context on a small random DSA model, beside the same model as dense MLA."""
    from onboard.bench.kv import parse_numerics, parse_positive_ints, run_bench_kv

    chosen = parse_positive_ints("--contexts", contexts), parse_positive_ints("--batches", batches)
    run_bench_kv(*chosen, parse_numerics(numerics), repeats, index_topk, check_device(device), out)


def serve(
    path: Annotated[Path, typer.Argument(help="a run directory (its artifact) or a checkpoint directory")],
    engine: Annotated[
        str, typer.Option(help="onboard (the built-in server) | vllm | sglang (print their command; --exec runs it)")
    ] = "onboard",
    host: Annotated[str, typer.Option(help="address to bind (127.0.0.1: this machine only)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 8000,
    api_key: Annotated[str | None, typer.Option(help="require `Authorization: Bearer KEY` (not on /health)")] = None,
    served_model_name: Annotated[str | None, typer.Option(help="the model id (default: the directory name)")] = None,
    max_model_len: Annotated[
        int | None,
        typer.Option(help="prompt + completion tokens (default: 4096; vllm/sglang: max_position_embeddings)"),
    ] = None,
    device: Annotated[
        str | None, typer.Option(help="--engine onboard: torch device the engine runs on (cpu, cuda, cuda:1, ...)")
    ] = None,
    speculator: Annotated[
        Path | None,
        typer.Option(
            help="an EAGLE-3 export (e.g. RUN_DIR/artifact/speculator), or `mtp`: the checkpoint's own MTP "
            "layers; speculative decoding (vllm/sglang: the artifact's speculator/, else its MTP layers)"
        ),
    ] = None,
    num_speculative_tokens: Annotated[
        int | None, typer.Option(min=1, help="with --speculator: tokens proposed per step (default: the export's)")
    ] = None,
    tp: Annotated[int | None, typer.Option(min=1, help="vllm/sglang: tensor-parallel GPUs")] = None,
    execute: Annotated[
        bool, typer.Option("--exec", help="vllm/sglang: run the command in place of onboard (else only print it)")
    ] = False,
    python: Annotated[
        str | None, typer.Option(help="vllm/sglang: the interpreter that has the engine (default: this one)")
    ] = None,
    max_logprobs: Annotated[
        int,
        typer.Option(min=-1, help="most logprobs / top_logprobs / prompt_logprobs per request (-1: no limit)"),
    ] = 20,
    numerics: NumericsOpt = "fast",
    batch_invariant: Annotated[
        bool,
        typer.Option(
            help="a request's tokens do not depend on what else is batched (what `smoke` checks); "
            "--no-batch-invariant: fast numerics' fastest kernels, as vLLM serves by default"
        ),
    ] = True,
) -> None:
    """OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /metrics) on the engine;
    with --engine vllm|sglang, the production engine's command for the artifact (RUN_DIR/serve/ENGINE.sh)."""
    from onboard import deploy

    engine = deploy.check_engine_name(engine)
    if engine != "onboard":
        if device is not None:
            raise OnboardError(f"--device is an option of the built-in engine, not of --engine {engine}")
        if numerics != "fast" or not batch_invariant:
            option = "--numerics" if numerics != "fast" else "--no-batch-invariant"
            raise OnboardError(f"{option} is an option of the built-in engine, not of --engine {engine}")
        if engine == "sglang" and max_logprobs != 20:  # vLLM's default and ours
            raise OnboardError("--max-logprobs applies to vllm and the built-in engine, not to --engine sglang")
        deploy.serve_external(
            path,
            engine,
            python=python,
            host=host,
            port=port,
            served_model_name=served_model_name,
            api_key=api_key,
            tensor_parallel=tp,
            max_model_len=max_model_len,
            speculator=speculator,
            num_speculative_tokens=num_speculative_tokens,
            max_logprobs=max_logprobs,
            execute=execute,
        )
        return
    for flag, value in (("--tp", tp), ("--exec", execute or None), ("--python", python)):
        if value is not None:
            raise OnboardError(f"{flag} is an option of --engine vllm|sglang, not of the built-in engine")

    from onboard.engine import EngineConfig
    from onboard.server import serve as run_server

    model_dir = model_dir_of(path)
    if not (model_dir / "config.json").is_file():
        raise OnboardError(f"{model_dir} has no config.json: not a checkpoint (or a run without an artifact)")
    if speculator is not None and not is_mtp(speculator) and not (speculator / "config.json").is_file():
        raise OnboardError(f"--speculator {speculator}: not a speculator export (no config.json)")
    if is_mtp(speculator):
        speculator_of(model_dir, speculator, num_speculative_tokens)  # one line when it has no MTP layers
    device = check_device(device or "cpu")
    numerics = check_numerics(numerics)
    if numerics == "exact" and not batch_invariant:
        raise OnboardError("--no-batch-invariant needs --numerics fast: exact numerics is always batch invariant")
    config = EngineConfig(
        **({"max_model_len": max_model_len} if max_model_len else {}),
        max_logprobs=max_logprobs,
        numerics=numerics,
        batch_invariant=batch_invariant,
    )
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


def bench_out(path: Path, out: Path | None) -> Path | None:
    """Where the engine bench's figures go: --out, else a run directory's bench/bench.json (the
    report's Throughput card), else nowhere."""
    from onboard.workspace import BENCH, RunDir, is_run

    return out if out is not None or not is_run(path) else RunDir(path).path(BENCH)
