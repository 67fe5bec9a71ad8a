"""`scheme: auto` streamed (offloaded models, one module read at a time) against in memory."""

import json
from pathlib import Path

import pytest
import torch
from artifacts import stage_entry

from onboard.budget import estimate, model_shape
from onboard.models import inspect_checkpoint, load_tokenizer
from onboard.quantize.auto import FISHER_STREAMED, Selection
from onboard.quantize.calibration import calibration_dataset
from onboard.quantize.modifiers import offloaded_copy
from onboard.quantize.offloaded import conversion_mappings_kept, load_offloaded
from onboard.quantize.stage import quantize_plan, run_quantize
from onboard.recipes import Calibration, Quantize, Search
from onboard.workspace import RunDir

SETTINGS = Quantize(
    scheme="auto",
    bits_budget=5.7,
    calibration=Calibration(num_samples=4, max_seq_length=64),
    search=Search(tokens=128, steps=4),
)
# deepseek_v32: fused experts in the reference, linearized in the formats' copies and the artifact
# (qwen3_moe's selection runs streamed in the memory test below)
FAMILIES = ["tiny_llama", "tiny_deepseek_v32"]
# What the streamed record leaves out (the Fisher diagnostic needs a backward pass) or times.
UNSHARED = ("fisher", "rank_correlation", "fisher_note")


def streaming_budget(checkpoint: Path) -> int:
    """Over the streamed peak and under the in-memory one, each the larger of the selection's and the calibration's."""
    shape, calibration = model_shape(checkpoint), SETTINGS.calibration
    selection = estimate("selection", shape, SETTINGS.search.tokens)
    quantize = estimate("quantize", shape, calibration.num_samples * calibration.max_seq_length)
    low, high = max(selection[1], quantize[1]), max(selection[0], quantize[0])
    assert low < high
    return (low + high) // 2


def selected(root: Path, checkpoint: Path, max_memory: int | None) -> tuple[dict, dict]:
    with RunDir(root) as run:
        entry = run_quantize(run, inspect_checkpoint(checkpoint), SETTINGS, None, max_memory)
    return entry["metrics"], json.loads((root / "quantize/selection.json").read_text())


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_selection_equals_in_memory(
    family: str, request: pytest.FixtureRequest, quantized_run, tmp_path: Path
) -> None:
    checkpoint = request.getfixturevalue(family)
    budget = streaming_budget(checkpoint)
    assert quantize_plan(model_shape(checkpoint), SETTINGS, budget).path == "streamed"
    in_memory = quantized_run(checkpoint, SETTINGS)  # the same run test_selection.py reads
    metrics_a = stage_entry(in_memory, "quantize")["metrics"]
    a = json.loads((in_memory / "quantize/selection.json").read_text())
    metrics_b, b = selected(tmp_path / "b", checkpoint, budget)
    assert (metrics_a["memory_path"], metrics_b["memory_path"]) == ("in-memory", "streamed")
    assert b["sensitivity"]["fisher_note"] == FISHER_STREAMED
    assert any(v is not None for per in a["sensitivity"]["fisher"].values() for v in per.values())
    for record in (a, b):
        # in memory: the model llmcompressor quantized; streamed: the saved artifact, decompressed
        assert record.pop("artifact_kld") == pytest.approx(record["final"]["measured_kld"], rel=1e-6)
        record.pop("seconds")
        for key in UNSHARED:
            record["sensitivity"].pop(key, None)
    assert a == b  # every measured KL bit for bit, the search's trace, the groups' formats
    for name in sorted(p.name for p in (in_memory / "artifact").iterdir()):
        assert (in_memory / "artifact" / name).read_bytes() == (tmp_path / "b/artifact" / name).read_bytes(), name
    assert not list((tmp_path / "b").rglob("offload")), "the offload folders are removed"


def _resident_layers(models: list[torch.nn.Module]) -> int:
    """Decoder layers of `models` with a weight in memory rather than in a file on disk."""
    from compressed_tensors.offload.cache import OffloadCache

    def resident(module: torch.nn.Module) -> bool:
        params = module._parameters
        values = params.offloaded_values.values() if isinstance(params, OffloadCache) else params.values()
        return any(v is not None and v.device.type != "meta" for v in values)

    return sum(any(resident(m) for m in layer.modules()) for model in models for layer in model.model.layers)


def test_streamed_selection_keeps_every_decoder_layer_on_disk(tiny_qwen3_moe: Path, tmp_path: Path) -> None:
    """Sampled as each decoder layer runs, through the sensitivities and the search: no decoder
    layer of the reference or of a format's copy holds its weights in memory."""
    checkpoint = inspect_checkpoint(tiny_qwen3_moe)
    tokenizer = load_tokenizer(checkpoint)
    dataset = calibration_dataset(tokenizer, SETTINGS.calibration, None)
    with conversion_mappings_kept():
        reference = load_offloaded(checkpoint, tmp_path / "reference", linearized=False)
        sources = {}

        def source(fmt: str) -> torch.nn.Module:
            sources[fmt] = offloaded_copy(checkpoint, tmp_path / fmt, tokenizer, SETTINGS, fmt, dataset)
            return sources[fmt]

        samples: list[int] = []
        for layer in reference.model.layers:
            layer.register_forward_pre_hook(lambda *_: samples.append(_resident_layers([reference, *sources.values()])))
        selection = Selection(reference, tokenizer, SETTINGS, dataset, [SETTINGS.bits_budget], source)
        selection.select(SETTINGS.bits_budget, SETTINGS.search.steps)
    assert set(sources) == {"nvfp4", "fp8"}
    assert len(samples) > len(selection.groups) * 2, "every sensitivity and candidate ran the layers"
    assert max(samples) == 0
