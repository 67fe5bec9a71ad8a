"""The speculator stage's work directory (`RUN_DIR/speculator-work/`), either memory path: captured
data reused while its key holds, training resumed from its last finished epoch, and the outputs
moved into the stage once it is done."""

import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from onboard import atomic
from onboard.console import console
from onboard.hashing import hash_json
from onboard.recipes import SpeculatorSettings
from onboard.speculator.draft import Eagle3Draft
from onboard.speculator.train import TrainSettings, train_draft
from onboard.workspace import SPECULATOR_DATA, SPECULATOR_METRICS, SPECULATOR_TRAIN, Stage


def captured_data(work: Path, data_key: str, capture: Callable[[Path], dict]) -> tuple[Path, dict]:
    """The captured data directory and index: reused while `data_key` holds, else `capture(dir)`."""
    work_data = work / "data"
    if (work_data / "KEY").is_file() and (work_data / "KEY").read_text() == data_key:
        console.print(f"speculator: reusing captured data in {work_data}")
        return work_data, json.loads((work_data / "index.json").read_text())
    partial = work / "data.partial"
    atomic.remove(partial)
    index = capture(partial)
    (partial / "KEY").write_text(data_key)
    atomic.remove(work_data)
    partial.rename(work_data)
    return work_data, index


def train_captured(
    draft: Eagle3Draft, work: Path, head: torch.Tensor, settings: SpeculatorSettings, data_key: str
) -> tuple[list[dict], TrainSettings, float]:
    """Train the draft on the captured data, resuming from the work directory's checkpoint; the
    history, the settings and the seconds it took."""
    train = TrainSettings(
        epochs=settings.epochs,
        learning_rate=settings.learning_rate,
        batch_sequences=settings.batch_sequences,
        max_seq_len=settings.max_seq_len,
        ttt_steps=settings.num_speculative_tokens,
    )
    started = time.perf_counter()
    resume_key = hash_json({"data": data_key, "settings": settings.model_dump()})
    history = train_draft(draft, work / "data", head, train, work / "checkpoint", resume_key)
    return history, train, time.perf_counter() - started


def finish(stage: Stage, metrics: dict[str, Any], history: list[dict], train: TrainSettings, work: Path) -> None:
    """metrics.json, train.json and the captured data into the stage's outputs."""
    atomic.write_json(stage.path(SPECULATOR_METRICS), metrics)
    atomic.write_json(stage.path(SPECULATOR_TRAIN), {"history": history, "settings": asdict(train)})
    (work / "data").rename(stage.path(SPECULATOR_DATA))  # last: a failure before this keeps it for the rerun


def data_metrics(index: dict, aux_layers: list[int], vocab: torch.Tensor, numerics: str) -> dict[str, Any]:
    """metrics.json's keys about the data the draft was trained on."""
    return {
        "train_tokens": index["num_tokens"],
        "train_sequences": index["num_sequences"],
        "train_traffic": index["traffic"],
        "numerics": numerics,
        "aux_layers": aux_layers,
        "draft_vocab_size": len(vocab),
    }
