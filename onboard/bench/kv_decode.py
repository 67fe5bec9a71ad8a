"""`onboard bench-kv`, part two: a decode step's time against the context, DSA beside dense MLA.

A small random deepseek_v32 model (`BENCH_MODEL`) runs in the engine's `StepBench`.  Nothing is
prefilled at length: each sequence gets L tokens' worth of paged blocks, every cached tensor is
filled with noise of the per-column mean and spread a short real prefill writes, and decode steps
run at context L.  The same model with its indexers detached is dense MLA.  The indexer's `select`
and the attention (the backend's `decode` in the absorbed form, the expanded decode otherwise)
are timed by wrapping them, which also counts the keys each decode row attends.  All variants run
interleaved within each repetition, so the machine's drift hits them alike.
"""

import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.progress import Progress
from rich.table import Table

from onboard.console import console

BENCH_MODEL: dict[str, Any] = dict(
    architectures=["DeepseekV32ForCausalLM"], vocab_size=2048, hidden_size=512, intermediate_size=1024,
    num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=256, kv_lora_rank=128,
    qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, index_head_dim=64, index_n_heads=8, index_topk=2048,
    first_k_dense_replace=2, max_position_embeddings=65536,  # every MLP dense: the bench is about attention
)  # fmt: skip
BLOCK_SIZE = 16
CALIBRATION_TOKENS = 128  # the real prefill whose cache rows set the noise's scale
VARIANTS = ("dsa", "dense")


@dataclass
class Probe:
    """What the wrapped parts measured during one step."""

    seconds: dict[str, float] = field(default_factory=lambda: {"indexer": 0.0, "attention": 0.0})
    keys: list[list[int]] = field(default_factory=list)  # per attention call (layer): keys per decode row

    def reset(self) -> None:
        self.seconds = {"indexer": 0.0, "attention": 0.0}
        self.keys = []


