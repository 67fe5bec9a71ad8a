"""`onboard bench`: the engine (exact and fast numerics) against its peers, `transformers.generate`
and llama.cpp, on the same weights and the same prompts, in one run; every speed is reported
beside its ratio to a peer measured in that run."""

import gc
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from rich.console import Group, RenderableType
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from onboard.bench.peers import (
    close_llama_cpp,
    engine_tps,
    hf_tps,
    llama_cpp_tps,
    open_llama_cpp,
    peer_gguf,
    timed,
)
from onboard.console import console
from onboard.data import builtin_records, chat_prompts, load_records, stdlib_code_records, tokenize_records
from onboard.models import Checkpoint, load_model, load_tokenizer

NEW_TOKENS = 64
PREFIX_TOKENS = 2000
MAX_PROMPT_TOKENS = 256
CONCURRENCY = (1, 16, 64)  # requests at once; concurrency 1 is the mean over C1_PROMPTS prompts, one by one
C1_PROMPTS = 4
# The engine's sides: (side, numerics, batch_invariant).  Fast numerics twice: batch invariant (what
# `serve` runs by default and `smoke` checks) and without it (`serve --no-batch-invariant`).
ENGINE_SIDES = (
    ("engine_exact", "exact", True),
    ("engine_fast", "fast", True),
    ("engine_fast_noninvariant", "fast", False),
)


def _prompts(tokenizer, data: Path | None, count: int) -> list[list[int]]:
    """`count` chat prompts, repeated when DATA has fewer. Longer ones are skipped, not cut: a cut
    chat prompt loses its assistant header, and the timing would be of a continued user text."""
    records = load_records(data) if data else builtin_records("eval")
    prompts = chat_prompts(records, tokenizer, max_tokens=MAX_PROMPT_TOKENS, fit="skip", limit=count)
    return [prompts[i % len(prompts)].token_ids for i in range(count)]


def memory_bandwidth() -> float:
    """Bytes per second one process reads, measured on a 512 MiB tensor (best of 3)."""
    data = torch.ones(128 * 2**20, dtype=torch.float32)
    best = min(timed(lambda: data.sum())[1] for _ in range(3))
    return data.numel() * data.element_size() / best


def _sweep(side: str, label: str, tps: Callable[[list[list[int]]], float], prompts: list[list[int]]) -> dict:
    """`{side}_c{n}_tps` for every level of CONCURRENCY, after one warm-up request."""
    console.print(f"bench: {label}: warm-up ...")
    tps(prompts[:1])
    out = {}
    for n in CONCURRENCY:
        console.print(f"bench: {label}: concurrency {n} ...")
        if n == 1:
            out[f"{side}_c1_tps"] = sum(tps([p]) for p in prompts[:C1_PROMPTS]) / C1_PROMPTS
        else:
            out[f"{side}_c{n}_tps"] = tps(prompts[:n])
    return out


def _ttft(engine, prompt: list[int]) -> float:
    from onboard.engine import SamplingParams

    return timed(lambda: engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1)))[1]


def _prefix_ttft(engine, tokenizer, prompts: list[list[int]]) -> dict[str, Any]:
    """Time to first token of a long shared prefix, cold and then warm (cached) in the prefix cache."""
    console.print("bench: engine fast: shared-prefix time to first token ...")
    prefix = tokenize_records(stdlib_code_records("eval", 8), tokenizer, chat=False, max_length=10 * PREFIX_TOKENS)
    prefix_ids = [t for doc in prefix for t in doc][:PREFIX_TOKENS]
    cold = _ttft(engine, prefix_ids + prompts[0])
    warm = _ttft(engine, prefix_ids + prompts[1 % len(prompts)])
    return {"prefix_tokens": len(prefix_ids), "prefix_ttft_cold_s": cold, "prefix_ttft_warm_s": warm}


