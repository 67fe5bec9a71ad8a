"""The speculator stage over the memory budget: no engine anywhere, nothing generated.

The data is teacher-forced text: the traffic prompts with the responses the records carry
(`teacher.traffic_sequences`), standard-library code and the answers of DATA files; its hidden
states are captured by streaming the checkpoint one decoder layer at a time (`streamed.py`), the
draft starts from the checkpoint's own tensors (`target.py`), and the acceptance is measured on a
deployment (`endpoint.measure_endpoint`) or recorded as not measured, with the command that
measures it.
"""

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from onboard.console import console
from onboard.endpoint import EndpointSpec
from onboard.models.streamed import StreamedModel
from onboard.recipes import SpeculatorSettings
from onboard.speculator import parallel
from onboard.speculator.data import TRAFFIC, TrainingSequence, default_aux_layers, draft_vocabulary
from onboard.speculator.export import export_speculator
from onboard.speculator.streamed import capture_streamed
from onboard.speculator.target import checkpoint_draft, checkpoint_tensors
from onboard.speculator.teacher import teacher_forced_answers, teacher_forced_code, traffic_sequences
from onboard.speculator.work import captured_data, data_metrics, finish, train_captured
from onboard.workspace import DRAFT, SPECULATOR_WORK, RunDir, Stage


def not_measured_note(run_dir: Path) -> str:
    return (
        "not measured: no engine holds the artifact within the memory budget; serve the artifact with this "
        f"speculator and run `onboard speculator {run_dir} --endpoint URL`"
    )


def streamed_sequences(
    tokenizer, settings: SpeculatorSettings, records: list | None, answers: list[Path]
) -> dict[str, list[TrainingSequence]]:
    """The streamed path's teacher-forced data by source, nothing generated: the traffic prompts
    (DATA's training rows, or the built-in calibration prompts) with the responses the records
    carry, standard-library code (code and mixed traffic), and the answers of DATA files."""
    from onboard.data.builtin import builtin_records

    if records is None:
        records = builtin_records("calib", TRAFFIC[settings.traffic], stdlib_files=0)
    limit, max_prompt, max_len = settings.teacher_forced_max_sequences, settings.max_prompt_tokens, settings.max_seq_len
    sources = {"traffic": traffic_sequences(records, tokenizer, settings.num_prompts, max_prompt, max_len)}
    if settings.traffic in ("code", "mixed"):
        sources["stdlib_code"] = teacher_forced_code(tokenizer, settings.stdlib_files, max_len)
    if answers:
        sources["answers"] = teacher_forced_answers(tokenizer, answers, limit, max_prompt, max_len)
    return sources


def streamed_body(
    run: RunDir,
    settings: SpeculatorSettings,
    data: Path | None,
    states_from: Path | None,
    data_key: str,
    sources: dict[str, list[TrainingSequence]],
    endpoint: EndpointSpec | None,
) -> Callable[[Stage], dict[str, Any]]:
    """No engine: the teacher-forced data (`sources`, by source) captured by streaming the
    checkpoint, the draft from its tensors, the acceptance measured on `endpoint` (or recorded as
    not measured)."""
    work = run.path(SPECULATOR_WORK)

    def body(stage: Stage) -> dict[str, Any]:
        torch.manual_seed(0)
        target = StreamedModel(run.artifact)
        aux_layers = settings.aux_layers or default_aux_layers(target.num_layers)
        started = time.perf_counter()
        source = StreamedModel(states_from) if states_from else target
        sequences = [seq for part in sources.values() for seq in part]

        def capture(out_dir: Path) -> dict:
            return capture_streamed(source, sequences, aux_layers, out_dir)

        with parallel.main_first("speculator: capturing the data"):  # the others then reuse it
            work_data, index = captured_data(work, data_key, capture)
        data_seconds = time.perf_counter() - started

        tensors = checkpoint_tensors(target)
        vocab = draft_vocabulary(work_data, settings.draft_vocab_size, int(tensors["embed_tokens"].shape[0]))
        draft = checkpoint_draft(target, tensors, vocab, aux_layers, settings.init_from_last_layer)
        del tensors["embed_tokens"]  # the draft holds its own copy
        history, train, train_seconds = train_captured(draft, work, tensors["lm_head"], settings, data_key)
        if not parallel.is_main():  # under torchrun: the main process alone exports and measures
            return {}
        k = settings.num_speculative_tokens
        export_speculator(draft, stage.path(DRAFT), run.artifact.resolve(), k)

        metrics = _endpoint_metrics(run, settings, data, endpoint, k) if endpoint else _unmeasured(run, k)
        metrics.update(
            data_seconds=round(data_seconds, 1),
            train_seconds=round(train_seconds, 1),
            **data_metrics(index, aux_layers, vocab, "exact"),
            memory_path="streamed",
            data_sources={
                name: {"sequences": len(part), "tokens": sum(len(s.token_ids) for s in part)}
                for name, part in sources.items()
            },
            peak_decoder_layers=max(target.parts.peak_layers, source.parts.peak_layers),
        )
        finish(stage, metrics, history, train, work)
        console.print(f"speculator: acceptance {metrics['acceptance_note']}")
        return {k: metrics[k] for k in ("acceptance_length", "speedup", "num_speculative_tokens", "memory_path")}

    return body


def _unmeasured(run: RunDir, k: int) -> dict[str, Any]:
    return {
        "acceptance_length": None,
        "per_position_acceptance": None,
        "speedup": None,
        "num_speculative_tokens": k,
        "measured_on": None,
        "acceptance_note": not_measured_note(run.root),
    }


def _endpoint_metrics(
    run: RunDir, settings: SpeculatorSettings, data: Path | None, spec: EndpointSpec, k: int
) -> dict[str, Any]:
    from onboard.endpoint import Endpoint
    from onboard.speculator.endpoint import endpoint_table, measure_endpoint

    endpoint = Endpoint(spec)
    try:
        metrics = measure_endpoint(run, settings, data, endpoint)
    finally:
        endpoint.close()
    console.print(endpoint_table(metrics))
    if metrics["num_speculative_tokens"] is None:
        metrics["num_speculative_tokens"] = k
    return {
        **metrics,
        "speedup": None,
        "measured_on": "endpoint",
        "acceptance_note": (
            f"measured on the endpoint {spec.base} ({metrics['served_model']}) from its /metrics counters: the "
            "speculator that server runs; no speed-up measured"
        ),
    }
