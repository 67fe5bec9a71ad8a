"""Quantize streamed (llm-compressor's offloaded loading and sequential pipeline) against in memory."""

import json
from pathlib import Path

import pytest

from onboard.budget import estimate, model_shape
from onboard.errors import OnboardError
from onboard.models import inspect_checkpoint, load_tokenizer
from onboard.quantize import modifiers
from onboard.quantize.calibration import calibration_dataset
from onboard.quantize.offloaded import conversion_mappings_kept, load_offloaded
from onboard.quantize.stage import quantize_plan, run_quantize
from onboard.recipes import Calibration, Method, Quantize
from onboard.workspace import RunDir

SETTINGS = Quantize(calibration=Calibration(num_samples=4, max_seq_length=64))
# deepseek_v3: a float32 routing bias; deepseek_v32: an experts layout onboard registers
# DeepSeek-V3.2 holds DeepSeek-V3's layers and its indexer besides.
FAMILIES = ["tiny_llama", "tiny_qwen3_moe", "tiny_deepseek_v32", "tiny_qwen3_5_moe"]


def streaming_budget(checkpoint: Path, settings: Quantize) -> int:
    tokens = settings.calibration.num_samples * settings.calibration.max_seq_length
    in_memory, streamed = estimate("quantize", model_shape(checkpoint), tokens)
    assert streamed < in_memory
    return (in_memory + streamed) // 2


def quantized(root: Path, checkpoint: Path, max_memory: int | None) -> dict:
    with RunDir(root) as run:
        entry = run_quantize(run, inspect_checkpoint(checkpoint), SETTINGS, None, max_memory)
    return entry["metrics"]


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_artifact_is_byte_identical(family: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    checkpoint = request.getfixturevalue(family)
    budget = streaming_budget(checkpoint, SETTINGS)
    assert quantize_plan(model_shape(checkpoint), SETTINGS, budget).path == "streamed"
    assert quantized(tmp_path / "a", checkpoint, None)["memory_path"] == "in-memory"
    assert quantized(tmp_path / "b", checkpoint, budget)["memory_path"] == "streamed"
    files = sorted(p.name for p in (tmp_path / "a/artifact").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "b/artifact").iterdir())
    for name in files:
        assert (tmp_path / "a/artifact" / name).read_bytes() == (tmp_path / "b/artifact" / name).read_bytes(), name
    assert (tmp_path / "a/quantize/selection.json").read_text() == (tmp_path / "b/quantize/selection.json").read_text()
    assert not list((tmp_path / "b").rglob("offload")), "the offload folder is removed"


def test_calibration_holds_one_decoder_layer(tiny_deepseek_v3: Path, tmp_path: Path) -> None:
    """Every weight starts on disk; while a decoder layer calibrates, only its own tensors are onloaded."""
    from compressed_tensors.offload.cache import OffloadCache

    checkpoint = inspect_checkpoint(tiny_deepseek_v3)
    with conversion_mappings_kept():
        model = load_offloaded(checkpoint, tmp_path / "offload")
    layers = model.model.layers
    owner = {}
    for index, layer in enumerate(layers):
        for module in layer.modules():
            if isinstance(module._parameters, OffloadCache):
                owner.update({id(t): index for t in module._parameters.offloaded_values.values()})
    assert len({*owner.values()}) == len(layers), "every decoder layer's weights are offloaded"
    resident: list[int] = []

    def count(_module, _args) -> None:
        onloaded = {owner[id(t)] for t in OffloadCache.keep_onloaded_values if id(t) in owner}
        resident.append(len(onloaded))

    for layer in layers:
        layer.register_forward_pre_hook(count)
    tokenizer = load_tokenizer(checkpoint)
    dataset = calibration_dataset(tokenizer, SETTINGS.calibration, None)
    modifiers.apply(model, tokenizer, modifiers.modifier(SETTINGS, "nvfp4"), dataset, 64)
    assert resident and max(resident) <= 1


def test_over_budget_even_streamed_refuses_before_writing(tiny_llama: Path, tmp_path: Path) -> None:
    refusal = r"^quantize needs about .* streamed, over the .* budget"
    with pytest.raises(OnboardError, match=refusal), RunDir(tmp_path / "run") as run:
        run_quantize(run, inspect_checkpoint(tiny_llama), SETTINGS, None, 1000)
    manifest = tmp_path / "run/manifest.json"
    assert not manifest.exists() or "quantize" not in json.loads(manifest.read_text())["stages"]
    assert not (tmp_path / "run/artifact").exists()


def test_search_plans_its_selection_and_refuses_over_the_streamed_peak(tiny_llama: Path) -> None:
    """`auto` plans the larger of its selection's and its calibration's peaks: in memory, streamed
    under that, and below the streamed peak a one-line refusal."""
    settings = Quantize(scheme="auto", bits_budget=5.0)
    shape = model_shape(tiny_llama)
    selection = estimate("selection", shape, settings.search.tokens)
    calibration = estimate("quantize", shape, settings.calibration.num_samples * settings.calibration.max_seq_length)
    in_memory, streamed = max(selection[0], calibration[0]), max(selection[1], calibration[1])
    assert quantize_plan(shape, settings, in_memory).path == "in-memory"
    plan = quantize_plan(shape, settings, in_memory - 1)
    assert (plan.path, plan.in_memory, plan.streamed) == ("streamed", in_memory, streamed)
    with pytest.raises(OnboardError, match=r"^quantize needs about .* streamed, over the"):
        quantize_plan(shape, settings, streamed - 1)


@pytest.mark.parametrize(
    "update",
    [
        {"method": "auto"},
        {"method": "spinquant"},
        {"distill_tokens": 256},
        {"scheme": "auto", "bits_budget": 5.0, "method": "awq"},
    ],
    ids=["method-auto", "rotations", "distill", "search-with-smoothing"],
)
def test_what_runs_in_memory_only_is_refused_streamed(tiny_llama: Path, tmp_path: Path, update: dict) -> None:
    settings = Quantize(**{**SETTINGS.model_dump(), **update})
    whole = quantize_plan(model_shape(tiny_llama), settings, 1 << 50)
    budget = (whole.in_memory + whole.streamed) // 2
    assert quantize_plan(model_shape(tiny_llama), settings, budget).path == "streamed"
    refusal = r"^quantize is over the memory budget .* in memory only"
    with pytest.raises(OnboardError, match=refusal), RunDir(tmp_path / "run") as run:
        run_quantize(run, inspect_checkpoint(tiny_llama), settings, None, budget)
    assert not (tmp_path / "run/artifact").exists()


@pytest.mark.parametrize(
    "update",
    [{"method": "auto"}, {"distill_tokens": 256}, {"scheme": "auto", "bits_budget": 5.0, "method": "awq"}],
    ids=["method-auto", "distill", "search-with-smoothing"],
)
def test_in_memory_only_steps_plan_their_extra_copy(tiny_llama: Path, update: dict) -> None:
    """A candidate's copy, a teacher or a smoothed copy is one more model held: at least the
    checkpoint's size above the same settings without the step, and streaming is unchanged."""
    shape = model_shape(tiny_llama)
    settings = Quantize(**{**SETTINGS.model_dump(), **update})
    plain = settings.model_copy(update={"method": Method(), "distill_tokens": 0})
    with_step, without = quantize_plan(shape, settings, 1 << 50), quantize_plan(shape, plain, 1 << 50)
    assert with_step.in_memory >= without.in_memory + shape.total_bytes
    assert with_step.streamed == without.streamed
