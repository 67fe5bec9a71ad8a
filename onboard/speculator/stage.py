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
from onboard.speculator.data import (
    TRAFFIC,
    capture_shards,
    default_aux_layers,
    draft_vocabulary,
    generate_responses,
    split_data,
    teacher_forced_code,
    training_prompts,
)
from onboard.speculator.draft import Eagle3Draft, draft_layer_config
from onboard.speculator.export import export_speculator
from onboard.speculator.measure import acceptance_table, held_out_prompts, measure_acceptance
from onboard.speculator.train import TrainSettings, train_draft
from onboard.workspace import RunDir


def build_draft(engine, vocab: torch.Tensor, aux_layers: list[int]) -> Eagle3Draft:
    torch.manual_seed(0)
    draft = Eagle3Draft(draft_layer_config(engine.hf_config), len(vocab), aux_layers)
    draft.set_vocab(vocab)
    target = engine.target_tensors()
    draft.init_from_target(target["embed_tokens"], target["lm_head"], target["norm"])
    return draft


def run_speculator(
    run: RunDir,
    settings: SpeculatorSettings,
    data: Path | None,
    states_from: Path | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    """`states_from`: another checkpoint (e.g. the BF16 original) whose responses and hidden states
    the draft is trained on instead of the artifact's; it is still measured on the artifact."""
    from onboard.engine.config import EngineConfig
    from onboard.engine.llm_engine import LLMEngine

    quantize = run.require("quantize")
    work = run.root / "speculator-work"
    data_key = hash_json(
        {
            "artifact": quantize["key"],
            "states_from": str(Path(states_from).resolve()) if states_from else None,
            "data": str(Path(data).resolve()) if data else None,
            "settings": settings.model_dump(
                include={
                    "traffic",
                    "num_prompts",
                    "max_prompt_tokens",
                    "max_new_tokens",
                    "responses_per_prompt",
                    "response_temperature",
                    "stdlib_files",
                    "max_seq_len",
                }
            ),
            "aux_layers": settings.aux_layers,
            "code": code_version(),
        }
    )

    def body(stage) -> dict[str, Any]:
        torch.manual_seed(0)
        engine = LLMEngine(run.artifact, EngineConfig(device=device, enable_prefix_caching=False))
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
            config = EngineConfig(device=device, enable_prefix_caching=False)
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
            partial = work / "data.partial"
            atomic.remove(partial)
            index = capture_shards(source, sequences, aux_layers, partial)
            del source
            (partial / "KEY").write_text(data_key)
            atomic.remove(work_data)
            partial.rename(work_data)
        data_seconds = time.perf_counter() - started

        vocab = draft_vocabulary(work_data, settings.draft_vocab_size, engine.vocab_size)
        draft = build_draft(engine, vocab, aux_layers)
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
    }
    outputs = ["speculator", "artifact/speculator"]
    entry = run.run_stage("speculator", inputs, outputs, body)
    atomic.remove(work)
    return entry
