"""`onboard bench-kv`: the bytes-per-token table from first principles, the layout against the
engine's own, and a tiny decode-time run (structure and keys attended, never timings)."""

import json
from pathlib import Path

import pytest
import torch

from onboard.bench.kv import (
    FULL_SIZE_MODELS,
    full_size_config,
    kv_layout_for,
    kv_row,
    parse_numerics,
    parse_positive_ints,
    run_bench_kv,
)
from onboard.errors import OnboardError

BF16 = 2  # bytes


def test_llama_3_8b_caches_k_and_v_per_kv_head() -> None:
    layers, kv_heads, head_dim = 32, 8, 128
    row = kv_row("Llama-3-8B")
    assert row["bytes_per_token"] == 2 * layers * kv_heads * head_dim * BF16 == 131072
    assert row["bytes_by_tensor"] == {"k": 65536, "v": 65536}
    assert "expanded_kv_bytes_per_token" not in row


def test_smollm2_matches_the_demo_model() -> None:
    assert kv_row("SmolLM2-135M")["bytes_per_token"] == 2 * 30 * 3 * 64 * BF16


def test_deepseek_v3_caches_one_latent_row_per_layer() -> None:
    layers, rank, rope, nope, v, heads = 61, 512, 64, 128, 128, 128
    row = kv_row("DeepSeek-V3")
    assert row["bytes_per_token"] == layers * (rank + rope) * BF16 == 70272
    assert row["expanded_kv_bytes_per_token"] == heads * (nope + rope + v) * layers * BF16
    assert row["expanded_over_engine"] == pytest.approx(heads * (nope + rope + v) / (rank + rope))
    assert row["indexer_share"] == 0


def test_dsa_adds_the_indexer_keys_on_indexer_layers() -> None:
    layers, rank, rope, index_dim = 61, 512, 64, 128
    row = kv_row("DeepSeek-V3.2")
    assert row["bytes_per_token"] == layers * (rank + rope) * BF16 + layers * index_dim * BF16
    assert row["bytes_by_tensor"]["index_k"] == layers * index_dim * BF16
    assert row["indexer_share"] == pytest.approx(index_dim / (rank + rope + index_dim))


def test_glm5_reads_its_indexer_layers_from_the_config() -> None:
    config = full_size_config("GLM-5")
    full = sum(t == "full" for t in config.indexer_types)
    row = kv_row("GLM-5")
    assert row["bytes_per_token"] == 78 * (512 + 64) * BF16 + full * 128 * BF16


def test_every_model_has_a_row_and_a_supported_architecture() -> None:
    from onboard.engine.models import model_class

    for name in FULL_SIZE_MODELS:
        model_class(full_size_config(name))
        assert kv_row(name)["bytes_per_token"] > 0


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3_moe", "tiny_deepseek_v3", "tiny_glm_moe_dsa"])
def test_layout_equals_the_engine_models_own(fixture: str, request: pytest.FixtureRequest) -> None:
    """`kv_layout_for` assembles what `DecoderModel.kv_layout` declares; GLM-5's shared layers included."""
    from onboard.engine.config import EngineConfig
    from onboard.engine.model_runner import ModelRunner

    runner = ModelRunner(request.getfixturevalue(fixture), EngineConfig(num_blocks=4), dtype=torch.bfloat16)
    assert kv_layout_for(runner.hf_config) == runner.kv_layout


def test_option_parsing_refuses_in_one_line() -> None:
    assert parse_positive_ints("--contexts", "128, 64,128") == [64, 128]
    assert parse_numerics("exact,fast,exact") == ["exact", "fast"]
    for bad in ("", "64,abc", "0,64", "-5"):
        with pytest.raises(OnboardError, match="--contexts"):
            parse_positive_ints("--contexts", bad)
    with pytest.raises(OnboardError, match="--numerics"):
        parse_numerics("quick")


def test_tiny_decode_run_attends_min_context_topk_keys(tmp_path: Path) -> None:
    topk, contexts, batches = 32, [16, 64, 128], [1, 2]
    out = tmp_path / "bench-kv.json"
    run_bench_kv(contexts, batches, ["fast", "exact"], 1, topk, out=out)
    result = json.loads(out.read_text())
    assert [r["model"] for r in result["kv_cache"]["models"]] == list(FULL_SIZE_MODELS)
    decode = result["decode"]
    assert decode["model"]["index_topk"] == topk
    points = decode["points"]
    assert len(points) == len(contexts) * len(batches) * 2 * 2
    layers = decode["model"]["num_hidden_layers"]
    for p in points:
        want = min(p["context"], topk) if p["variant"] == "dsa" else p["context"]
        # every decode row of every layer attends to `want` keys (exact numerics: a call per sequence)
        calls = len(p["attention_keys"])
        assert calls == layers * (p["batch"] if p["numerics"] == "exact" else 1), p
        assert [k for call in p["attention_keys"] for k in call] == [want] * p["batch"] * layers, p
        assert p["step_ms"] >= p["attention_ms"] > 0
        assert (p["indexer_ms"] > 0) == (p["variant"] == "dsa")
    assert {(c["numerics"], c["batch"]) for c in decode["crossover"]} == {
        (n, b) for n in ("fast", "exact") for b in batches
    }
    for cross in decode["crossover"]:
        assert set(cross) == {"numerics", "batch", "first_faster_context", "interpolated_context"}
