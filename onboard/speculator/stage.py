"""`onboard speculator RUN_DIR`: data from the served artifact, EAGLE-3 training, export, acceptance.

Outputs: `speculator/data/` (captured shards), `speculator/train.json` (per-epoch history),
`speculator/metrics.json` (contract keys, measured in the engine) and `artifact/speculator/`.
Work that takes minutes lives in `RUN_DIR/speculator-work/` until the stage finishes: the
captured data (reused while its inputs are unchanged) and the training checkpoint (resumed from
its last finished epoch), so an interrupted run picks up where it stopped.

Over the memory budget (`plan.speculator_plan`) no engine is built (`streamed_stage.py`): the data is
teacher-forced text captured by streaming the checkpoint one decoder layer at a time, the draft
starts from the checkpoint's tensors, and the acceptance is measured on the deployment given as
`endpoint`, or recorded as not measured with the command that measures it.
"""

import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from onboard import atomic
from onboard.budget import (
    StagePlan,
    human,
    model_shape,
    resolve_budget,
)
from onboard.console import console
from onboard.endpoint import EndpointSpec
from onboard.errors import OnboardError
from onboard.models.mtp import has_mtp_layers
from onboard.recipes import SpeculatorSettings
from onboard.speculator import parallel
from onboard.speculator.capture import capture_shards
from onboard.speculator.data import (
    TRAFFIC,
    TrainingSequence,
    default_aux_layers,
    draft_vocabulary,
    generate_responses,
    split_data,
    training_prompts,
)
from onboard.speculator.draft import Eagle3Draft
from onboard.speculator.export import export_speculator
from onboard.speculator.measure import acceptance_table, held_out_prompts, measure_acceptance
from onboard.speculator.mtp_stage import (
    after_training,
    engine_mtp,
    measure_mtp,
    mtp_outputs,
    mtp_table,
    summary,
    trainable,
    write_mtp_layers,
)
from onboard.speculator.plan import capture_key, engine_config, speculator_plan
from onboard.speculator.streamed_stage import streamed_body, streamed_sequences
from onboard.speculator.target import engine_draft
from onboard.speculator.teacher import (
    data_files_key,
    resolve_data_files,
    teacher_forced_answers,
    teacher_forced_code,
)
from onboard.speculator.work import captured_data, data_metrics, finish, train_captured
from onboard.stage import StageContext, StageResult, engine_refusal, require_engine, skipped
from onboard.workspace import DRAFT, SPECULATOR_METRICS, SPECULATOR_WORK, RunDir, Stage, folder


def build_draft(engine, vocab: torch.Tensor, aux_layers: list[int], from_last_layer: bool = False) -> Eagle3Draft:
    return engine_draft(engine, vocab, aux_layers, from_last_layer)


