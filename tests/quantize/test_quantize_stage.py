"""The quantize stage end to end on the tiny checkpoints: what the artifact holds, and that it
loads back as the model llmcompressor quantized in memory."""

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import tiny_models
import torch
from artifacts import stage_entry
from artifacts import stored_tensors as tensors
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from onboard.evaluate.kl import KLStats
from onboard.models import inspect_checkpoint, load_model, load_tokenizer
from onboard.quantize.calibration import calibration_dataset
from onboard.quantize.patterns import matches
from onboard.recipes import Calibration, Quantize, recipe_for

CALIB = Calibration(num_samples=2, max_seq_length=64)
LINEARS_PER_DENSE_LAYER = 7  # q, k, v, o, gate, up, down
TEXT = (
    "The weather today is cloudy with a chance of rain. def fibonacci(n): return n if n < 2 "
    "else fibonacci(n - 1) + fibonacci(n - 2). The capital of France is Paris."
)

# FP4 E2M1 code points (OCP microscaling spec): sign bit, 2 exponent bits, 1 mantissa bit.
E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def decoder_linears(reference: dict[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
    """Every 2-D decoder weight of the reference, as module name -> (out, in)."""
    return {
        name.removesuffix(".weight"): tuple(t.shape)
        for name, t in reference.items()
        if name.startswith("model.layers.") and name.endswith(".weight") and t.dim() == 2
    }


def dequant_nvfp4(stored: dict[str, torch.Tensor], module: str) -> torch.Tensor:
    """FP4 values (two per byte, low nibble first) x FP8 block scale / FP32 global scale."""
    packed = stored[f"{module}.weight_packed"]
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
    scale = stored[f"{module}.weight_scale"].float() / stored[f"{module}.weight_global_scale"].float()
    return E2M1[codes.long()] * scale.repeat_interleave(16, dim=1)


def kl_to_uniform(logits: torch.Tensor) -> float:
    logp = torch.log_softmax(logits.float(), -1)
    return float((logp.exp() * (logp + math.log(logits.shape[-1]))).sum(-1).mean())


def text_ids(checkpoint_dir: Path) -> torch.Tensor:
    return torch.tensor([load_tokenizer(inspect_checkpoint(checkpoint_dir))(TEXT)["input_ids"]])


@torch.no_grad()
def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).logits[0].float()


@pytest.fixture(scope="module")
def quantized(quantized_run) -> Callable[..., tuple[Path, dict[str, Any]]]:
    """The quantize stage's run directory (shared, read-only) and its manifest entry."""

    def run(checkpoint_dir: Path, settings: Quantize) -> tuple[Path, dict[str, Any]]:
        root = quantized_run(checkpoint_dir, settings)
        return root, stage_entry(root, "quantize")

    return run


@pytest.fixture(scope="module")
def llama_nvfp4(quantized, tiny_llama: Path):
    return quantized(tiny_llama, Quantize(scheme="nvfp4", calibration=CALIB))


@pytest.fixture(scope="module")
def llama_reference(tiny_llama: Path) -> dict[str, torch.Tensor]:
    return tensors(tiny_llama)


# ---------------------------------------------------------------------------------------------
# NVFP4 on the dense llama
# ---------------------------------------------------------------------------------------------


def test_nvfp4_config(llama_nvfp4) -> None:
    root, _ = llama_nvfp4
    config = json.loads((root / "artifact/config.json").read_text())
    qconfig = config["quantization_config"]
    assert qconfig["quant_method"] == "compressed-tensors"
    assert qconfig["format"] == "nvfp4-pack-quantized"
    assert {g["format"] for g in qconfig["config_groups"].values()} == {"nvfp4-pack-quantized"}
    assert "lm_head" in qconfig["ignore"]
    assert config["architectures"] == ["LlamaForCausalLM"]


def test_nvfp4_tensors(llama_nvfp4, llama_reference) -> None:
    root, _ = llama_nvfp4
    stored = tensors(root / "artifact")
    linears = decoder_linears(llama_reference)
    assert len(linears) == LINEARS_PER_DENSE_LAYER * tiny_models.NUM_HIDDEN_LAYERS
    for module, (out, inp) in linears.items():
        assert f"{module}.weight" not in stored, module
        assert stored[f"{module}.weight_packed"].dtype == torch.uint8
        assert stored[f"{module}.weight_packed"].shape == (out, inp // 2)
        assert stored[f"{module}.weight_scale"].dtype == torch.float8_e4m3fn
        assert stored[f"{module}.weight_scale"].shape == (out, inp // 16)
        for scale in ("weight_global_scale", "input_global_scale"):
            assert stored[f"{module}.{scale}"].dtype == torch.float32
            assert stored[f"{module}.{scale}"].numel() == 1
            assert torch.isfinite(stored[f"{module}.{scale}"]).all()
            assert stored[f"{module}.{scale}"].item() > 0
    # The head, embeddings and norms are untouched, bit for bit.
    for name in ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"):
        assert stored[name].dtype == torch.bfloat16
        assert torch.equal(stored[name], llama_reference[name]), name


def test_nvfp4_weights_dequantize_to_the_originals(llama_nvfp4, llama_reference) -> None:
    """Decoded by hand from the spec, each matrix is the original within FP4 rounding."""
    root, _ = llama_nvfp4
    stored = tensors(root / "artifact")
    for module in decoder_linears(llama_reference):
        original = llama_reference[f"{module}.weight"].float()
        decoded = dequant_nvfp4(stored, module)
        assert decoded.shape == original.shape
        error = (decoded - original).abs()
        # Each block of 16 has scale ~ amax/6; FP4's widest step (4 -> 6) is 2 scales, so
        # round-to-nearest is off by at most ~amax/6 (plus FP8 rounding of the scale).
        block_amax = original.abs().reshape(original.shape[0], -1, 16).amax(-1, keepdim=True)
        assert (error.reshape(block_amax.shape[0], -1, 16) <= block_amax / 6 * 1.15 + 1e-6).all(), module
        assert error.max() > 0  # it was quantized


def test_nvfp4_artifact_is_servable(llama_nvfp4, tiny_llama: Path) -> None:
    root, _ = llama_nvfp4
    artifact = root / "artifact"
    for name in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (artifact / name).is_file(), name
    tokenizer = AutoTokenizer.from_pretrained(artifact)
    original = AutoTokenizer.from_pretrained(tiny_llama)
    assert tokenizer.chat_template == tiny_models.CHAT_TEMPLATE
    assert tokenizer(TEXT)["input_ids"] == original(TEXT)["input_ids"]
    assert (tokenizer.eos_token, tokenizer.pad_token) == (
        tiny_models.EOS_TOKEN,
        tiny_models.PAD_TOKEN,
    )
    messages = [{"role": "user", "content": "2 + 2 = ?"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\n2 + 2 = ?<|im_end|>\n<|im_start|>assistant\n"
    )
    generation = GenerationConfig.from_pretrained(artifact)
    assert generation.eos_token_id == tiny_models.EOS_TOKEN_ID
    assert generation.bos_token_id == tiny_models.BOS_TOKEN_ID
    assert generation.pad_token_id == tiny_models.PAD_TOKEN_ID


def test_nvfp4_selection_and_metrics(llama_nvfp4, llama_reference, tiny_llama: Path) -> None:
    root, entry = llama_nvfp4
    selection = json.loads((root / "quantize/selection.json").read_text())
    assert selection["scheme"] == "nvfp4"
    assert 4.5 < selection["effective_bits"] < 4.6
    linears = decoder_linears(llama_reference)
    for module, (out, inp) in linears.items():
        layer = selection["layers"][module]
        assert layer["format"] == "nvfp4"
        assert layer["quantizable"] is True
        assert layer["weights"] == out * inp
        assert layer["bits"] == pytest.approx(4 + 8 / 16 + 32 / (out * inp), abs=1e-4)
    expected = sum(4.5 * o * i + 32 for o, i in linears.values()) / sum(o * i for o, i in linears.values())
    assert selection["effective_bits"] == pytest.approx(expected, abs=1e-4)
    assert selection["layers"]["lm_head"] == {
        "format": "bf16",
        "bits": 16.0,
        "weights": tiny_models.VOCAB_SIZE * tiny_models.HIDDEN_SIZE,
        "quantizable": False,
    }
    assert selection["effective_bits_all_weights"] > selection["effective_bits"]

    metrics = entry["metrics"]
    assert metrics["effective_bits"] == selection["effective_bits"]
    assert metrics["calibration_tokens"] == CALIB.num_samples * CALIB.max_seq_length
    assert metrics["quantized_layers"] == len(linears)
    assert metrics["bytes_reference"] == (tiny_llama / "model.safetensors").stat().st_size
    assert metrics["bytes_artifact"] < metrics["bytes_reference"]


def _oneshot_in_memory(checkpoint_dir: Path, settings: Quantize):
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    checkpoint = inspect_checkpoint(checkpoint_dir)
    tokenizer = load_tokenizer(checkpoint)
    in_memory = load_model(checkpoint)
    dataset = calibration_dataset(tokenizer, settings.calibration, None)
    oneshot(
        model=in_memory,
        tokenizer=tokenizer,
        dataset=dataset,
        recipe=QuantizationModifier(targets=["Linear"], scheme="NVFP4", ignore=settings.ignore),
        max_seq_length=settings.calibration.max_seq_length,
        num_calibration_samples=len(dataset),
        shuffle_calibration_samples=False,
    )
    return in_memory


def test_nvfp4_round_trip_matches_the_in_memory_model(llama_nvfp4, tiny_llama: Path) -> None:
    root, _ = llama_nvfp4
    in_memory = _oneshot_in_memory(tiny_llama, Quantize(scheme="nvfp4", calibration=CALIB))
    reloaded = AutoModelForCausalLM.from_pretrained(root / "artifact", dtype=torch.bfloat16).eval()
    original = load_model(inspect_checkpoint(tiny_llama))

    ids = text_ids(tiny_llama)
    expected = logits_of(in_memory, ids)
    got = logits_of(reloaded, ids)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-2)
    assert (got - logits_of(original, ids)).abs().max() > 0.1


def test_moe_round_trip_matches_the_in_memory_model(moe_nvfp4, tiny_qwen3_moe: Path) -> None:
    """Through onboard's loader: transformers alone drops the experts' global scales."""
    (root, _), settings = moe_nvfp4
    in_memory = _oneshot_in_memory(tiny_qwen3_moe, settings)
    reloaded = load_model(inspect_checkpoint(root / "artifact"))
    original = load_model(inspect_checkpoint(tiny_qwen3_moe))

    ids = text_ids(tiny_qwen3_moe)
    got = logits_of(reloaded, ids)
    torch.testing.assert_close(got, logits_of(in_memory, ids), rtol=0, atol=1e-2)
    assert (got - logits_of(original, ids)).abs().max() > 0.1


# ---------------------------------------------------------------------------------------------
# NVFP4A16 and FP8
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_weight_only(quantized, tiny_llama: Path):
    def run(scheme: str):
        return quantized(tiny_llama, Quantize(scheme=scheme, calibration=CALIB))

    return run


def mean_kl(reference_dir: Path, artifact: Path) -> tuple[float, float]:
    """(mean KL(reference || artifact), mean KL(reference || uniform)) on TEXT."""
    ids = text_ids(reference_dir)
    ref = logits_of(load_model(inspect_checkpoint(reference_dir)), ids)
    quant = logits_of(load_model(inspect_checkpoint(artifact)), ids)
    stats = KLStats()
    stats.update(ref[:-1], quant[:-1], ids[0, 1:])
    return stats.summary()["mean_kld"], kl_to_uniform(ref)


@pytest.mark.parametrize("scheme", ["nvfp4a16", "fp8"])
def test_weight_schemes(llama_weight_only, llama_reference, scheme: str) -> None:
    root, entry = llama_weight_only(scheme)
    selection = json.loads((root / "quantize/selection.json").read_text())
    stored = tensors(root / "artifact")
    linears = decoder_linears(llama_reference)
    for module, (out, inp) in linears.items():
        layer = selection["layers"][module]
        assert layer["format"] == scheme, module
        if scheme == "nvfp4a16":
            assert f"{module}.input_global_scale" not in stored  # weights only
            assert layer["bits"] == pytest.approx(4.5 + 32 / (out * inp), abs=1e-4)
        else:
            weight, scale = stored[f"{module}.weight"], stored[f"{module}.weight_scale"]
            assert weight.dtype == torch.float8_e4m3fn and weight.shape == (out, inp)
            assert scale.shape == (out, 1)  # per output channel
            scale_bits = scale.dtype.itemsize * 8
            assert layer["bits"] == pytest.approx(8 + scale_bits / inp, abs=1e-4)
            # E4M3 keeps 3 mantissa bits: relative rounding error at most 2^-4.
            original = llama_reference[f"{module}.weight"].float()
            decoded = weight.float() * scale.float()
            assert ((decoded - original).abs() <= original.abs() * 2**-4 + 1e-6).all(), module
    assert selection["layers"]["lm_head"]["format"] == "bf16"
    bits = selection["effective_bits"]
    assert (4.5 < bits < 4.6) if scheme == "nvfp4a16" else (8 < bits <= 8.5)
    assert entry["metrics"]["calibration_tokens"] == 0  # no static activation scales to fit
    assert entry["metrics"]["quantized_layers"] == len(linears)


def test_weight_scheme_kl(llama_weight_only, tiny_llama: Path) -> None:
    kl_nvfp4a16, uniform = mean_kl(tiny_llama, llama_weight_only("nvfp4a16")[0] / "artifact")
    kl_fp8, _ = mean_kl(tiny_llama, llama_weight_only("fp8")[0] / "artifact")
    assert uniform > 1  # the tiny model is far from uniform, so the bound below means something
    assert 0 < kl_fp8 < 0.1 * uniform
    assert 0 < kl_nvfp4a16 < 0.5 * uniform
    assert kl_fp8 < kl_nvfp4a16  # 8-bit weights lose less than 4-bit ones


# ---------------------------------------------------------------------------------------------
# Qwen3-MoE with its recipe, and Qwen3 with tied embeddings
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moe_nvfp4(quantized, tiny_qwen3_moe: Path):
    recipe, path = recipe_for(["Qwen3MoeForCausalLM"])
    assert path is not None and path.name == "qwen3_moe.yaml"
    settings = Quantize.model_validate({**recipe.quantize.model_dump(), "calibration": CALIB.model_dump()})
    return quantized(tiny_qwen3_moe, settings), settings


def expert_modules(layer: int) -> list[str]:
    return [
        f"model.layers.{layer}.mlp.experts.{e}.{proj}"
        for e in range(tiny_models.NUM_EXPERTS)
        for proj in ("gate_proj", "up_proj", "down_proj")
    ]


def test_moe_routers_stay_bf16_and_experts_are_quantized(moe_nvfp4, tiny_qwen3_moe: Path) -> None:
    (root, entry), settings = moe_nvfp4
    reference = tensors(tiny_qwen3_moe)
    stored = tensors(root / "artifact")
    selection = json.loads((root / "quantize/selection.json").read_text())
    for layer in range(tiny_models.NUM_HIDDEN_LAYERS):
        router = f"model.layers.{layer}.mlp.gate"
        assert matches(router, settings.ignore)
        assert stored[f"{router}.weight"].dtype == torch.bfloat16
        assert torch.equal(stored[f"{router}.weight"], reference[f"{router}.weight"])
        assert f"{router}.weight_packed" not in stored
        assert selection["layers"][router]["format"] == "bf16"
        assert selection["layers"][router]["quantizable"] is False
        for module in expert_modules(layer):
            assert f"{module}.weight" not in stored, module
            out, inp = reference[f"{module}.weight"].shape
            assert stored[f"{module}.weight_packed"].shape == (out, inp // 2)
            assert stored[f"{module}.weight_scale"].shape == (out, inp // 16)
            assert selection["layers"][module]["format"] == "nvfp4"
            decoded = dequant_nvfp4(stored, module)
            original = reference[f"{module}.weight"].float()
            assert (decoded - original).abs().max() <= original.abs().max() / 4, module
    assert 4.5 < selection["effective_bits"] < 4.6
    experts = tiny_models.NUM_HIDDEN_LAYERS * (4 + 3 * tiny_models.NUM_EXPERTS)
    assert entry["metrics"]["quantized_layers"] == experts


def test_moe_artifact_reloads_and_runs(moe_nvfp4, tiny_qwen3_moe: Path) -> None:
    (root, _), _ = moe_nvfp4
    model = load_model(inspect_checkpoint(root / "artifact"))
    ids = text_ids(tiny_qwen3_moe)
    logits = logits_of(model, ids)
    assert logits.shape == (ids.shape[1], tiny_models.VOCAB_SIZE)
    assert torch.isfinite(logits).all()


def test_moe_reloaded_experts_are_the_stored_ones(moe_nvfp4) -> None:
    """transformers 5.17 alone fuses experts and drops their global scales; load_model must not."""
    (root, _), _ = moe_nvfp4
    stored = tensors(root / "artifact")
    model = load_model(inspect_checkpoint(root / "artifact"))
    modules = dict(model.named_modules())
    for layer in range(len(model.model.layers)):
        for name in expert_modules(layer):
            module = modules[name]
            assert module.quantization_scheme.input_activations is not None  # W4A4 kept
            torch.testing.assert_close(module.weight.float(), dequant_nvfp4(stored, name), rtol=2**-7, atol=1e-6)


def test_qwen3_tied_embeddings(quantized, tiny_qwen3: Path) -> None:
    root, entry = quantized(tiny_qwen3, Quantize(scheme="nvfp4", calibration=CALIB))
    reference = tensors(tiny_qwen3)
    stored = tensors(root / "artifact")
    config = json.loads((root / "artifact/config.json").read_text())
    assert config["tie_word_embeddings"] is True
    assert "lm_head.weight" not in stored  # the head is the embedding, stored once
    assert torch.equal(stored["model.embed_tokens.weight"], reference["model.embed_tokens.weight"])
    linears = decoder_linears(reference)
    assert entry["metrics"]["quantized_layers"] == len(linears) == 7 * tiny_models.NUM_HIDDEN_LAYERS
    for module in linears:
        assert stored[f"{module}.weight_packed"].dtype == torch.uint8, module

    model = load_model(inspect_checkpoint(root / "artifact"))
    head = model.get_output_embeddings().weight
    assert head.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert torch.equal(head, reference["model.embed_tokens.weight"])
    ids = text_ids(tiny_qwen3)
    logits = logits_of(model, ids)
    original = logits_of(load_model(inspect_checkpoint(tiny_qwen3)), ids)
    assert torch.isfinite(logits).all()
    assert (logits - original).abs().max() > 0.1
    stats = KLStats()
    stats.update(original, logits, ids[0])
    assert stats.summary()["mean_kld"] < kl_to_uniform(original)
