"""CheckpointWeights on real artifacts of the quantize stage, against the model compressed-tensors
decompresses (onboard.models.load_model): the same weights, activations and outputs, bit for bit."""

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import tiny_models
import torch
from artifacts import stored_tensors as stored
from compressed_tensors.quantization.lifecycle.forward import forward_quantize

from onboard.engine.linear import EngineLinear
from onboard.engine.weights import CheckpointWeights, NotFusable
from onboard.models import inspect_checkpoint, load_model, load_tokenizer
from onboard.recipes import NEVER_QUANTIZE, Calibration, Quantize

CALIB = Calibration(num_samples=2, max_seq_length=64)
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.view(INT_VIEW[a.dtype]), b.view(INT_VIEW[b.dtype]))


# ---------------------------------------------------------------------------------------------
# Artifacts: the quantize stage on the tiny checkpoints, and one true "mixed-precision" artifact
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def artifacts(
    tmp_path_factory: pytest.TempPathFactory, quantized_run, tiny_llama: Path, tiny_qwen3_moe: Path
) -> Callable[[str], Path]:
    """Artifact directories by label, each quantized once, on first use."""
    settings = {
        "nvfp4": (tiny_llama, Quantize(scheme="nvfp4", calibration=CALIB)),
        "nvfp4a16": (tiny_llama, Quantize(scheme="nvfp4a16", calibration=CALIB)),
        "fp8": (tiny_llama, Quantize(scheme="fp8", calibration=CALIB)),
        # down_proj stays bf16: config format nvfp4, some layers plain.
        "nvfp4_bf16_down": (
            tiny_llama,
            Quantize(scheme="nvfp4", calibration=CALIB, ignore=[*NEVER_QUANTIZE, "re:.*down_proj"]),
        ),
        "moe_nvfp4": (tiny_qwen3_moe, Quantize(scheme="nvfp4", calibration=CALIB)),
    }
    done: dict[str, Path] = {}

    def get(label: str) -> Path:
        if label not in done:
            if label == "mixed_precision":
                done[label] = _mixed_precision(tiny_llama, tmp_path_factory.mktemp(f"engine_{label}") / "artifact")
            else:
                done[label] = quantized_run(*settings[label]) / "artifact"
        return done[label]

    return get


def _mixed_precision(checkpoint_dir: Path, out: Path) -> Path:
    """NVFP4 W4A4 attention, FP8 W8A8 MLPs but layer 1's down_proj in BF16: format "mixed-precision"."""
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    from onboard.quantize.calibration import calibration_dataset

    torch.manual_seed(0)
    checkpoint = inspect_checkpoint(checkpoint_dir)
    tokenizer, model = load_tokenizer(checkpoint), load_model(checkpoint)
    modifier = QuantizationModifier(
        config_groups={
            "attention": {"targets": [r"re:.*self_attn\..*_proj$"], **PRESET_SCHEMES["NVFP4"]},
            "mlp": {"targets": [r"re:.*mlp\..*_proj$"], **PRESET_SCHEMES["FP8_DYNAMIC"]},
        },
        ignore=["lm_head", "model.layers.1.mlp.down_proj"],
    )
    dataset = calibration_dataset(tokenizer, CALIB, None)
    oneshot(
        model=model,
        tokenizer=tokenizer,
        dataset=dataset,
        recipe=modifier,
        max_seq_length=CALIB.max_seq_length,
        num_calibration_samples=len(dataset),
        shuffle_calibration_samples=False,
    )
    model.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)
    return out


def expected_format(label: str, module: str) -> str:
    if label == "nvfp4_bf16_down" and module.endswith("down_proj"):
        return "bf16"
    if label == "mixed_precision":
        if module == "model.layers.1.mlp.down_proj":
            return "bf16"
        return "nvfp4" if ".self_attn." in module else "fp8"
    return {"nvfp4": "nvfp4", "nvfp4a16": "nvfp4a16", "fp8": "fp8", "nvfp4_bf16_down": "nvfp4", "moe_nvfp4": "nvfp4"}[
        label
    ]


def reference_linears(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name.startswith("model.layers.")
    }


