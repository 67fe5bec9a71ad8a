"""`init_from_last_layer`: the draft's decoder layer started from the target's last decoder layer."""

from pathlib import Path

import pytest
import torch

from onboard.engine.config import EngineConfig
from onboard.engine.llm_engine import LLMEngine
from onboard.recipes import Calibration, Quantize
from onboard.speculator.stage import build_draft
from onboard.speculator.warm_start import describe_init, init_from_last_layer, last_layer_weights

VOCAB = torch.arange(0, 512, 4)  # a draft vocabulary of 128 target ids
CONFIG = EngineConfig(block_size=4, num_blocks=256, max_model_len=256)


@pytest.fixture(scope="module")
def nvfp4_artifact(tiny_llama: Path, quantized_run) -> Path:
    return quantized_run(tiny_llama, Quantize(scheme="nvfp4", calibration=Calibration(num_samples=2))) / "artifact"


@pytest.mark.parametrize("which", ["bf16", "nvfp4"])
def test_copied_parts_are_the_targets_last_layer(which: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue("tiny_llama" if which == "bf16" else "nvfp4_artifact")
    engine = LLMEngine(path, CONFIG)
    random = build_draft(engine, VOCAB, [0, 1])
    draft = build_draft(engine, VOCAB, [0, 1], from_last_layer=True)
    layer, before = draft.layers[0], random.layers[0]
    target = engine.decoder_layer(-1)
    attn, mlp = target.self_attn, target.mlp
    q_rows, kv_rows = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
    if attn.qkv_proj is not None:
        q, k, v = attn.qkv_proj.weight.float().split([q_rows, kv_rows, kv_rows])
    else:
        q, k, v = (p.weight.float() for p in attn.qkv_split)
    if mlp.gate_up_proj is not None:
        gate, up = mlp.gate_up_proj.weight.float().chunk(2)
    else:
        gate, up = mlp.gate_proj.weight.float(), mlp.up_proj.weight.float()
    hidden = engine.hf_config.hidden_size
    for mine, random_init, theirs in (
        (layer.self_attn.q_proj.weight, before.self_attn.q_proj.weight, q),
        (layer.self_attn.k_proj.weight, before.self_attn.k_proj.weight, k),
        (layer.self_attn.v_proj.weight, before.self_attn.v_proj.weight, v),
    ):
        assert mine.dtype == torch.float32
        assert torch.equal(mine[:, hidden:], theirs)  # the fused-state half: the target's weights
        assert torch.equal(mine[:, :hidden], random_init[:, :hidden])  # the embedding half: as initialised
    assert torch.equal(layer.self_attn.o_proj.weight, attn.o_proj.weight.float())
    assert torch.equal(layer.mlp.gate_proj.weight, gate)
    assert torch.equal(layer.mlp.up_proj.weight, up)
    assert torch.equal(layer.mlp.down_proj.weight, mlp.down_proj.weight.float())
    assert torch.equal(layer.hidden_norm.weight, target.input_layernorm.weight.float())
    assert torch.equal(layer.post_attention_layernorm.weight, target.post_attention_layernorm.weight.float())
    # What is not copied stays as the random draft has it.
    assert torch.equal(layer.input_layernorm.weight, before.input_layernorm.weight)
    assert torch.equal(draft.fc.weight, random.fc.weight)
    if which == "nvfp4":  # the dequantized weights the engine serves, not the checkpoint's BF16 ones
        assert attn.o_proj.fmt == "nvfp4"


def test_moe_last_layer_keeps_the_random_init(tiny_qwen3_moe: Path) -> None:
    engine = LLMEngine(tiny_qwen3_moe, CONFIG)
    assert "not a gated MLP" in last_layer_weights(engine)
    random = build_draft(engine, VOCAB, [0, 1])
    draft = build_draft(engine, VOCAB, [0, 1])
    reason = init_from_last_layer(draft, engine)
    assert reason is not None and "MLP" in reason
    assert "random init" in describe_init(engine, reason)
    for (name, mine), theirs in zip(draft.state_dict().items(), random.state_dict().values(), strict=True):
        assert torch.equal(mine, theirs), name


def test_qwen3_copy_notes_what_the_draft_cannot_hold(tiny_qwen3: Path) -> None:
    engine = LLMEngine(tiny_qwen3, CONFIG)
    draft = build_draft(engine, VOCAB, [0, 1])
    assert init_from_last_layer(draft, engine) is None
    assert "q/k norms" in describe_init(engine, None)


def test_split_projections_copy_like_fused_ones(tiny_llama: Path) -> None:
    """Checkpoints whose q/k/v (gate/up) cannot be fused (mixed formats) hold them separately."""
    from onboard.engine.linear import EngineLinear

    engine = LLMEngine(tiny_llama, CONFIG)
    fused = last_layer_weights(engine)
    assert isinstance(fused, dict)
    attn, mlp = engine.decoder_layer(-1).self_attn, engine.decoder_layer(-1).mlp
    attn.qkv_split = torch.nn.ModuleList(EngineLinear(fused[n].clone()) for n in ("q_proj", "k_proj", "v_proj"))
    attn.qkv_proj = None
    mlp.gate_proj, mlp.up_proj = EngineLinear(fused["gate_proj"].clone()), EngineLinear(fused["up_proj"].clone())
    mlp.gate_up_proj = None
    split = last_layer_weights(engine)
    assert isinstance(split, dict) and split.keys() == fused.keys()
    for name, tensor in fused.items():
        assert torch.equal(split[name], tensor), name