def _llama_cpp(model_path: Path, gguf: Path | None, prompts: list[list[int]], device: str) -> dict[str, Any]:
    """llama.cpp at concurrency 1 (its high-level API runs one sequence), or why it was skipped."""
    out: dict[str, Any] = {"llama_cpp_c1_tps": None, "llama_cpp_model": None, "llama_cpp_skipped": None}
    path, reason = peer_gguf(model_path, gguf)
    llm = None
    if path is not None:
        out["llama_cpp_model"] = str(path)
        llm, reason = open_llama_cpp(path, device)
    if llm is not None and max(max(p) for p in prompts) >= llm.n_vocab():
        reason = f"{path.name} has a {llm.n_vocab()}-token vocabulary, smaller than this model's"
        close_llama_cpp(llm)
        llm = None
    if llm is None:
        console.print(f"bench: llama.cpp skipped: {escape(reason)}")
        out["llama_cpp_skipped"] = reason
        return out
    try:
        console.print("bench: llama.cpp: warm-up ...")
        llama_cpp_tps(llm, prompts[0], NEW_TOKENS)
        console.print(f"bench: llama.cpp ({escape(path.name)}): concurrency 1 ...")
        runs = [llama_cpp_tps(llm, p, NEW_TOKENS) for p in prompts[:C1_PROMPTS]]
        out["llama_cpp_c1_tps"] = sum(runs) / len(runs)
    finally:
        close_llama_cpp(llm)
    return out


def _ratio(mine: float | None, theirs: float | None) -> float | None:
    return mine / theirs if mine is not None and theirs else None


def run_bench(checkpoint: Checkpoint, data: Path | None, device: str = "cpu", gguf: Path | None = None) -> dict:
    """Every side, one after the other (one model in memory at a time), on the same prompts.
    `gguf`: the GGUF file the checkpoint was converted from, when the bench's MODEL was one."""
    from onboard.engine import EngineConfig, LLMEngine

    torch.manual_seed(0)
    tokenizer = load_tokenizer(checkpoint)
    prompts = _prompts(tokenizer, data, max(max(CONCURRENCY), C1_PROMPTS))
    result: dict[str, Any] = {
        "model": str(checkpoint.path),
        "device": device,
        "new_tokens": NEW_TOKENS,
        "concurrency": list(CONCURRENCY),
        "threads": torch.get_num_threads(),
    }

    model = load_model(checkpoint).to(device)
    timer = partial(hf_tps, model, pad_id=tokenizer.pad_token_id, new_tokens=NEW_TOKENS)
    result |= _sweep("hf", "transformers", timer, prompts)
    del model, timer
    gc.collect()

    bytes_per_step = {}
    for side, numerics, batch_invariant in ENGINE_SIDES:
        config = EngineConfig(
            device=device, numerics=numerics, batch_invariant=batch_invariant, max_num_seqs=max(CONCURRENCY)
        )
        engine = LLMEngine(checkpoint.path, config)
        timer = partial(engine_tps, engine, new_tokens=NEW_TOKENS)
        result |= _sweep(side, side.replace("_", " "), timer, prompts)
        bytes_per_step[side] = engine.weight_bytes_per_decode_step()
        if numerics == "fast":
            result.setdefault("kernels", {})[side] = engine.kernel_report
        if side == "engine_fast":
            result |= _prefix_ttft(engine, tokenizer, prompts)
            result["kv_bytes_per_token"] = engine.kv_layout.bytes_per_token()
        del engine, timer
        gc.collect()

    result |= _llama_cpp(checkpoint.path, gguf, prompts, device)

    console.print("bench: memory bandwidth ...")
    bandwidth = memory_bandwidth()
    for prefix, side in (("fast", "engine_fast"), ("fast_noninvariant", "engine_fast_noninvariant")):
        for n in CONCURRENCY:
            result[f"{prefix}_over_hf_c{n}"] = _ratio(result[f"{side}_c{n}_tps"], result[f"hf_c{n}_tps"])
        result[f"{prefix}_over_llama_cpp_c1"] = _ratio(result[f"{side}_c1_tps"], result["llama_cpp_c1_tps"])
    fractions = {
        key: bytes_per_step[side] * result[f"{side}_c1_tps"] / bandwidth
        for key, side in (
            ("bandwidth_fraction_c1", "engine_fast"),
            ("bandwidth_fraction_c1_exact", "engine_exact"),
            ("bandwidth_fraction_c1_noninvariant", "engine_fast_noninvariant"),
        )
    }
    return result | {
        "weight_bytes_per_decode_step": bytes_per_step["engine_fast"],
        "memory_bandwidth_gbps": bandwidth / 1e9,
        **fractions,
    }


