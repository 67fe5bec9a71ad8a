"""`onboard bench-kv`: what every supported family caches per token, and what DSA buys a decode step.

Part one (here): the engine's KV layout of full-size configs (no weights), in bytes per token, beside
what MLA models would cache as expanded per-head K/V.  Part two (`kv_decode.py`): a decode
step's time against the context on a small random DSA model, against the same model as dense MLA.
"""

from pathlib import Path
from typing import Any

import torch
from rich.table import Table

from onboard.engine import NUMERICS, KVLayout
from onboard.errors import OnboardError

# Published dimensions, as transformers config kwargs (each model's config.json on the Hugging Face
# hub; only what shapes the layers matters here, the rest keeps the config classes' defaults).
FULL_SIZE_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    # meta-llama/Meta-Llama-3-8B config.json
    "Llama-3-8B": (
        "LlamaConfig",
        dict(architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096, intermediate_size=14336,
             num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128),
    ),
    # Qwen/Qwen3-8B config.json
    "Qwen3-8B": (
        "Qwen3Config",
        dict(architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=4096, intermediate_size=12288,
             num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128),
    ),
    # Qwen/Qwen3-30B-A3B config.json
    "Qwen3-30B-A3B": (
        "Qwen3MoeConfig",
        dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048, moe_intermediate_size=768,
             num_experts=128, num_experts_per_tok=8, num_hidden_layers=48, num_attention_heads=32,
             num_key_value_heads=4, head_dim=128),
    ),
    # deepseek-ai/DeepSeek-V3 config.json
    "DeepSeek-V3": (
        "DeepseekV3Config",
        dict(architectures=["DeepseekV3ForCausalLM"], vocab_size=129280, hidden_size=7168, num_hidden_layers=61,
             num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=3),
    ),
    # deepseek-ai/DeepSeek-V3.2-Exp config.json: V3's MLA plus the lightning indexer
    "DeepSeek-V3.2": (
        "DeepseekV32Config",
        dict(architectures=["DeepseekV32ForCausalLM"], vocab_size=129280, hidden_size=7168, num_hidden_layers=61,
             num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=3,
             index_head_dim=128, index_n_heads=64, index_topk=2048),
    ),
    # transformers 5.17's GlmMoeDsaConfig defaults are zai-org/GLM-5's (its docstring says so)
    "GLM-5": ("GlmMoeDsaConfig", dict(architectures=["GlmMoeDsaForCausalLM"])),
    # HuggingFaceTB/SmolLM2-135M config.json (the demo model)
    "SmolLM2-135M": (
        "LlamaConfig",
        dict(architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576, intermediate_size=1536,
             num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True),
    ),
}  # fmt: skip

LONG_CONTEXT = 128 * 1024  # tokens: the per-sequence cache size column


def full_size_config(name: str) -> Any:
    import transformers

    class_name, kwargs = FULL_SIZE_MODELS[name]
    return getattr(transformers, class_name)(**kwargs)


def kv_layout_for(config: Any, dtype: torch.dtype = torch.bfloat16) -> KVLayout:
    """The layout the engine allocates for `config`, without building the model."""
    from onboard.engine import kv_layout_for as engine_layout

    return engine_layout(config, dtype)


def expanded_kv_bytes_per_token(config: Any, element_size: int = 2) -> int:
    """What an MLA model would cache as per-head K (nope + rope) and V, all layers."""
    per_head = config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim
    return config.num_attention_heads * per_head * config.num_hidden_layers * element_size


def kv_row(name: str) -> dict[str, Any]:
    from onboard.engine import engine_model_name, uses_mla

    config = full_size_config(name)
    layout = kv_layout_for(config)
    total = layout.bytes_per_token()
    by_tensor = layout.describe()
    row: dict[str, Any] = {
        "model": name,
        "family": config.model_type,
        "engine_model": engine_model_name(config),
        "layout": [{"name": t.name, "shape": list(t.shape), "layers": len(t.layers)} for t in layout.tensors],
        "bytes_per_token": total,
        "bytes_by_tensor": by_tensor,
        "gib_per_128k_tokens": total * LONG_CONTEXT / 2**30,
    }
    if uses_mla(config):
        expanded = expanded_kv_bytes_per_token(config, torch.empty((), dtype=layout.dtype).element_size())
        row["expanded_kv_bytes_per_token"] = expanded
        row["expanded_over_engine"] = expanded / total
        row["indexer_share"] = by_tensor.get("index_k", 0) / total
    return row


def kv_rows() -> list[dict[str, Any]]:
    return [kv_row(name) for name in FULL_SIZE_MODELS]


def _layout_text(row: dict[str, Any]) -> str:
    return ", ".join(f"{t['name']} {'×'.join(map(str, t['shape']))} ×{t['layers']}L" for t in row["layout"])


def kv_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="KV cache per token, bf16, all layers (engine layout)", title_justify="left")
    columns = ("model", "family", "engine layout", "bytes/token", "GiB @128k", "expanded K/V", "expanded ÷")
    for column in (*columns, "indexer"):
        justify = "left" if column in columns[:3] else "right"
        table.add_column(column, justify=justify, no_wrap=column != "engine layout")
    for row in rows:
        expanded = row.get("expanded_kv_bytes_per_token")
        share = row.get("indexer_share")
        table.add_row(
            row["model"],
            row["family"],
            _layout_text(row),
            f"{row['bytes_per_token']:,}",
            f"{row['gib_per_128k_tokens']:.2f}",
            f"{expanded:,}" if expanded else "",
            f"{row['expanded_over_engine']:.1f}×" if expanded else "",
            f"{100 * share:.1f} %" if share else "",
        )
    return table


def parse_positive_ints(option: str, text: str) -> list[int]:
    """`--contexts 1024,2048` as sorted distinct ints, or a one-line refusal."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as err:
        raise OnboardError(f"{option} {text!r}: not a comma-separated list of whole numbers") from err
    if not values or any(v < 1 for v in values):
        raise OnboardError(f"{option} {text!r}: give positive whole numbers, e.g. 1024,2048")
    return sorted(set(values))


BENCH_NUMERICS = (*NUMERICS, "absorbed")  # absorbed: fast numerics with MLA's weight-absorbed decode


def parse_numerics(text: str) -> list[str]:
    chosen = [part.strip() for part in text.split(",") if part.strip()]
    if not chosen or any(n not in BENCH_NUMERICS for n in chosen):
        raise OnboardError(f"--numerics {text!r}: give {', '.join(BENCH_NUMERICS)}, comma-separated")
    return list(dict.fromkeys(chosen))


def run_bench_kv(
    contexts: list[int],
    batches: list[int],
    numerics: list[str],
    repeats: int,
    index_topk: int,
    device: str = "cpu",
    out: Path | None = None,
) -> dict[str, Any]:
    """Both tables, printed; the figures returned (and written to `out`)."""
    from onboard import atomic
    from onboard.bench.kv_decode import decode_tables, run_decode_bench
    from onboard.console import console

    rows = kv_rows()
    console.print(kv_table(rows))
    decode = run_decode_bench(contexts, batches, numerics, repeats, index_topk, device)
    for table in decode_tables(decode):
        console.print(table)
    result = {"kv_cache": {"dtype": "bfloat16", "models": rows}, "decode": decode}
    if out is not None:
        atomic.write_json(out, result)
    return result
