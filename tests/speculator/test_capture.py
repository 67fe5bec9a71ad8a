"""Hidden-state capture, several sequences per forward, and teacher-forced answers labelled by the target."""

import json
from pathlib import Path

import pytest
import torch

from onboard.engine.config import EngineConfig
from onboard.engine.llm_engine import LLMEngine
from onboard.speculator.capture import batched_hidden_states, capture_shards, combine_captures, packs
from onboard.speculator.data import TrainingSequence, iter_sequences
from onboard.speculator.teacher import answer_sequence, teacher_forced_answers
from onboard.speculator.train import load_examples

AUX = [0, 1]


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> LLMEngine:
    return LLMEngine(tiny_llama, EngineConfig(block_size=4, num_blocks=512, max_model_len=256))  # bf16, as served


def _sequences(count: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randint(3, 500, (int(n),), generator=gen).tolist() for n in torch.randint(5, 60, (count,), generator=gen)
    ]


def test_packs_keep_order_and_budgets() -> None:
    assert packs([10, 10, 10, 30, 5], max_tokens=25, max_blocks=100, block_size=4) == [[0, 1], [2], [3], [4]]
    assert packs([10, 10, 10], max_tokens=100, max_blocks=6, block_size=4) == [[0, 1], [2]]  # 3 blocks each


@pytest.mark.parametrize("numerics", ["exact", "fast"])
def test_batched_states_are_each_sequence_alone_up_to_rounding(numerics: str, tiny_llama: Path) -> None:
    engine = LLMEngine(tiny_llama, EngineConfig(block_size=4, num_blocks=512, max_model_len=256, numerics=numerics))
    token_lists = _sequences(6)
    free = engine.stats()["num_free_blocks"]
    batched = batched_hidden_states(engine, token_lists, AUX)
    assert engine.stats()["num_free_blocks"] == free  # every block handed back
    for ids, (final, aux) in zip(token_lists, batched, strict=True):
        alone_final, alone_aux = engine.hidden_states(ids, AUX)
        assert final.shape == alone_final.shape == (len(ids), engine.hf_config.hidden_size)
        assert final.dtype == alone_final.dtype == torch.bfloat16
        # bf16: one rounding step of the largest entries, from GEMMs over another row count
        torch.testing.assert_close(final, alone_final, rtol=2e-2, atol=3e-2)
        assert len(aux) == len(alone_aux) == len(AUX)
        for mine, theirs in zip(aux, alone_aux, strict=True):
            assert mine.shape == theirs.shape
            torch.testing.assert_close(mine, theirs, rtol=2e-2, atol=3e-2)


def test_capture_shards_in_order_and_combined(engine: LLMEngine, tmp_path: Path) -> None:
    token_lists = _sequences(9)
    sequences = [TrainingSequence(ids, 2, "chat") for ids in token_lists]
    index = capture_shards(engine, sequences, AUX, tmp_path / "a", shard_tokens=64, pack_tokens=100)
    assert index["num_sequences"] == 9 and index["num_tokens"] == sum(map(len, token_lists))
    assert len(index["shards"]) > 1
    captured = list(iter_sequences(tmp_path / "a"))
    assert [seq["input_ids"].tolist() for seq in captured] == token_lists
    capture_shards(engine, sequences[:2], AUX, tmp_path / "b")
    both = combine_captures(tmp_path / "both", [tmp_path / "a", tmp_path / "b"])
    assert both["num_sequences"] == 11
    again = [seq["input_ids"].tolist() for seq in iter_sequences(tmp_path / "both")]
    assert again == token_lists + token_lists[:2]


def test_teacher_forced_answers_are_labelled_with_the_targets_distributions(
    engine: LLMEngine, tiny_llama: Path, tmp_path: Path
) -> None:
    tokenizer = engine.tokenizer
    answer = "The sum is 5, so x = 5."
    data = tmp_path / "gsm.jsonl"
    data.write_text(
        json.dumps({"question": "What is 2 + 3?", "answer": answer})
        + "\n"
        + json.dumps({"question": "long " * 400, "answer": "skipped: its prompt is too long"})
        + "\n"
        + json.dumps({"question": "And 1 + 1?", "answer": "2"})
        + "\n"
    )
    sequences = teacher_forced_answers(tokenizer, [data], limit=1, max_prompt_tokens=64, max_tokens=128)
    assert len(sequences) == 1  # the cap
    assert len(teacher_forced_answers(tokenizer, [data], limit=5, max_prompt_tokens=64, max_tokens=128)) == 2
    (seq,) = sequences
    ids, start = seq.token_ids, seq.num_prompt_tokens
    turns = [{"role": "user", "content": "What is 2 + 3?"}]
    assert tokenizer.decode(ids[:start]) == tokenizer.apply_chat_template(
        turns, tokenize=False, add_generation_prompt=True
    )
    assert tokenizer.decode(ids[start:]) == answer + "<|im_end|>"  # the answer through its end of turn

    capture_shards(engine, sequences, AUX, tmp_path / "data")
    (example,) = load_examples(tmp_path / "data", max_seq_len=512)
    # Row i's label is final[i] (position i + 1), the distribution of token i + 2: exactly the answer.
    trained_tokens = [ids[i + 2] for i in torch.nonzero(example.trained).squeeze(1).tolist()]
    assert trained_tokens == ids[start:]
    head = engine.target_tensors()["lm_head"]
    labels = (example.final.float() @ head.T).log_softmax(-1)
    reference = engine.score(ids)[1:].log_softmax(-1)  # the target's own next-token distributions
    assert labels.shape == reference.shape
    torch.testing.assert_close(labels, reference, rtol=0, atol=0.1)  # final states stored in bf16
    assert (labels.argmax(-1) == reference.argmax(-1)).float().mean() > 0.9


def test_answer_sequence_cuts_and_skips(engine: LLMEngine) -> None:
    from onboard.data.record import Message, Record

    record = Record("math", "x", messages=(Message("user", "q"), Message("assistant", "a long answer " * 20)))
    whole = answer_sequence(record, engine.tokenizer, 64, 1000)
    assert whole is not None and whole.token_ids[-1] == engine.tokenizer.eos_token_id
    cut = answer_sequence(record, engine.tokenizer, 64, 20)
    assert cut is not None and cut.token_ids == whole.token_ids[:20]
    assert answer_sequence(record, engine.tokenizer, 3, 1000) is None  # prompt over the limit
    assert answer_sequence(record, engine.tokenizer, 64, whole.num_prompt_tokens + 1) is None  # no answer fits


@pytest.mark.parametrize("arch", ["tiny_qwen3_moe", "tiny_deepseek_v32"])
def test_batched_capture_of_moe_and_mla_dsa_models(arch: str, request: pytest.FixtureRequest) -> None:
    """Several sequences per forward through MoE routing, MLA's latent cache and DSA's top-k selection."""
    engine = LLMEngine(request.getfixturevalue(arch), EngineConfig(block_size=4, num_blocks=512, max_model_len=256))
    token_lists = _sequences(4)
    for ids, (final, aux) in zip(token_lists, batched_hidden_states(engine, token_lists, AUX), strict=True):
        alone_final, alone_aux = engine.hidden_states(ids, AUX)
        torch.testing.assert_close(final, alone_final, rtol=2e-2, atol=3e-2)
        for mine, theirs in zip(aux, alone_aux, strict=True):
            torch.testing.assert_close(mine, theirs, rtol=2e-2, atol=3e-2)