def _tps(value: Any) -> str:
    return f"{value:.1f}" if isinstance(value, int | float) else "—"


def _times(value: Any) -> str:
    return f"{value:.2f}×" if isinstance(value, int | float) else "—"


def bench_table(result: dict[str, Any]) -> RenderableType:
    """Tokens/s per concurrency for every side with the fast engine's ratios, then TTFT and bandwidth."""
    speed = Table(
        title=f"tokens/s: same weights, same prompts, greedy, {result['new_tokens']} new tokens per request",
        title_justify="left",
    )
    columns = ("concurrency", "transformers", "engine exact", "engine fast", "fast, not invariant", "llama.cpp")
    ratio_columns = ("fast ÷ transformers", "not invariant ÷ transformers", "fast ÷ llama.cpp")
    for column in (*columns, *ratio_columns):
        speed.add_column(column, justify="right")
    sides = ("hf", "engine_exact", "engine_fast", "engine_fast_noninvariant", "llama_cpp")
    for n in result.get("concurrency", CONCURRENCY):
        cells = [result.get(f"{side}_c{n}_tps") for side in sides]
        label = f"{n} (mean of {C1_PROMPTS})" if n == 1 else str(n)
        ratios = (
            result.get(f"fast_over_hf_c{n}"),
            result.get(f"fast_noninvariant_over_hf_c{n}"),
            result.get(f"fast_over_llama_cpp_c{n}"),
        )
        speed.add_row(label, *map(_tps, cells), *map(_times, ratios))
    if result.get("llama_cpp_skipped"):
        speed.caption = Text(f"llama.cpp skipped: {result['llama_cpp_skipped']}")
    elif result.get("llama_cpp_model"):
        speed.caption = Text(f"llama.cpp: {Path(result['llama_cpp_model']).name}, one sequence at a time")
    speed.caption_justify = "left"

    other = Table(title="engine fast: shared prefix and memory bandwidth", title_justify="left")
    for column in ("measure", "value", "note"):
        other.add_column(column, justify="left" if column == "measure" else "right")
    cold, warm = result["prefix_ttft_cold_s"], result["prefix_ttft_warm_s"]
    other.add_row(
        f"TTFT, {result['prefix_tokens']}-token shared prefix",
        f"cold {cold:.3f} s, warm {warm:.3f} s",
        f"{cold / warm:.1f}× faster warm" if warm else "",
    )
    other.add_row("memory read bandwidth, one process", f"{result['memory_bandwidth_gbps']:.1f} GB/s", "")
    fast, exact = result["bandwidth_fraction_c1"], result["bandwidth_fraction_c1_exact"]
    variant = result["bandwidth_fraction_c1_noninvariant"]
    other.add_row(
        "bandwidth bound reached, concurrency 1",
        f"fast {100 * fast:.1f} %, exact {100 * exact:.1f} %, fast not invariant {100 * variant:.1f} %",
        f"{result['weight_bytes_per_decode_step'] / 1e6:.1f} MB of weights per decode step",
    )
    return Group(speed, other, *([kernel_table(result["kernels"])] if result.get("kernels") else []))


def kernel_table(kernels: dict[str, list[dict[str, Any]]]) -> Table:
    """Fast numerics' linear kernels per weight shape, as measured on this machine
    (`engine/kernels.py`): one row / several rows, with and without batch invariance."""
    table = Table(title="fast numerics' linear kernels, measured here (one row / several rows)", title_justify="left")
    for column in ("weight shape", "count", "invariant", "not invariant", "one row, µs by kernel"):
        table.add_column(column, justify="left" if column == "weight shape" else "right")
    other = {row["shape"]: row for row in kernels.get("engine_fast_noninvariant", [])}
    for row in kernels.get("engine_fast", []):
        variant = other.get(row["shape"])
        timings = ", ".join(f"{k} {v:.0f}" for k, v in sorted(row["one_row_us"].items(), key=lambda kv: kv[1]))
        table.add_row(
            row["shape"].split(":", 2)[-1],
            str(row["count"]),
            f"{row['one_row']} / {row['rows']}",
            "—" if variant is None else f"{variant['one_row']} / {variant['rows']}",
            timings,
        )
    return table
