"""`train_draft`'s budget: whole epochs, or a number of optimizer steps (the last epoch cut short)."""

from pathlib import Path

import torch

from onboard.engine.config import EngineConfig
from onboard.engine.llm_engine import LLMEngine
from onboard.speculator.capture import capture_shards
from onboard.speculator.data import TrainingSequence
from onboard.speculator.stage import build_draft
from onboard.speculator.train import TrainSettings, load_examples, train_draft


def test_max_steps_cuts_the_last_epoch(tiny_llama: Path, tmp_path: Path) -> None:
    engine = LLMEngine(tiny_llama, EngineConfig(block_size=4, num_blocks=256, max_model_len=256))
    gen = torch.Generator().manual_seed(0)
    sequences = [TrainingSequence(torch.randint(3, 500, (20,), generator=gen).tolist(), 5, "chat") for _ in range(5)]
    capture_shards(engine, sequences, [0, 1], tmp_path / "data")
    (example, *_) = load_examples(tmp_path / "data", max_seq_len=64)
    # Labels: the tokens from the first response token to the last one, none past the sequence's end.
    assert int(example.trained.sum()) == 20 - 5
    head = engine.target_tensors()["lm_head"]
    history = {}
    for steps in (None, 4):
        draft = build_draft(engine, torch.arange(0, 512, 4), [0, 1])
        settings = TrainSettings(epochs=3, batch_sequences=2, max_seq_len=64, ttt_steps=2, max_steps=steps)
        history[steps] = train_draft(draft, tmp_path / "data", head, settings, tmp_path / f"checkpoint-{steps}")
    assert [h["steps"] for h in history[None]] == [3, 6, 9]  # 3 batches an epoch
    assert [h["steps"] for h in history[4]] == [3, 4]
    for run in history.values():  # the cosine schedule spans the steps that run, ending at zero
        assert run[-1]["learning_rate"] == 0.0
