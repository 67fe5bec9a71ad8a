"""`onboard speculator RUN_DIR`: data from the served artifact, EAGLE-3 training, export, acceptance.

Outputs: `speculator/data/` (captured shards), `speculator/train.json` (per-epoch history),
`speculator/metrics.json` (contract keys, measured in the engine) and `artifact/speculator/`.
Work that takes minutes lives in `RUN_DIR/speculator-work/` until the stage finishes: the
captured data (reused while its inputs are unchanged) and the training checkpoint (resumed from
its last finished epoch), so an interrupted run picks up where it stopped.
"""

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from onboard import atomic
from onboard.console import console
from onboard.hashing import code_version, hash_json
from onboard.recipes import SpeculatorSettings
from onboard.speculator.capture import PACK_TOKENS, capture_shards
from onboard.speculator.data import (
    TRAFFIC,
    default_aux_layers,
    draft_vocabulary,
    generate_responses,
    split_data,
    training_prompts,
)
from onboard.speculator.draft import Eagle3Draft, draft_layer_config
from onboard.speculator.export import export_speculator
from onboard.speculator.measure import acceptance_table, held_out_prompts, measure_acceptance
from onboard.speculator.teacher import data_files_key, resolve_data_files, teacher_forced_answers, teacher_forced_code
from onboard.speculator.train import TrainSettings, train_draft
from onboard.speculator.warm_start import describe_init, init_from_last_layer
from onboard.workspace import RunDir

DATA_SETTINGS = {  # the settings the captured data depends on
    "traffic",
    "num_prompts",
    "max_prompt_tokens",
    "max_new_tokens",
    "responses_per_prompt",
    "response_temperature",
    "generation_concurrency",  # the batch compositions: how non-batch-invariant kernels round
    "stdlib_files",
    "teacher_forced_max_sequences",
    "max_seq_len",
}