def run_speculator(
    run: RunDir,
    settings: SpeculatorSettings,
    data: Path | None,
    states_from: Path | None = None,
    device: str = "cpu",
    numerics: str = "fast",
    max_memory: int | None = None,
    endpoint: EndpointSpec | None = None,
) -> dict[str, Any]:
    """`states_from`: another checkpoint (e.g. the BF16 original) whose responses and hidden states
    the draft is trained on instead of the artifact's; it is still measured on the artifact.
    `numerics` (`EngineConfig.numerics`): the engine's, for generation, capture and measurement.
    Over `max_memory` (bytes; None: the default budget), the data comes from a streamed pass (in
    exact numerics: transformers' layers) and `endpoint` measures; without one, nothing does."""
    parallel.init()  # under torchrun: every process trains, the main one alone does the rest
    quantize = run.require("quantize")
    answers = resolve_data_files(settings.teacher_forced_data)  # a missing file fails before any work
    budget = resolve_budget(max_memory)
    sources: dict[str, list[TrainingSequence]] = {}

    def streamed_tokens() -> int:  # the streamed path's data, tokenized for its estimate (no model loaded)
        from onboard.models import inspect_checkpoint, load_tokenizer

        tokenizer = load_tokenizer(inspect_checkpoint(run.artifact))
        train_records = split_data(data, settings.eval_prompts)[0] if data else None
        sources.update(streamed_sequences(tokenizer, settings, train_records, answers))
        return sum(len(seq.token_ids) for part in sources.values() for seq in part)

    checkpoint = Path(states_from or run.artifact)
    plan = speculator_plan(model_shape(checkpoint), settings, budget, endpoint is not None, streamed_tokens)
    if plan.path == "endpoint":
        raise OnboardError(
            f"speculator: training needs about {human(plan.streamed or plan.in_memory)} streamed, over the "
            f"{human(budget)} budget (--max-memory); a deployment only measures a speculator "
            f"(onboard speculator {run.root} --endpoint URL)"
        )
    streamed = plan.path == "streamed"
    if settings.draft == "mtp":
        if not has_mtp_layers(run.artifact):
            raise OnboardError(
                f"--draft mtp: {run.artifact} has no MTP layers (families without them train EAGLE-3, the default)"
            )
        if streamed:
            raise OnboardError(
                "--draft mtp fine-tunes in memory; over the memory budget only EAGLE-3 trains (streamed)"
            )
    if streamed:
        numerics = "exact"  # transformers' layers, as exact numerics' engine computes them
    answers_key = data_files_key(answers)
    data_key = capture_key(quantize["key"], settings, data, states_from, numerics, answers_key, plan.path)
    if streamed:
        body = streamed_body(run, settings, data, states_from, data_key, sources, endpoint)
    else:
        config = engine_config(settings, device, numerics)
        body = _in_memory_body(run, settings, data, states_from, answers, data_key, config)
    inputs = {
        "artifact": str(run.artifact.resolve()),
        "settings": settings.model_dump(),
        "data": str(Path(data).resolve()) if data else None,
        "states_from": str(Path(states_from).resolve()) if states_from else None,
        "numerics": numerics,
        "teacher_forced_data": answers_key,
        "memory_path": plan.path,
        "endpoint": endpoint.base if streamed and endpoint else None,  # in memory, the engine measures
    }
    # --draft mtp rewrites the artifact's MTP shards (as they were unless the fine-tuned layers accept more)
    outputs = [folder(SPECULATOR_METRICS), *(mtp_outputs(run.artifact) if settings.draft == "mtp" else [DRAFT])]
    fresh = parallel.from_main(lambda: run.cached("speculator", inputs, outputs) is None)
    if not parallel.is_main():  # trains alongside the main process; writes nothing of the run
        if not fresh:
            return {}
        with tempfile.TemporaryDirectory(prefix=f"onboard-rank{parallel.rank()}-") as scratch:
            return body(Stage(name="speculator", staging=Path(scratch), run=run))
    entry = run.run_stage("speculator", inputs, outputs, body)
    atomic.remove(run.path(SPECULATOR_WORK))
    return entry


