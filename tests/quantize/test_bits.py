"""Bits per weight counted from hand-written safetensors checkpoints, checked by hand."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from onboard.quantize.bits import effective_bits, is_quantizable, layer_bits

VOCAB, HIDDEN = 96, 32


def nvfp4(prefix: str, out: int, inp: int, activations: bool = True) -> dict[str, torch.Tensor]:
    """The tensors compressed-tensors writes for an nvfp4-pack-quantized Linear."""
    tensors = {
        f"{prefix}.weight_packed": torch.zeros(out, inp // 2, dtype=torch.uint8),
        f"{prefix}.weight_scale": torch.ones(out, inp // 16).to(torch.float8_e4m3fn),
        f"{prefix}.weight_global_scale": torch.ones(1, dtype=torch.float32),
    }
    if activations:
        tensors[f"{prefix}.input_global_scale"] = torch.ones(1, dtype=torch.float32)
    return tensors


def fp8(prefix: str, out: int, inp: int, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {
        f"{prefix}.weight": torch.zeros(out, inp).to(torch.float8_e4m3fn),
        f"{prefix}.weight_scale": torch.ones(out, 1, dtype=scale_dtype),
    }


def nvfp4_bits(out: int, inp: int) -> float:
    """4-bit values, one 8-bit scale per 16 of them, one 32-bit global scale per matrix."""
    return 4 + 8 / 16 + 32 / (out * inp)


def fp8_bits(out: int, inp: int, scale_bits: int) -> float:
    """8-bit values and one scale per output channel."""
    return 8 + scale_bits * out / (out * inp)


# (module, format, out, in, bits): what the checkpoint below holds, layer by layer.
LAYERS = [
    ("model.layers.0.self_attn.q_proj", "nvfp4", 32, 32, nvfp4_bits(32, 32)),
    ("model.layers.0.self_attn.k_proj", "nvfp4", 16, 32, nvfp4_bits(16, 32)),
    ("model.layers.0.mlp.up_proj", "nvfp4a16", 64, 32, nvfp4_bits(64, 32)),
    ("model.layers.0.mlp.down_proj", "fp8", 32, 64, fp8_bits(32, 64, 16)),
    ("model.layers.1.mlp.down_proj", "fp8", 32, 64, fp8_bits(32, 64, 32)),
    ("model.layers.1.mlp.gate", "bf16", 4, 32, 16.0),
    ("model.embed_tokens", "bf16", VOCAB, HIDDEN, 16.0),
    ("lm_head", "bf16", VOCAB, HIDDEN, 16.0),
]
QUANTIZABLE = [layer for layer in LAYERS if layer[0].startswith("model.layers.") and "gate" not in layer[0]]


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    first = {
        **nvfp4("model.layers.0.self_attn.q_proj", 32, 32),
        **nvfp4("model.layers.0.self_attn.k_proj", 16, 32),
        # A bias is not a weight: it must not move the bits per weight.
        "model.layers.0.self_attn.k_proj.bias": torch.zeros(16, dtype=torch.bfloat16),
        **nvfp4("model.layers.0.mlp.up_proj", 64, 32, activations=False),
        **fp8("model.layers.0.mlp.down_proj", 32, 64, torch.bfloat16),
        "model.layers.0.input_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
        "model.embed_tokens.weight": torch.zeros(VOCAB, HIDDEN, dtype=torch.bfloat16),
    }
    second = {
        **fp8("model.layers.1.mlp.down_proj", 32, 64, torch.float32),
        "model.layers.1.mlp.gate.weight": torch.zeros(4, 32, dtype=torch.bfloat16),
        "model.layers.1.self_attn.q_norm.weight": torch.ones(16, dtype=torch.bfloat16),
        "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
        "lm_head.weight": torch.zeros(VOCAB, HIDDEN, dtype=torch.bfloat16),
    }
    # Sharded like a large checkpoint: layer_bits reads every *.safetensors file.
    save_file(first, str(tmp_path / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    save_file(second, str(tmp_path / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def test_layer_bits_per_module(checkpoint: Path) -> None:
    layers = layer_bits(checkpoint)
    # Norms (1-D weights) are not layers; everything 2-D is, once, under its module name.
    assert set(layers) == {name for name, *_ in LAYERS}
    for name, fmt, out, inp, bits in LAYERS:
        assert layers[name]["format"] == fmt, name
        assert layers[name]["weights"] == out * inp, name
        assert layers[name]["bits"] == pytest.approx(bits, abs=1e-4), name


def test_quantizable_excludes_embeddings_head_and_routers() -> None:
    assert not is_quantizable("lm_head")
    assert not is_quantizable("model.embed_tokens")
    assert not is_quantizable("model.layers.3.mlp.gate")
    assert not is_quantizable("model.layers.3.mlp.shared_expert_gate")
    assert not is_quantizable("model.vision_tower.layers.0.mlp.fc1")
    for indexer in ("wq_b", "wk", "weights_proj"):  # DSA (DeepSeek-V3.2, GLM-5): discrete top-k
        assert not is_quantizable(f"model.layers.2.self_attn.indexer.{indexer}")
    for name in (
        "model.layers.0.self_attn.q_proj",
        "model.layers.3.mlp.gate_proj",
        "model.layers.0.mlp.experts.1.up_proj",
        "model.layers.1.self_attn.kv_a_proj_with_mqa",
        "model.layers.1.mlp.shared_experts.down_proj",
    ):
        assert is_quantizable(name), name


def test_effective_bits_is_a_weighted_average(checkpoint: Path) -> None:
    layers = layer_bits(checkpoint)

    def average(selected: list) -> float:
        return sum(bits * out * inp for _, _, out, inp, bits in selected) / sum(
            out * inp for _, _, out, inp, _ in selected
        )

    assert effective_bits(layers) == pytest.approx(average(QUANTIZABLE), abs=2e-4)
    assert effective_bits(layers, only_quantizable=False) == pytest.approx(average(LAYERS), abs=2e-4)
    # The large bf16 embedding and head pull the all-weights average well above.
    assert effective_bits(layers, only_quantizable=False) > effective_bits(layers) + 2


def test_unquantized_checkpoint_is_16_bits(tmp_path: Path) -> None:
    save_file(
        {
            "model.layers.0.mlp.up_proj.weight": torch.zeros(64, 32, dtype=torch.bfloat16),
            "model.layers.0.mlp.down_proj.weight": torch.zeros(32, 64, dtype=torch.bfloat16),
            "model.layers.0.post_attention_layernorm.weight": torch.ones(32, dtype=torch.bfloat16),
            "model.layers.0.mlp.experts.weight": torch.zeros(4, 32, 32, dtype=torch.float32),
        },
        str(tmp_path / "model.safetensors"),
    )
    layers = layer_bits(tmp_path)
    assert set(layers) == {
        "model.layers.0.mlp.up_proj",
        "model.layers.0.mlp.down_proj",
        "model.layers.0.mlp.experts",
    }
    assert layers["model.layers.0.mlp.up_proj"] == {
        "format": "bf16",
        "bits": 16.0,
        "weights": 64 * 32,
    }
    assert layers["model.layers.0.mlp.experts"] == {
        "format": "f32",
        "bits": 32.0,
        "weights": 4 * 32 * 32,
    }
    expected = (16 * 2 * 64 * 32 + 32 * 4 * 32 * 32) / (2 * 64 * 32 + 4 * 32 * 32)
    assert effective_bits(layers) == pytest.approx(expected, abs=1e-4)


def test_empty_selection(tmp_path: Path) -> None:
    assert layer_bits(tmp_path) == {}
    assert effective_bits({}) == 0.0
    only_head = {"lm_head": {"format": "bf16", "bits": 16.0, "weights": 10}}
    assert effective_bits(only_head) == 0.0
    assert effective_bits(only_head, only_quantizable=False) == 16.0
