"""Speculator training data: DATA split into training and held-out rows; the target's greedy and
seeded sampled responses."""

import json
from pathlib import Path

import torch

from onboard.engine.config import EngineConfig
from onboard.engine.llm_engine import LLMEngine
from onboard.engine.sampler import SamplingParams
from onboard.speculator.data import generate_responses, split_data


def test_split_data_holds_out_the_last_rows(tmp_path: Path) -> None:
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(10)))
    train, held_out = split_data(data, 3)
    assert [r.text for r in train] == [f"question {i}" for i in range(7)]
    assert [r.text for r in held_out] == [f"question {i}" for i in range(7, 10)]
    train, held_out = split_data(data, 6)  # would train on fewer rows than it measures on
    assert len(train) == 10 and held_out == []


def test_responses_are_the_greedy_one_then_seeded_samples(tiny_llama: Path) -> None:
    engine = LLMEngine(tiny_llama, EngineConfig(block_size=4, num_blocks=256, max_model_len=256), dtype=torch.float32)
    prompts = [([5, 17, 99, 23], "chat"), ([40, 41, 42], "math")]
    out = generate_responses(engine, prompts, 10, responses_per_prompt=3, temperature=1.0)
    assert [s.traffic for s in out] == ["chat", "math"] * 3
    greedy = engine.generate([p for p, _ in prompts], SamplingParams(temperature=0.0, max_tokens=10))
    for seq, (prompt, _), plain in zip(out[:2], prompts, greedy, strict=True):
        assert seq.token_ids == prompt + plain.token_ids and seq.num_prompt_tokens == len(prompt)
    responses = [tuple(s.token_ids) for s in out]
    assert len(set(responses[0::2])) == 3  # three different responses to the first prompt
    again = generate_responses(engine, prompts, 10, responses_per_prompt=3, temperature=1.0)
    assert [tuple(s.token_ids) for s in again] == responses  # seeded: the same data every run
