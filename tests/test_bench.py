"""`onboard bench` bookkeeping: the bytes one decode step reads, counted from the engine's weights."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from onboard.engine.config import EngineConfig
from onboard.engine.llm_engine import LLMEngine


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen3"])
def test_weight_bytes_per_decode_step_count_every_stored_weight(arch: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(arch)
    engine = LLMEngine(path, EngineConfig(block_size=4, num_blocks=64, max_model_len=128))
    tied = engine.hf_config.tie_word_embeddings
    config = engine.hf_config
    expected = 0
    for name, tensor in load_file(path / "model.safetensors").items():
        # A decode step reads one row of an untied embedding table; a tied one is the lm_head.
        if "embed_tokens" in name and not tied:
            continue
        copies = 1
        if name.endswith("q_norm.weight"):  # qwen3's per-head norms run stacked, one row per head
            copies = config.num_attention_heads
        elif name.endswith("k_norm.weight"):
            copies = config.num_key_value_heads
        expected += copies * tensor.numel() * torch.bfloat16.itemsize
    assert engine.weight_bytes_per_decode_step() == expected
