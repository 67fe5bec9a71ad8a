"""Speculator training data: DATA split into training and held-out rows; the target's greedy and
seeded sampled responses."""

import json
from pathlib import Path

import torch

from onboard.data import ChatPrompt, Record
from onboard.engine.config import EngineConfig
from onboard.engine.llm_engine import LLMEngine
from onboard.engine.sampler import SamplingParams
from onboard.models import inspect_checkpoint, load_tokenizer
from onboard.speculator.data import generate_responses, split_data, training_prompts


def test_split_data_holds_out_the_last_rows(tmp_path: Path) -> None:
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(10)))
    train, held_out = split_data(data, 3)
    assert [r.text for r in train] == [f"question {i}" for i in range(7)]
    assert [r.text for r in held_out] == [f"question {i}" for i in range(7, 10)]
    train, held_out = split_data(data, 6)  # would train on fewer rows than it measures on
    assert len(train) == 10 and held_out == []


def test_training_prompts_skip_the_ones_that_do_not_fit(tiny_llama: Path) -> None:
    tokenizer = load_tokenizer(inspect_checkpoint(tiny_llama))
    records = [
        Record(traffic="chat", source="long", text="word " * 100),
        *(Record(traffic="math", source=f"q{i}", text=f"question {i}") for i in range(3)),
    ]
    prompts = training_prompts(tokenizer, "mixed", records, 2, 32)
    assert [p.source for p in prompts] == ["q0", "q1"]  # the long one skipped, not cut
    assert all(tokenizer.decode(p.token_ids).endswith("<|im_start|>assistant\n") for p in prompts)


def test_responses_are_the_greedy_one_then_seeded_samples(tiny_llama: Path) -> None:
    engine = LLMEngine(tiny_llama, EngineConfig(block_size=4, num_blocks=256, max_model_len=256), dtype=torch.float32)
    prompts = [ChatPrompt([5, 17, 99, 23], "chat", "a", "a:1"), ChatPrompt([40, 41, 42], "math", "b", "b:1")]
    out = generate_responses(engine, prompts, 10, responses_per_prompt=3, temperature=1.0)
    assert [s.traffic for s in out] == ["chat", "math"] * 3
    greedy = engine.generate([p.token_ids for p in prompts], SamplingParams(temperature=0.0, max_tokens=10))
    for seq, prompt, plain in zip(out[:2], prompts, greedy, strict=True):
        assert seq.token_ids == prompt.token_ids + plain.token_ids
        assert seq.num_prompt_tokens == len(prompt.token_ids)
    responses = [tuple(s.token_ids) for s in out]
    assert len(set(responses[0::2])) == 3  # three different responses to the first prompt
    again = generate_responses(engine, prompts, 10, responses_per_prompt=3, temperature=1.0)
    assert [tuple(s.token_ids) for s in again] == responses  # seeded: the same data every run


def test_responses_at_any_concurrency_are_the_same_data(tiny_llama: Path) -> None:
    """`max_in_flight` caps the requests in the engine at once (one engine, several concurrencies)."""
    engine = LLMEngine(tiny_llama, EngineConfig(block_size=4, num_blocks=256, max_model_len=256), dtype=torch.float32)
    prompts = [ChatPrompt([5, 17, 99, 23], "chat", "a", "a:1"), ChatPrompt([40, 41, 42], "math", "b", "b:1")]
    everything = generate_responses(engine, prompts, 10, responses_per_prompt=3, temperature=1.0)
    seen: list[int] = []
    add = engine.add_request

    def counting(prompt, params):  # how many requests are unfinished when each one is added
        seen.append(engine.stats()["num_running"] + engine.stats()["num_waiting"])
        return add(prompt, params)

    engine.add_request = counting  # type: ignore[method-assign]
    capped = generate_responses(engine, prompts, 10, responses_per_prompt=3, temperature=1.0, max_in_flight=2)
    assert len(seen) == 6 and max(seen) <= 1  # never a third one queued beside two
    assert [(s.token_ids, s.num_prompt_tokens, s.traffic) for s in capped] == [
        (s.token_ids, s.num_prompt_tokens, s.traffic) for s in everything
    ]
