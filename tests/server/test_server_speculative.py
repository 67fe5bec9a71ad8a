"""Serving with an EAGLE-3 draft: the same greedy text as without it, and /metrics counting drafts,
draft tokens and accepted tokens per position (vLLM's spec_decode_* names)."""

import re
from pathlib import Path

import httpx
import torch
from server_thread import ServerThread
from transformers import AutoConfig

from onboard.engine.config import EngineConfig
from onboard.engine.llm_engine import LLMEngine
from onboard.server import build_app
from onboard.speculator.draft import Eagle3Draft, draft_layer_config

K = 3


def counter(text: str, name: str) -> int:
    return int(re.search(rf"^onboard_{name} (\d+)$", text, re.MULTILINE).group(1))


def test_speculative_server_matches_plain_and_reports_acceptance(tiny_llama: Path) -> None:
    config = EngineConfig(max_model_len=256, num_blocks=128)
    body = {"model": "m", "prompt": "The capital of France is", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    with ServerThread(build_app(LLMEngine(tiny_llama, config, dtype=torch.float32), "m")) as url:
        plain = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        assert "spec_decode" not in httpx.get(f"{url}/metrics").text  # no draft, no such counters

    engine = LLMEngine(tiny_llama, config, dtype=torch.float32)
    torch.manual_seed(0)
    draft = Eagle3Draft(draft_layer_config(AutoConfig.from_pretrained(tiny_llama)), engine.vocab_size, [0, 1])
    draft.set_vocab(torch.arange(engine.vocab_size))
    target = engine.target_tensors()
    draft.init_from_target(target["embed_tokens"], target["lm_head"], target["norm"])
    engine.set_speculator(draft, K)
    with ServerThread(build_app(engine, "m")) as url:
        spec = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        metrics = httpx.get(f"{url}/metrics").text
    assert spec["choices"][0]["text"] == plain["choices"][0]["text"]
    drafts = counter(metrics, "spec_decode_num_drafts_total")
    proposed = counter(metrics, "spec_decode_num_draft_tokens_total")
    accepted = counter(metrics, "spec_decode_num_accepted_tokens_total")
    per_position = [
        int(n)
        for n in re.findall(
            r'^onboard_spec_decode_num_accepted_tokens_per_pos_total\{position="\d"\} (\d+)$', metrics, re.MULTILINE
        )
    ]
    assert drafts > 0 and proposed <= K * drafts and accepted <= proposed
    assert len(per_position) == K and sum(per_position) == accepted
    # Every verification emits its accepted tokens plus one: 24 tokens need this many rounds at least.
    assert drafts + accepted >= 24 - 1