def inputs(linear: torch.nn.Linear, seed: int, tokens: int = 9) -> torch.Tensor:
    """[1, T, H] bf16 activations (as transformers passes them), with a zero block and a -0."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, tokens, linear.in_features, generator=gen) * (torch.rand(1, tokens, 1, generator=gen) * 3)
    x = x.to(torch.bfloat16)
    x[0, 0, :16] = 0
    x[0, 1, 3] = -0.0
    return x


# ---------------------------------------------------------------------------------------------
# Every decoder linear against compressed-tensors' decompressed, fake-quantizing module
# ---------------------------------------------------------------------------------------------

LABELS = ["nvfp4", "nvfp4a16", "fp8", "nvfp4_bf16_down", "moe_nvfp4", "mixed_precision"]


@pytest.mark.parametrize("label", LABELS)
@torch.no_grad()
def test_linears_equal_the_compressed_tensors_modules(artifacts, label: str) -> None:
    path = artifacts(label)
    weights = CheckpointWeights(path)
    reference = reference_linears(load_model(inspect_checkpoint(path)))
    layers = tiny_models.NUM_HIDDEN_LAYERS
    experts = 3 * tiny_models.NUM_EXPERTS if label == "moe_nvfp4" else 3
    assert len(reference) == layers * (4 + experts)
    if label == "moe_nvfp4":
        assert "model.layers.1.mlp.experts.3.gate_proj" in reference  # per-expert Linear modules
    stored_tensors = stored(path)
    for i, (name, module) in enumerate(sorted(reference.items())):
        fmt = expected_format(label, name)
        linear = weights.linear(name)
        assert weights.effective_format(name) == linear.fmt == fmt, name
        assert same_bits(linear.weight, module.weight), name
        assert linear.bias is None and module.bias is None
        scheme = getattr(module, "quantization_scheme", None)
        act = None if scheme is None else scheme.input_activations
        assert (linear.act_quant is None) == (act is None), name
        x = inputs(module, seed=i)
        if act is not None:
            if fmt == "nvfp4":  # the callable was built from the stored scale, the module holds the loaded one
                assert torch.equal(module.input_global_scale, stored_tensors[f"{name}.input_global_scale"])
            assert same_bits(linear.act_quant(x), forward_quantize(module, x, "input", act)), name
            assert same_bits(linear.act_quant(x[0]), forward_quantize(module, x, "input", act)[0]), name
        expected = module(x)
        assert same_bits(linear(x), expected), name
        assert same_bits(linear(x[0]), expected[0]), name  # the engine's [T, H]
        if act is not None:  # the activation quantization is not a no-op
            assert not torch.equal(expected, torch.nn.functional.linear(x, module.weight)), name


def test_plain_checkpoint_gives_the_original_weights(tiny_llama: Path) -> None:
    weights = CheckpointWeights(tiny_llama)
    original = stored(tiny_llama)
    assert weights.names() == sorted(original)
    assert weights.quantization_config is None
    model = load_model(inspect_checkpoint(tiny_llama))
    for name, module in reference_linears(model).items():
        linear = weights.linear(name)
        assert linear.fmt == weights.effective_format(name) == "bf16"
        assert linear.act_quant is None
        assert same_bits(linear.weight, original[f"{name}.weight"])
        assert same_bits(linear.weight, module.weight)
    for name in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight"):
        assert weights.has(name)
        assert same_bits(weights.tensor(name), original[name])
    assert same_bits(weights.linear("lm_head").weight, original["lm_head.weight"])
    assert not weights.has("model.layers.0.self_attn.q_proj.weight_packed")
    with pytest.raises(KeyError):
        weights.linear("model.layers.9.self_attn.q_proj")
    as_f32 = CheckpointWeights(tiny_llama, dtype=torch.float32)
    assert as_f32.tensor("model.norm.weight").dtype == torch.float32
    up = "model.layers.0.mlp.up_proj"
    assert torch.equal(as_f32.linear(up).weight, original[f"{up}.weight"])


def test_plain_tensors_of_an_artifact(artifacts) -> None:
    path = artifacts("moe_nvfp4")
    weights = CheckpointWeights(path)
    original = stored(path)
    model = load_model(inspect_checkpoint(path))
    router = "model.layers.0.mlp.gate"
    assert weights.effective_format(router) == "bf16"  # NEVER_QUANTIZE keeps routers in bf16
    assert same_bits(weights.linear(router).weight, original[f"{router}.weight"])
    assert same_bits(weights.tensor(f"{router}.weight"), model.get_submodule(router).weight)
    assert same_bits(weights.tensor("model.embed_tokens.weight"), model.model.embed_tokens.weight)
    with pytest.raises(ValueError, match="quantized weight"):
        weights.tensor("model.layers.0.self_attn.q_proj.weight_packed")


# ---------------------------------------------------------------------------------------------
# Fusion
# ---------------------------------------------------------------------------------------------


def assert_fuses(weights: CheckpointWeights, prefixes: list[str], in_features: int) -> EngineLinear:
    fused = weights.fused_linear(prefixes)
    parts = [weights.linear(p) for p in prefixes]
    assert fused.fmt == parts[0].fmt
    assert same_bits(fused.weight, torch.cat([p.weight for p in parts]))
    gen = torch.Generator().manual_seed(len(prefixes))
    for shape in [(5, in_features), (1, 3, in_features)]:
        x = (torch.randn(shape, generator=gen) * 2).to(torch.bfloat16)
        assert same_bits(fused(x), torch.cat([p(x) for p in parts], dim=-1)), prefixes
    return fused


def test_fused_qkv_and_gate_up(artifacts) -> None:
    weights = CheckpointWeights(artifacts("nvfp4a16"))
    hidden = tiny_models.HIDDEN_SIZE
    for layer in range(tiny_models.NUM_HIDDEN_LAYERS):
        prefix = f"model.layers.{layer}"
        qkv = assert_fuses(weights, [f"{prefix}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")], hidden)
        head = tiny_models.HEAD_DIM
        assert qkv.out_features == head * (tiny_models.NUM_ATTENTION_HEADS + 2 * tiny_models.NUM_KEY_VALUE_HEADS)
        gate_up = assert_fuses(weights, [f"{prefix}.mlp.gate_proj", f"{prefix}.mlp.up_proj"], hidden)
        assert gate_up.out_features == 2 * tiny_models.INTERMEDIATE_SIZE


def test_fused_plain_linears(tiny_llama: Path) -> None:
    assert_fuses(CheckpointWeights(tiny_llama), [f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj")], 64)
    with pytest.raises(NotFusable, match="fusing is off"):
        CheckpointWeights(tiny_llama, fuse_linears=False).fused_linear(["model.layers.0.self_attn.q_proj"])


@pytest.mark.parametrize("label", ["nvfp4", "fp8", "moe_nvfp4"])
def test_linears_that_quantize_their_inputs_stay_apart(artifacts, label: str) -> None:
    """A fused product rounds as another shape does, and a quantized input amplifies that."""
    weights = CheckpointWeights(artifacts(label))
    prefix = "model.layers.1.mlp.experts.0" if label == "moe_nvfp4" else "model.layers.0.mlp"
    with pytest.raises(NotFusable, match="quantizes activations"):
        weights.fused_linear([f"{prefix}.gate_proj", f"{prefix}.up_proj"])


def test_plain_linears_of_a_model_that_quantizes_activations_stay_apart(artifacts) -> None:
    """BF16 linears feed quantized inputs downstream: fused, they would round otherwise."""
    weights = CheckpointWeights(artifacts("nvfp4_bf16_down"))
    downs = [f"model.layers.{i}.mlp.down_proj" for i in (0, 1)]
    assert {weights.effective_format(p) for p in downs} == {"bf16"}
    with pytest.raises(NotFusable, match="quantizes activations"):
        weights.fused_linear(downs)


def test_not_fusable(artifacts) -> None:
    # Different formats: NVFP4 attention and FP8 MLP; FP8 and BF16 MLPs.
    mixed = CheckpointWeights(artifacts("mixed_precision"))
    with pytest.raises(NotFusable, match="formats differ"):
        mixed.fused_linear(["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.gate_proj"])
    with pytest.raises(NotFusable, match="formats differ"):
        mixed.fused_linear(["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"])
    # W4A16 has no activation quantization: anything of the same in-features fuses exactly.
    q, o = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj"
    assert_fuses(CheckpointWeights(artifacts("nvfp4a16")), [q, o], tiny_models.HIDDEN_SIZE)


# ---------------------------------------------------------------------------------------------
# Formats as the config states them
# ---------------------------------------------------------------------------------------------


def test_mixed_precision_formats(artifacts) -> None:
    path = artifacts("mixed_precision")
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    assert config["format"] == "mixed-precision"
    weights = CheckpointWeights(path)
    for layer in range(tiny_models.NUM_HIDDEN_LAYERS):
        for proj in ATTENTION:
            assert weights.effective_format(f"model.layers.{layer}.self_attn.{proj}") == "nvfp4"
        assert weights.effective_format(f"model.layers.{layer}.mlp.up_proj") == "fp8"
    assert weights.effective_format("model.layers.0.mlp.down_proj") == "fp8"
    assert weights.effective_format("model.layers.1.mlp.down_proj") == "bf16"
    assert weights.effective_format("lm_head") == "bf16"

    partial = CheckpointWeights(artifacts("nvfp4_bf16_down"))
    assert partial.quantization_config["format"] == "nvfp4-pack-quantized"
    assert partial.effective_format("model.layers.1.mlp.down_proj") == "bf16"
    assert partial.effective_format("model.layers.1.mlp.up_proj") == "nvfp4"
