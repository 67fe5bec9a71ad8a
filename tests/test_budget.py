"""The memory budget: sizes, a checkpoint's shape from its headers, each stage's plan, the refusals."""

from pathlib import Path

import pytest
from cli_run import onboard, one_line_error

from onboard.budget import (
    DEFAULT_FRACTION,
    estimate,
    machine_memory,
    model_shape,
    parse_size,
    plan_stage,
    resolve_budget,
)
from onboard.errors import OnboardError


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("6GB", 6 * 10**9),
        ("6G", 6 * 10**9),
        ("6GiB", 6 * 2**30),
        ("1.5 gb", 15 * 10**8),
        ("500MB", 5 * 10**8),
        ("42", 42),
    ],
)
def test_sizes(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["six gigs", "6 GBs", "-1GB", ""])
def test_bad_sizes_are_refused(text: str) -> None:
    with pytest.raises(OnboardError, match="--max-memory"):
        parse_size(text)


def test_the_default_budget_is_a_stated_fraction_of_the_machine() -> None:
    assert resolve_budget(None) == int(DEFAULT_FRACTION * machine_memory())
    assert machine_memory() > 0


def test_shape_from_the_headers_counts_every_stored_byte(tiny_deepseek_v3: Path) -> None:
    from safetensors import safe_open

    shape = model_shape(tiny_deepseek_v3)
    stored = 0
    with safe_open(str(tiny_deepseek_v3 / "model.safetensors"), framework="pt") as handle:
        for name in handle.keys():  # noqa: SIM118
            tensor = handle.get_tensor(name)
            stored += tensor.numel() * tensor.element_size()
    assert shape.total_bytes == stored
    assert shape.num_layers == 3 and shape.layer_bytes[1] == shape.layer_bytes[2] > shape.layer_bytes[0]
    assert (shape.hidden_size, shape.vocab_size) == (64, 512)


def test_a_plan_prefers_memory_then_streaming_then_an_endpoint(tiny_llama: Path) -> None:
    shape = model_shape(tiny_llama)
    in_memory, streamed = estimate("eval", shape, 1024)
    assert streamed < in_memory
    assert plan_stage("eval", shape, in_memory, 1024).path == "in-memory"
    assert plan_stage("eval", shape, in_memory - 1, 1024).path == "streamed"
    assert plan_stage("eval", shape, streamed - 1, 1024, endpoint=True).path == "endpoint"
    smoke, none = estimate("smoke", shape, 0)
    assert none is None
    with pytest.raises(OnboardError, match=r"--endpoint URL --reference-endpoint URL$"):
        plan_stage("smoke", shape, smoke - 1, 0, options="--endpoint URL --reference-endpoint URL")


def test_more_tokens_more_memory(tiny_llama: Path) -> None:
    shape = model_shape(tiny_llama)
    for stage in ("quantize", "eval", "adapt", "speculator", "selection"):
        small, big = estimate(stage, shape, 100), estimate(stage, shape, 10_000)
        assert small[0] < big[0] and small[1] < big[1], stage


def test_run_prints_the_plan_and_refuses_generation_without_endpoints(tiny_llama: Path, tmp_path: Path, capsys) -> None:
    """Over the budget, smoke needs both servers: one line naming the options, nothing written."""
    shape = model_shape(tiny_llama)
    budget = estimate("smoke", shape, 0)[0] - 1
    out = tmp_path / "run"
    argv = ["run", str(tiny_llama), "--out", str(out), "--stages", "smoke", "--max-memory", str(budget)]
    code, _, err = onboard(argv, capsys)
    assert code != 0
    line = one_line_error(err)
    assert line.startswith("onboard: error: smoke needs about") and "--reference-endpoint URL" in line
    assert not out.exists()


def test_run_plans_the_stages_it_is_given(tiny_llama: Path, tmp_path: Path, capsys) -> None:
    """A budget under eval's in-memory peak: the plan says streamed, and the eval streams."""
    import json

    out = tmp_path / "run"
    assert onboard(["quantize", str(tiny_llama), "--out", str(out), "--num-samples", "2"], capsys)[0] == 0
    shape = model_shape(tiny_llama)
    tokens = 256 + shape.num_layers * 2048  # --max-tokens, and the default per-layer tokens
    budget = estimate("eval", shape, tokens, shape)[1]  # both sides as large as the reference
    argv = ["run", str(tiny_llama), "--out", str(out), "--stages", "eval", "--max-memory", str(budget)]
    code, stdout, stderr = onboard([*argv, "--max-tokens", "256"], capsys)
    assert code == 0
    assert "memory plan" in stdout + stderr
    stages = json.loads((out / "manifest.json").read_text())["stages"]
    assert stages["eval"]["metrics"]["memory_path"] == "streamed"


def test_bench_quant_over_its_in_memory_peak_refuses_before_loading(tiny_llama: Path, tmp_path: Path, capsys) -> None:
    """bench-quant compares methods on in-memory copies: a budget that only the streamed selection
    fits is refused in one line pointing at `quantize --scheme auto`, and nothing is written."""
    in_memory, streamed = estimate("selection", model_shape(tiny_llama), 2048)
    out = tmp_path / "bench.json"
    argv = ["bench-quant", str(tiny_llama), "--out", str(out), "--max-memory", str((in_memory + streamed) // 2)]
    code, _, err = onboard(argv, capsys)
    assert code != 0
    line = one_line_error(err)
    assert line.startswith("onboard: error: bench-quant holds a model per format") and "--scheme auto" in line
    assert not out.exists()


def test_bench_over_budget_names_the_endpoint_option(tiny_llama: Path, capsys) -> None:
    """The engine and its peers each load the model: over the budget, bench refuses in one line
    that points at benching the deployment instead."""
    budget = estimate("bench", model_shape(tiny_llama), 0)[0] - 1
    code, _, err = onboard(["bench", str(tiny_llama), "--max-memory", str(budget)], capsys)
    assert code != 0
    line = one_line_error(err)
    assert line.startswith("onboard: error: bench needs about") and line.endswith("--endpoint URL")