def _sync_for(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else lambda: None


def _timed(
    fn: Callable, probe: Probe, part: str, sync: Callable[[], None], count_keys: Callable[..., list[int]] | None = None
) -> Callable:
    def wrapper(*args, **kwargs):
        if count_keys is not None:
            probe.keys.append(count_keys(*args, **kwargs))
        sync()
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        sync()
        probe.seconds[part] += time.perf_counter() - start
        return out

    return wrapper


def _backend_keys(q, layer, cache, meta, scale, *, selected=None, **_) -> list[int]:
    return [len(s) for s in selected] if selected is not None else list(meta.decode_context_lens)


def _expanded_keys(q, selected, ctx) -> list[int]:
    return [len(s) for s in selected] if selected is not None else list(ctx.attn.decode_context_lens)


def _attentions(bench) -> list:
    return [bench.decoder_layer(i).self_attn for i in range(bench.num_decoder_layers)]


def instrument(bench, probe: Probe) -> None:
    """Wrap every indexer's `select`, the backend's `decode` and each layer's expanded decode."""
    sync = _sync_for(bench.device)
    backend = bench.attention_backend
    backend.decode = _timed(backend.decode, probe, "attention", sync, _backend_keys)
    for attn in _attentions(bench):
        attn._decode_expanded = _timed(attn._decode_expanded, probe, "attention", sync, _expanded_keys)
        if attn.indexer is not None:
            attn.indexer.select = _timed(attn.indexer.select, probe, "indexer", sync)


class Switch:
    """Turns the model's DSA on and off (dense MLA: no indexer, no shared selection) and sets the
    numerics: `exact`, `fast` (as served: in bf16 the expanded decode) or `absorbed` (fast
    numerics with the weight-absorbed decode, what keeping the expanded form costs); `set`
    returns the engine numerics the step runs as."""

    def __init__(self, bench):
        self.saved = [(attn, attn.indexer, attn.shares_selection, attn.absorb) for attn in _attentions(bench)]

    def set(self, variant: str, numerics: str) -> str:
        for attn, indexer, shares, absorb in self.saved:
            attn.indexer = indexer if variant == "dsa" else None
            attn.shares_selection = shares if variant == "dsa" else False
            attn.set_absorbed(absorb or numerics == "absorbed")
        return "exact" if numerics == "exact" else "fast"


def build_model(directory: Path, index_topk: int, seed: int = 0) -> Path:
    import transformers

    torch.manual_seed(seed)
    config = transformers.DeepseekV32Config(**{**BENCH_MODEL, "index_topk": index_topk})
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(directory)
    return directory


def _tokens(length: int, gen: torch.Generator) -> list[int]:
    return torch.randint(3, BENCH_MODEL["vocab_size"], (length,), generator=gen).tolist()


@torch.no_grad()
def fill_cache(bench, gen: torch.Generator) -> None:
    """Every slot of every cached tensor: noise with the per-column mean and std of a real prefill's rows."""
    bench.run([bench.place(_tokens(CALIBRATION_TOKENS, gen), 0, 0)])
    for layer in bench.cache_tensors():  # [num_blocks, block_size, *shape]
        flat = layer.view(-1, *layer.shape[2:])
        rows = flat[:CALIBRATION_TOKENS].float()
        mean, std = rows.mean(0), rows.std(0)
        noise = torch.randn(flat.shape, generator=gen).to(flat.device)
        flat.copy_((mean + std * noise).to(flat.dtype))


def decode_batch(bench, context: int, batch: int, blocks_per_seq: int, gen: torch.Generator) -> list:
    """`batch` sequences at context `context` (the last token's KV not yet computed), one block range each."""
    return [bench.place(_tokens(context, gen), i * blocks_per_seq, context - 1) for i in range(batch)]


def _step(bench, scheduled: list, numerics: str, probe: Probe) -> dict[str, Any]:
    sync = _sync_for(bench.device)
    probe.reset()
    sync()
    start = time.perf_counter()
    bench.run(scheduled, numerics)
    sync()
    return {"step": time.perf_counter() - start, **probe.seconds, "keys": probe.keys}


def _point(context: int, batch: int, numerics: str, variant: str, samples: list[dict]) -> dict[str, Any]:
    median = lambda part: 1e3 * statistics.median(s[part] for s in samples)  # noqa: E731
    return {
        "context": context,
        "batch": batch,
        "numerics": numerics,
        "variant": variant,
        "step_ms": median("step"),
        "indexer_ms": median("indexer"),
        "attention_ms": median("attention"),
        "attention_keys": samples[-1]["keys"],
        "repeats": len(samples),
    }


def crossover(points: list[dict], numerics: str, batch: int) -> dict[str, Any]:
    """The first measured context from which DSA's step is faster at every larger one, and the
    context where the step-time difference crosses zero (linear between the two measured sides)."""
    mine = [p for p in points if p["numerics"] == numerics and p["batch"] == batch]
    ctx = sorted({p["context"] for p in mine})
    step = {(p["context"], p["variant"]): p["step_ms"] for p in mine}
    diffs = [step[(c, "dsa")] - step[(c, "dense")] for c in ctx]
    first = next((i for i in range(len(ctx)) if all(d < 0 for d in diffs[i:])), None)
    interpolated = None
    if first is not None and first > 0:
        (c0, d0), (c1, d1) = (ctx[first - 1], diffs[first - 1]), (ctx[first], diffs[first])
        interpolated = c0 + (c1 - c0) * d0 / (d0 - d1)
    return {
        "numerics": numerics,
        "batch": batch,
        "first_faster_context": ctx[first] if first is not None else None,
        "interpolated_context": interpolated,
    }


@dataclass(frozen=True)
class Plan:
    contexts: list[int]
    batches: list[int]
    numerics: list[str]
    repeats: int
    warmup: int = 1

    @property
    def rounds(self) -> int:
        return self.warmup + self.repeats

    @property
    def blocks_per_seq(self) -> int:
        return -(-max(*self.contexts, CALIBRATION_TOKENS) // BLOCK_SIZE)


def _measure(bench, plan: Plan, gen: torch.Generator) -> dict[tuple, list[dict]]:
    """Every variant's steps at every (context, batch), interleaved; per point the timed samples."""
    probe, switch = Probe(), Switch(bench)
    instrument(bench, probe)
    variants = [(n, v) for n in plan.numerics for v in VARIANTS]
    samples: dict[tuple, list[dict]] = {}
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("bench-kv: decode steps", total=len(plan.contexts) * len(plan.batches) * plan.rounds)
        for context in plan.contexts:
            for batch in plan.batches:
                scheduled = decode_batch(bench, context, batch, plan.blocks_per_seq, gen)
                for rep in range(plan.rounds):
                    for n, v in variants if rep % 2 == 0 else variants[::-1]:
                        result = _step(bench, scheduled, switch.set(v, n), probe)
                        if rep >= plan.warmup:
                            samples.setdefault((context, batch, n, v), []).append(result)
                    progress.advance(task)
    return samples


def run_decode_bench(
    contexts: list[int], batches: list[int], numerics: list[str], repeats: int, index_topk: int, device: str = "cpu"
) -> dict[str, Any]:
    from onboard.engine import EngineConfig, StepBench

    gen = torch.Generator().manual_seed(0)
    plan = Plan(contexts, batches, numerics, repeats)
    settings = EngineConfig(device=device, block_size=BLOCK_SIZE, num_blocks=max(batches) * plan.blocks_per_seq)
    with tempfile.TemporaryDirectory(prefix="onboard-bench-kv-") as tmp:
        bench = StepBench(build_model(Path(tmp), index_topk), settings, dtype=torch.bfloat16)
        fill_cache(bench, gen)
        samples = _measure(bench, plan, gen)
    points = [_point(*key, runs) for key, runs in samples.items()]
    return {
        "model": {k: v for k, v in BENCH_MODEL.items() if k != "architectures"} | {"index_topk": index_topk},
        "block_size": BLOCK_SIZE,
        "device": device,
        "torch_threads": torch.get_num_threads(),
        "points": points,
        "crossover": [crossover(points, n, b) for n in numerics for b in batches],
    }


DECODE_COLUMNS = ("context", "DSA step", "dense step", "dense ÷ DSA", "indexer", "DSA attn", "dense attn", "DSA keys")


def _caption(cross: dict[str, Any]) -> str:
    first, at = cross["first_faster_context"], cross["interpolated_context"]
    if first is None:
        return "DSA never faster here"
    return f"DSA faster from {first:,} tokens" + (f" (crossover ≈ {at:,.0f})" if at else "")


def decode_table(result: dict[str, Any], cross: dict[str, Any]) -> Table:
    n, b = cross["numerics"], cross["batch"]
    rows = {(p["context"], p["variant"]): p for p in result["points"] if p["numerics"] == n and p["batch"] == b}
    title = (
        f"decode step, {n} numerics, batch {b}: DSA (top-{result['model']['index_topk']}) against dense MLA, median ms"
    )
    table = Table(title=title, title_justify="left", caption=_caption(cross))
    for column in DECODE_COLUMNS:
        table.add_column(column, justify="right")
    for context in sorted({c for c, _ in rows}):
        dsa, dense = rows[(context, "dsa")], rows[(context, "dense")]
        table.add_row(
            f"{context:,}",
            f"{dsa['step_ms']:.2f}",
            f"{dense['step_ms']:.2f}",
            f"{dense['step_ms'] / dsa['step_ms']:.2f}×",
            f"{dsa['indexer_ms']:.2f}",
            f"{dsa['attention_ms']:.2f}",
            f"{dense['attention_ms']:.2f}",
            f"{max(k for call in dsa['attention_keys'] for k in call):,}",
        )
    return table


def decode_tables(result: dict[str, Any]) -> list[Table]:
    return [decode_table(result, cross) for cross in result["crossover"]]
