"""`onboard bench`: the bytes one decode step reads, counted from the engine's weights, and one run
of the bench on the tiny llama (every side, every concurrency, the table)."""

import json
from pathlib import Path

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file

from onboard.engine.config import EngineConfig
from onboard.engine.llm_engine import LLMEngine
from onboard.models import resolve_model


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


# -- one `run_bench` on the tiny llama: every side, every concurrency ----------------------------


@pytest.fixture(scope="module")
def bench_run(tiny_llama: Path) -> dict:
    """`run_bench` with few new tokens and a short shared prefix, recording every engine it builds
    and the batch sizes each engine was given."""
    import onboard.engine
    from onboard.bench import engine as bench

    built: list[tuple[EngineConfig, list[int]]] = []

    class RecordingEngine(LLMEngine):
        def __init__(self, path, config=None, **kwargs):
            super().__init__(path, config, **kwargs)
            self.batches: list[int] = []
            built.append((self.config, self.batches))

        def generate(self, prompts, params, **kwargs):
            self.batches.append(len(prompts))
            return super().generate(prompts, params, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench, "NEW_TOKENS", 3)
        mp.setattr(bench, "PREFIX_TOKENS", 48)
        mp.setattr(onboard.engine, "LLMEngine", RecordingEngine)
        result = bench.run_bench(resolve_model(tiny_llama), None)
    return {"result": result, "built": built}


def test_bench_measures_every_side_at_every_concurrency(bench_run: dict) -> None:
    from onboard.bench.engine import CONCURRENCY

    result = bench_run["result"]
    assert CONCURRENCY == (1, 16, 64) and result["concurrency"] == [1, 16, 64]
    assert result["new_tokens"] == 3
    for n in CONCURRENCY:
        for side in ("hf", "engine_exact", "engine_fast", "engine_fast_noninvariant"):
            assert result[f"{side}_c{n}_tps"] > 0, (side, n)
        assert result[f"fast_over_hf_c{n}"] == pytest.approx(result[f"engine_fast_c{n}_tps"] / result[f"hf_c{n}_tps"])
        assert result[f"fast_noninvariant_over_hf_c{n}"] == pytest.approx(
            result[f"engine_fast_noninvariant_c{n}_tps"] / result[f"hf_c{n}_tps"]
        )
    assert not {"engine_c1_tps", "engine_c16_tps"} & result.keys()  # the old single-engine keys are gone
    assert result["prefix_tokens"] == 48 and result["prefix_ttft_cold_s"] > 0 and result["prefix_ttft_warm_s"] > 0
    assert result["weight_bytes_per_decode_step"] > 0 and result["memory_bandwidth_gbps"] > 0
    assert result["bandwidth_fraction_c1"] > 0 and result["bandwidth_fraction_c1_exact"] > 0
    assert result["bandwidth_fraction_c1_noninvariant"] > 0
    # The tiny checkpoint is not the demo and no GGUF came with it: llama.cpp is skipped, with the reason.
    assert result["llama_cpp_c1_tps"] is None and result["fast_over_llama_cpp_c1"] is None
    assert "no GGUF file of this model is known" in result["llama_cpp_skipped"]
    json.dumps(result)  # what --out writes


def test_bench_builds_both_numerics_with_room_for_64_sequences(bench_run: dict) -> None:
    built = bench_run["built"]
    assert [(config.numerics, config.batch_invariant) for config, _ in built] == [
        ("exact", True),
        ("fast", True),
        ("fast", False),
    ]
    assert all(config.max_num_seqs == 64 for config, _ in built)
    # A warm-up, the 4 prompts one by one, then 16 and 64 prompts at once; the fast engine then
    # also times the shared prefix's first token, cold and warm.
    assert built[0][1] == [1, 1, 1, 1, 1, 16, 64]
    assert built[1][1] == [1, 1, 1, 1, 1, 16, 64, 1, 1]
    assert built[2][1] == [1, 1, 1, 1, 1, 16, 64]


def test_bench_table_shows_every_side_and_the_skip_reason(bench_run: dict) -> None:
    from onboard.bench.engine import bench_table

    console = Console(record=True, width=220)
    console.print(bench_table(bench_run["result"]))
    text = console.export_text()
    for column in ("transformers", "engine exact", "engine fast", "not invariant", "llama.cpp", "fast ÷ transformers"):
        assert column in text
    cells = [[c.strip() for c in line.strip("│").split("│")] for line in text.splitlines() if line.startswith("│")]
    speed = {row[0]: row[1:] for row in cells if len(row) == 9}
    assert set(speed) == {"1 (mean of 4)", "16", "64"}
    result = bench_run["result"]
    for label, n in (("1 (mean of 4)", 1), ("16", 16), ("64", 64)):
        hf, exact, fast, variant, llama, over_hf, variant_over_hf, over_llama = speed[label]
        sides = ("hf", "engine_exact", "engine_fast", "engine_fast_noninvariant")
        assert (hf, exact, fast, variant) == tuple(f"{result[f'{side}_c{n}_tps']:.1f}" for side in sides)
        assert over_hf == f"{result[f'fast_over_hf_c{n}']:.2f}×"
        assert variant_over_hf == f"{result[f'fast_noninvariant_over_hf_c{n}']:.2f}×"
        assert llama == over_llama == "—"  # skipped here; at 16 and 64 llama.cpp is never run
    assert "llama.cpp skipped: no GGUF file of this model is known" in text
    assert "48-token shared prefix" in text and "bandwidth bound reached" in text


def test_a_run_directorys_figures_go_where_its_report_reads_them(tmp_path: Path) -> None:
    from onboard.cli.engine import bench_out
    from onboard.workspace import BENCH, MANIFEST

    run, checkpoint = tmp_path / "run", tmp_path / "checkpoint"
    run.mkdir()
    (run / MANIFEST).write_text(json.dumps({"stages": {}}))
    assert bench_out(run, None) == run / BENCH == run / "bench" / "bench.json"
    assert bench_out(run, tmp_path / "x.json") == tmp_path / "x.json"
    assert bench_out(checkpoint, None) is None
