"""`quantize.method`: names that compose, the modifier stack they give, rotations that leave the
unquantized model alone, and `method: auto`'s rule for keeping a lever."""

import json
from pathlib import Path

import pytest
import torch
from artifacts import quantize_into

from onboard.models import inspect_checkpoint, load_model, load_tokenizer
from onboard.quantize.method_choice import choose_method, method_of
from onboard.quantize.modifiers import modifier, rotated_copy
from onboard.quantize.search import MIN_Z, gain_z
from onboard.recipes import Calibration, Method, Quantize, Search


def test_names_compose_in_llm_compressors_order() -> None:
    method = method_of("expanded_mse+gptq+spinquant")
    assert (method.algorithm, method.observer, method.rotations) == ("gptq", "nvfp4_expanded_mse", ["R1", "R2"])
    assert method.name == "spinquant+gptq+expanded_mse"
    assert method_of(method.name) == method
    assert Method().name == "rtn" and method_of("fouroversix").name == "expanded_mse"
    stack = modifier(Quantize(method=method), "nvfp4")
    assert [type(m).__name__ for m in stack] == ["SpinQuantModifier", "GPTQModifier"]
    assert stack[-1].weight_observer == "nvfp4_expanded_mse"
    assert [type(m).__name__ for m in modifier(Quantize(method="awq"), "nvfp4")] == [
        "AWQModifier",
        "QuantizationModifier",
    ]


def test_options_off_their_default_are_part_of_the_name() -> None:
    method = method_of("gptq+awq+gptq_dampening=0.1+gptq_actorder=none")
    assert (method.gptq_dampening, method.gptq_actorder) == (0.1, None)
    assert method.name == "awq+gptq+gptq_actorder=none+gptq_dampening=0.1"
    assert method_of(method.name) == method
    assert method_of("gptq+gptq_dampening=0.01").name == "gptq"  # the default is not spelled out
    gptq = modifier(Quantize(method=method), "nvfp4")[-1]
    assert (gptq.dampening_frac, gptq.actorder) == (0.1, None)


@pytest.mark.parametrize(
    "name", ["gptq+autoround", "foo", "autoround+mse", "gptq+observer=mse", "gptq+damp=0.1", "gptq+gptq_dampening=x"]
)
def test_bad_method_names_are_refused(name: str) -> None:
    with pytest.raises(ValueError):
        Quantize(method=name)


def test_autoround_tunes_nvfp4_and_rounds_the_rest_to_nearest() -> None:
    tuned, pinned = modifier(Quantize(method="autoround"), "nvfp4", {"fp8": ["re:.*o_proj$"]})
    assert type(tuned).__name__ == "AutoRoundModifier" and tuned.scheme == "NVFP4"
    assert "re:.*o_proj$" in tuned.ignore  # the pinned group is left to the second modifier
    assert type(pinned).__name__ == "QuantizationModifier" and pinned.scheme == {"FP8_DYNAMIC": ["re:.*o_proj$"]}
    # an FP8 copy of a search: auto-round has no preset for it, so it is rounded to nearest
    assert [type(m).__name__ for m in modifier(Quantize(method="autoround"), "fp8")] == ["QuantizationModifier"]


# One artifact per lever: smoothing (AWQ, SmoothQuant), rotations under GPTQ with an observer,
# AutoRound next to a pinned FP8 group.
ARTIFACT_METHODS = ("awq", "smoothquant+expanded_mse", "spinquant+gptq+expanded_mse", "autoround")


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> dict[str, Path]:
    calibration = Calibration(num_samples=4, max_seq_length=64)
    return {
        name: quantize_into(
            tmp_path_factory.mktemp(name.replace("+", "_")),
            tiny_llama,
            Quantize(
                scheme="nvfp4",
                method=name,
                calibration=calibration,
                formats={"fp8": ["re:.*o_proj$"]} if name == "autoround" else {},
            ),
        )
        for name in ARTIFACT_METHODS
    }


def test_autoround_keeps_bf16_on_a_cpu_without_bf16_instructions(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto-round asks cpuid whether the CPU has avx512_bf16 and, where not, tunes the whole model
    cast to float32; inside onboard's oneshot the answer is BF16 on every CPU (a CPU with none is
    simulated by auto-round's own cached answer)."""
    from auto_round.utils.device_manager import CpuARDevice

    from onboard.quantize import modifiers

    monkeypatch.setattr(CpuARDevice, "_bf16_supported", False, raising=False)
    assert not CpuARDevice("cpu").supports_bf16()
    with modifiers._autoround_in_bf16_on_every_cpu():
        assert CpuARDevice("cpu").supports_bf16()


@pytest.mark.parametrize("name", ARTIFACT_METHODS)
def test_each_methods_artifact_loads_with_engine_parity(artifacts, tiny_llama: Path, name: str) -> None:
    """A plain compressed-tensors NVFP4 checkpoint whichever lever made it: transformers loads it,
    and the engine computes it as transformers does (adapt's rule for W4A4 artifacts)."""
    from onboard.adapt.measure import measure_parity

    artifact = artifacts[name]
    config = json.loads((artifact / "config.json").read_text())["quantization_config"]
    formats = {group["format"] for group in config["config_groups"].values()}
    assert formats == ({"nvfp4-pack-quantized", "float-quantized"} if name == "autoround" else {"nvfp4-pack-quantized"})
    selection = json.loads((artifact.parent / "quantize/selection.json").read_text())
    assert selection["method"] == method_of(name).name
    result = measure_parity(
        inspect_checkpoint(artifact), torch.bfloat16, num_prompts=2, source=inspect_checkpoint(tiny_llama)
    )
    assert result["rule"] == "layerwise_distribution"
    assert result["max_abs_logit_diff"] == 0.0  # exact numerics: transformers' own products
    assert result["layerwise"]["passed"], result["layerwise"]


def test_rotations_leave_the_unquantized_models_logits_unchanged(tiny_llama: Path) -> None:
    checkpoint = inspect_checkpoint(tiny_llama)
    model = load_model(checkpoint).float()
    ids = torch.randint(0, 500, (2, 32), generator=torch.Generator().manual_seed(0))
    rotated = rotated_copy(model, load_tokenizer(checkpoint), method_of("spinquant"))
    with torch.no_grad():
        before, after = model(ids).logits, rotated(ids).logits
    changed = rotated.model.layers[0].self_attn.q_proj.weight
    assert not torch.allclose(changed, model.model.layers[0].self_attn.q_proj.weight)
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)


