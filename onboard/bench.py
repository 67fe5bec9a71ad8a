"""`onboard bench`: the engine against `transformers.generate`, same weights, same prompts, one run."""

import time
from pathlib import Path
from typing import Any

import torch
from rich.table import Table

from onboard.console import console
from onboard.data import builtin_records, chat_prompts, load_records, stdlib_code_records, tokenize_records
from onboard.models import Checkpoint, load_model, load_tokenizer

NEW_TOKENS = 64
PREFIX_TOKENS = 2000
MAX_PROMPT_TOKENS = 256


def _prompts(tokenizer, data: Path | None, count: int) -> list[list[int]]:
    """`count` chat prompts, repeated when DATA has fewer. Longer ones are skipped, not cut: a cut
    chat prompt loses its assistant header, and the timing would be of a continued user text."""
    records = load_records(data) if data else builtin_records("eval")
    prompts = chat_prompts(records, tokenizer, max_tokens=MAX_PROMPT_TOKENS, fit="skip", limit=count)
    return [prompts[i % len(prompts)].token_ids for i in range(count)]


def _timed(fn) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def memory_bandwidth() -> float:
    """Bytes per second one process reads, measured on a 512 MiB tensor (best of 3)."""
    data = torch.ones(128 * 2**20, dtype=torch.float32)
    best = min(_timed(lambda: data.sum())[1] for _ in range(3))
    return data.numel() * data.element_size() / best


def _engine_tps(engine, prompts: list[list[int]]) -> float:
    from onboard.engine.sampler import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    results, seconds = _timed(lambda: engine.generate(prompts, params))
    return sum(len(r.token_ids) for r in results) / seconds


@torch.inference_mode()
def _hf_tps(model, prompts: list[list[int]], pad_id: int) -> float:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out, seconds = _timed(
        lambda: model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=pad_id,
        )
    )
    return (out.shape[1] - width) * len(prompts) / seconds


def _ttft(engine, prompt: list[int]) -> float:
    from onboard.engine.sampler import SamplingParams

    return _timed(lambda: engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1)))[1]


def run_bench(checkpoint: Checkpoint, data: Path | None, device: str = "cpu") -> dict[str, Any]:
    from onboard.engine import EngineConfig, LLMEngine

    torch.manual_seed(0)
    tokenizer = load_tokenizer(checkpoint)
    prompts = _prompts(tokenizer, data, 16)
    engine = LLMEngine(checkpoint.path, EngineConfig(device=device))
    model = load_model(checkpoint)
    _engine_tps(engine, prompts[:1])  # warm-up both sides
    _hf_tps(model, prompts[:1], tokenizer.pad_token_id)

    console.print("bench: concurrency 1 ...")
    engine_c1 = sum(_engine_tps(engine, [p]) for p in prompts[:4]) / 4
    hf_c1 = sum(_hf_tps(model, [p], tokenizer.pad_token_id) for p in prompts[:4]) / 4
    console.print("bench: concurrency 16 ...")
    engine_c16 = _engine_tps(engine, prompts)
    hf_c16 = _hf_tps(model, prompts, tokenizer.pad_token_id)

    console.print("bench: shared-prefix time to first token ...")
    prefix = tokenize_records(stdlib_code_records("eval", 8), tokenizer, chat=False, max_length=10 * PREFIX_TOKENS)
    prefix_ids = [t for doc in prefix for t in doc][:PREFIX_TOKENS]
    cold = _ttft(engine, prefix_ids + prompts[0])
    warm = _ttft(engine, prefix_ids + prompts[1])

    bandwidth = memory_bandwidth()
    bytes_per_step = engine.weight_bytes_per_decode_step()
    return {
        "model": str(checkpoint.path),
        "new_tokens": NEW_TOKENS,
        "engine_c1_tps": engine_c1,
        "hf_c1_tps": hf_c1,
        "engine_c16_tps": engine_c16,
        "hf_c16_tps": hf_c16,
        "prefix_tokens": len(prefix_ids),
        "prefix_ttft_cold_s": cold,
        "prefix_ttft_warm_s": warm,
        "weight_bytes_per_decode_step": bytes_per_step,
        "kv_bytes_per_token": engine.kv_layout.bytes_per_token(),
        "memory_bandwidth_gbps": bandwidth / 1e9,
        "bandwidth_fraction_c1": bytes_per_step * engine_c1 / bandwidth,
    }


def bench_table(result: dict[str, Any]) -> Table:
    table = Table(title="engine against transformers.generate (same weights, same prompts)", title_justify="left")
    for column in ("measure", "engine", "transformers", "ratio"):
        table.add_column(column, justify="right" if column != "measure" else "left")
    for label, mine, theirs in (
        ("tokens/s, concurrency 1", result["engine_c1_tps"], result["hf_c1_tps"]),
        ("tokens/s, concurrency 16", result["engine_c16_tps"], result["hf_c16_tps"]),
    ):
        table.add_row(label, f"{mine:.1f}", f"{theirs:.1f}", f"{mine / theirs:.2f}×")
    cold, warm = result["prefix_ttft_cold_s"], result["prefix_ttft_warm_s"]
    table.add_row(
        f"TTFT, {result['prefix_tokens']}-token shared prefix",
        f"warm {warm:.3f} s",
        f"cold {cold:.3f} s",
        f"{cold / warm:.1f}×",
    )
    table.add_row(
        "memory-bandwidth bound reached, c=1",
        f"{100 * result['bandwidth_fraction_c1']:.1f} %",
        f"{result['memory_bandwidth_gbps']:.1f} GB/s",
        "",
    )
    return table