def engine_config(settings: SpeculatorSettings, device: str = "cpu", numerics: str = "fast"):
    """The stage's one engine (generation, capture, measurement): `generation_concurrency`
    sequences at once, a KV cache that holds that many whole prompts and responses (and a capture
    pack), and a context length that fits the longest training sequence."""
    from onboard.engine.config import EngineConfig

    defaults = EngineConfig()
    block = defaults.block_size
    response = settings.max_prompt_tokens + settings.max_new_tokens
    max_model_len = max(defaults.max_model_len, response, settings.max_seq_len + 1)
    num_blocks = max(
        defaults.num_blocks,
        settings.generation_concurrency * -(-response // block),
        -(-max_model_len // block) + PACK_TOKENS // block,
    )
    return EngineConfig(
        device=device,
        numerics=numerics,
        max_num_seqs=settings.generation_concurrency,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        enable_prefix_caching=False,
    )


def capture_key(
    artifact_key: str,
    settings: SpeculatorSettings,
    data: Path | None,
    states_from: Path | None,
    numerics: str,
    answers_key: list[list[str]],
) -> str:
    """What the captured data depends on: reused only while this is unchanged."""
    return hash_json(
        {
            "artifact": artifact_key,
            "states_from": str(Path(states_from).resolve()) if states_from else None,
            "data": str(Path(data).resolve()) if data else None,
            "numerics": numerics,  # exact and fast data are never mixed
            "teacher_forced_data": answers_key,
            "settings": settings.model_dump(include=DATA_SETTINGS),
            "aux_layers": settings.aux_layers,
            "code": code_version(),
        }
    )


def build_draft(engine, vocab: torch.Tensor, aux_layers: list[int], from_last_layer: bool = False) -> Eagle3Draft:
    torch.manual_seed(0)
    draft = Eagle3Draft(draft_layer_config(engine.hf_config), len(vocab), aux_layers)
    draft.set_vocab(vocab)
    target = engine.target_tensors()
    draft.init_from_target(target["embed_tokens"], target["lm_head"], target["norm"])
    if from_last_layer:
        console.print(describe_init(engine, init_from_last_layer(draft, engine)))
    return draft


def run_speculator(
    run: RunDir,
    settings: SpeculatorSettings,
    data: Path | None,
    states_from: Path | None = None,
    device: str = "cpu",
    numerics: str = "fast",
) -> dict[str, Any]:
    """`states_from`: another checkpoint (e.g. the BF16 original) whose responses and hidden states
    the draft is trained on instead of the artifact's; it is still measured on the artifact.
    `numerics` (`EngineConfig.numerics`): the engine's, for generation, capture and measurement."""
    from onboard.engine.llm_engine import LLMEngine

    quantize = run.require("quantize")
    work = run.root / "speculator-work"
    answers = resolve_data_files(settings.teacher_forced_data)  # a missing file fails before any work
    answers_key = data_files_key(answers)
    data_key = capture_key(quantize["key"], settings, data, states_from, numerics, answers_key)
    config = engine_config(settings, device, numerics)

    def body(stage) -> dict[str, Any]:
        torch.manual_seed(0)
        engine = LLMEngine(run.artifact, config)
        tokenizer = engine.tokenizer
        layers = engine.hf_config.get_text_config().num_hidden_layers
        aux_layers = settings.aux_layers or default_aux_layers(layers)
        started = time.perf_counter()
        # With DATA, its last rows are held out and measured on; without, the eval split.
        train_records, eval_records = split_data(data, settings.eval_prompts) if data else (None, None)
        work_data = work / "data"
        if (work_data / "KEY").is_file() and (work_data / "KEY").read_text() == data_key:
            console.print(f"speculator: reusing captured data in {work_data}")
            index = json.loads((work_data / "index.json").read_text())
        else:
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
            partial = work / "data.partial"
            atomic.remove(partial)
            index = capture_shards(source, sequences, aux_layers, partial)
            del source
            (partial / "KEY").write_text(data_key)
            atomic.remove(work_data)
            partial.rename(work_data)
        data_seconds = time.perf_counter() - started

        vocab = draft_vocabulary(work_data, settings.draft_vocab_size, engine.vocab_size)
        draft = build_draft(engine, vocab, aux_layers, settings.init_from_last_layer)
        train = TrainSettings(
            epochs=settings.epochs,
            learning_rate=settings.learning_rate,
            batch_sequences=settings.batch_sequences,
            max_seq_len=settings.max_seq_len,
            ttt_steps=settings.num_speculative_tokens,
        )
        started = time.perf_counter()
        resume_key = hash_json({"data": data_key, "settings": settings.model_dump()})
        head = engine.target_tensors()["lm_head"]
        history = train_draft(draft, work_data, head, train, work / "checkpoint", resume_key)
        train_seconds = time.perf_counter() - started
        k = settings.num_speculative_tokens
        export_speculator(draft, stage.path("artifact/speculator"), run.artifact.resolve(), k)

        traffic = TRAFFIC[settings.traffic]
        held_out = held_out_prompts(
            tokenizer, traffic, eval_records or None, settings.eval_prompts, settings.max_prompt_tokens
        )
        metrics = measure_acceptance(engine, draft, settings.num_speculative_tokens, held_out, settings.eval_max_tokens)
        metrics.update(
            data_seconds=round(data_seconds, 1),
            train_seconds=round(train_seconds, 1),
            train_tokens=index["num_tokens"],
            train_sequences=index["num_sequences"],
            train_traffic=index["traffic"],
            numerics=numerics,
            aux_layers=aux_layers,
            draft_vocab_size=len(vocab),
        )
        atomic.write_json(stage.path("speculator/metrics.json"), metrics)
        atomic.write_json(stage.path("speculator/train.json"), {"history": history, "settings": asdict(train)})
        console.print(acceptance_table(metrics))
        work_data.rename(stage.path("speculator/data"))  # last: a failure before this keeps it for the rerun
        return {k: metrics[k] for k in ("acceptance_length", "speedup", "num_speculative_tokens")}

    inputs = {
        "artifact": str(run.artifact.resolve()),
        "settings": settings.model_dump(),
        "data": str(Path(data).resolve()) if data else None,
        "states_from": str(Path(states_from).resolve()) if states_from else None,
        "numerics": numerics,
        "teacher_forced_data": answers_key,
    }
    outputs = ["speculator", "artifact/speculator"]
    entry = run.run_stage("speculator", inputs, outputs, body)
    atomic.remove(work)
    return entry