def test_gain_rule_keeps_only_gains_beyond_two_standard_errors() -> None:
    generator = torch.Generator().manual_seed(0)
    best = torch.rand(4096, dtype=torch.float64, generator=generator)
    noise = 0.05 * torch.randn(4096, dtype=torch.float64, generator=generator)
    assert gain_z(best, best - 0.01 + noise) > MIN_Z  # built to pass: a small gain on every token
    assert gain_z(best, best - 0.0005 + noise) < MIN_Z  # built to fail: within the noise
    assert gain_z(best, best + 0.01 + noise) < 0


def test_method_auto_trace_follows_the_rule(tiny_llama: Path) -> None:
    from onboard.quantize.calibration import calibration_dataset

    checkpoint = inspect_checkpoint(tiny_llama)
    tokenizer = load_tokenizer(checkpoint)
    settings = Quantize(
        method="auto",
        candidates=["rtn", "expanded_imatrix", "mse"],
        calibration=Calibration(num_samples=4, max_seq_length=64),
        search=Search(tokens=256),
    )
    dataset = calibration_dataset(tokenizer, settings.calibration, None)
    chosen, record = choose_method(load_model(checkpoint), tokenizer, settings, "nvfp4", dataset)
    trace = record["trace"]
    assert [row["method"] for row in trace] == ["rtn", "expanded_imatrix", "mse"]  # rtn is measured once
    best = trace[0]
    for row in trace[1:]:
        assert row["kept"] == (row["gain_z"] > MIN_Z)
        if row["kept"]:
            assert row["mean_kld"] < best["mean_kld"]
            best = row
    assert chosen.name == record["chosen"] == best["method"]


def test_pinned_groups_apply_without_could_not_match_warnings(tiny_llama: Path, tmp_path: Path, caplog) -> None:
    """compressed-tensors warns for a target no module was credited to; pinned patterns listed
    after "Linear" were never credited, though applied (issue 24's quick-demo warnings), both
    when llm-compressor applies the recipe and when transformers loads the saved artifact."""
    from onboard.quantize.modifiers import apply, patterns_first

    checkpoint = inspect_checkpoint(tiny_llama)
    model = load_model(checkpoint)
    pinned = {"fp8": [r"re:^model\.layers\.0\.self_attn\.o_proj$"], "bf16": [r"re:^model\.layers\.1\.mlp\.down_proj$"]}
    with caplog.at_level("WARNING", logger="compressed_tensors"):
        apply(model, load_tokenizer(checkpoint), modifier(Quantize(scheme="nvfp4a16"), "nvfp4a16", pinned), None, 64)
        model.save_pretrained(tmp_path, save_compressed=True)
        patterns_first(tmp_path)
        loaded = load_model(inspect_checkpoint(tmp_path))
    assert not [r for r in caplog.records if "Could not match" in r.getMessage()]
    groups = json.loads((tmp_path / "config.json").read_text())["quantization_config"]["config_groups"]
    assert [group["targets"] for group in groups.values()][-1] == ["Linear"]
    for layers in (model.model.layers, loaded.model.layers):
        assert layers[0].self_attn.o_proj.quantization_scheme.weights.num_bits == 8
        assert layers[0].self_attn.q_proj.quantization_scheme.weights.num_bits == 4
        assert getattr(layers[1].mlp.down_proj, "quantization_scheme", None) is None


@pytest.mark.parametrize("name", ["awq", "smoothquant", "spinquant", "awq+gptq"])
def test_a_searchs_copies_share_one_smoothing_and_rotation(tiny_llama: Path, name: str) -> None:
    """The prepared model computes the original function; the search's copies are made from it, so
    its uniform assignment composed from them is the model the whole method quantizes."""
    from onboard.evaluate.replay import LayerReplay
    from onboard.quantize.auto import search_windows
    from onboard.quantize.calibration import calibration_dataset
    from onboard.quantize.modifiers import prepared_copy, quantized_copy

    checkpoint = inspect_checkpoint(tiny_llama)
    tokenizer = load_tokenizer(checkpoint)
    model = load_model(checkpoint).float()
    settings = Quantize(method=name, calibration=Calibration(num_samples=4, max_seq_length=64))
    dataset = calibration_dataset(tokenizer, settings.calibration, None)
    prepared, rest = prepared_copy(model, tokenizer, settings, dataset)
    assert prepared is not model
    assert rest.method == settings.method.model_copy(update={"smoothing": "none", "rotations": []})
    ids = torch.randint(0, 500, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(prepared(ids).logits, model(ids).logits, atol=1e-4, rtol=1e-4)
    replay = LayerReplay(model, search_windows(dataset, 128))
    whole = replay.model_kl(quantized_copy(model, tokenizer, settings, "nvfp4", dataset)).mean()
    shared = replay.model_kl(quantized_copy(prepared, tokenizer, rest, "nvfp4", dataset)).mean()
    assert float(shared) == pytest.approx(float(whole), rel=1e-6)