def _in_memory_body(
    run: RunDir,
    settings: SpeculatorSettings,
    data: Path | None,
    states_from: Path | None,
    answers: list[Path],
    data_key: str,
    config,
) -> Callable[[Stage], dict[str, Any]]:
    """The engine generates the responses, captures the states and measures the acceptance."""
    from onboard.engine import LLMEngine

    work = run.path(SPECULATOR_WORK)

    def body(stage: Stage) -> dict[str, Any]:
        torch.manual_seed(0)
        engine = LLMEngine(run.artifact, config)
        tokenizer = engine.tokenizer
        layers = engine.hf_config.get_text_config().num_hidden_layers
        mtp_draft = settings.draft == "mtp"
        aux_layers = [layers] if mtp_draft else settings.aux_layers or default_aux_layers(layers)
        started = time.perf_counter()
        # With DATA, its last rows are held out and measured on; without, the eval split.
        train_records, eval_records = split_data(data, settings.eval_prompts) if data else (None, None)

        def capture(out_dir: Path) -> dict:
            prompts = training_prompts(
                tokenizer, settings.traffic, train_records, settings.num_prompts, settings.max_prompt_tokens
            )
            source = LLMEngine(states_from, config) if states_from else engine
            sequences = generate_responses(
                source,
                prompts,
                settings.max_new_tokens,
                settings.responses_per_prompt,
                settings.response_temperature,
            )
            if settings.traffic in ("code", "mixed"):
                sequences += teacher_forced_code(tokenizer, settings.stdlib_files, settings.max_seq_len)
            if answers:
                limit, max_prompt = settings.teacher_forced_max_sequences, settings.max_prompt_tokens
                sequences += teacher_forced_answers(tokenizer, answers, limit, max_prompt, settings.max_seq_len)
            return capture_shards(source, sequences, aux_layers, out_dir)

        with parallel.main_first("speculator: capturing the data"):  # the others then reuse it
            work_data, index = captured_data(work, data_key, capture)
        data_seconds = time.perf_counter() - started

        traffic = TRAFFIC[settings.traffic]
        held_out = held_out_prompts(
            tokenizer, traffic, eval_records or None, settings.eval_prompts, settings.max_prompt_tokens
        )
        k, max_tokens = settings.num_speculative_tokens, settings.eval_max_tokens
        head = engine.target_tensors()["lm_head"]
        mtp: dict[str, Any] | None = None
        if mtp_draft:
            vocab = torch.arange(engine.vocab_size)
            if parallel.is_main():
                mtp, shipped = measure_mtp(engine, run, config, held_out, k, max_tokens)
            draft = trainable(engine_mtp(engine, run.artifact))
        else:
            vocab = draft_vocabulary(work_data, settings.draft_vocab_size, engine.vocab_size)
            draft = build_draft(engine, vocab, aux_layers, settings.init_from_last_layer)
        history, train, train_seconds = train_captured(draft, work, head, settings, data_key)
        if not parallel.is_main():
            return {}
        metrics = measure_acceptance(engine, draft, k, held_out, max_tokens)
        if mtp_draft:
            kept = after_training(shipped, metrics)
            write_mtp_layers(draft, run.artifact, stage, kept)
            mtp.update(retrained=summary(metrics), written_back=kept)
            console.print(
                f"speculator: MTP layers fine-tuned on the artifact's states: acceptance "
                f"{shipped['acceptance_length']:.2f} -> {metrics['acceptance_length']:.2f}"
                + (" (written back into the artifact)" if kept else " (not kept: the shipped layers accept as much)")
            )
            metrics = metrics if kept else shipped
        else:
            export_speculator(draft, stage.path(DRAFT), run.artifact.resolve(), k)
            if has_mtp_layers(run.artifact):
                mtp, _ = measure_mtp(engine, run, config, held_out, k, max_tokens)
        metrics.update(
            draft=settings.draft,
            data_seconds=round(data_seconds, 1),
            train_seconds=round(train_seconds, 1),
            **data_metrics(index, aux_layers, vocab, config.numerics),
            memory_path="in-memory",
            measured_on="engine",
            **({"mtp": mtp} if mtp else {}),
        )
        finish(stage, metrics, history, train, work)
        console.print(acceptance_table(metrics))
        if mtp:
            console.print(mtp_table(mtp))
        return {k: metrics[k] for k in ("acceptance_length", "speedup", "num_speculative_tokens")}

    return body


def plan(ctx: StageContext) -> StagePlan:
    """Over the budget: trained on streamed data, measured on `ctx.endpoint` when given (no engine)."""
    planned = speculator_plan(ctx.shape, ctx.recipe.speculator, ctx.budget, ctx.endpoint is not None)
    if planned.path == "in-memory":  # the engine generates, captures and measures
        lacks = engine_refusal(ctx.checkpoint)
        if lacks and ctx.skip_adapt:
            return skipped("speculator", f"--skip-adapt: it trains on the reference engine's hidden states ({lacks})")
        require_engine(ctx, "speculator")
    return planned


def run(run_dir: RunDir, ctx: StageContext) -> StageResult:
    settings = ctx.recipe.speculator
    return run_speculator(
        run_dir, settings, None, device=ctx.device, numerics=ctx.numerics, max_memory=ctx.budget, endpoint=ctx.endpoint
    )
