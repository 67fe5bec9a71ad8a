import torch

from onboard.models.conversion import convert_names, keep_in_fp32, renamed


def test_glm5_next_stored_names_become_transformers_module_names() -> None:
    assert renamed("model.layers.0.self_attn.f_a_proj.weight", "glm5_next") == (
        "model.layers.0.self_attn.forget_gate.f_a_proj.weight"
    )
    assert renamed("model.layers.0.mlp.down_proj.weight", "glm5_next") == "model.layers.0.mlp.down_proj.weight"


def test_convert_names_concatenates_each_layers_convs_in_order() -> None:
    stored = {
        f"layers.{i}.self_attn.{c}_conv1d.weight": torch.full((2, 1, 4), float(n))
        for i in range(2)
        for n, c in enumerate("qkv")
    }
    out = convert_names(stored, "glm5_next")
    assert sorted(out) == ["layers.0.self_attn.conv1d.weight", "layers.1.self_attn.conv1d.weight"]
    assert out["layers.1.self_attn.conv1d.weight"][:, 0, 0].tolist() == [0, 0, 1, 1, 2, 2]


def test_keep_in_fp32_turns_only_the_named_parameters_and_buffers_float32() -> None:
    module = torch.nn.Module()
    module.A_log = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    module.weight = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    module.register_buffer("e_score_correction_bias", torch.zeros(3, dtype=torch.bfloat16))
    keep_in_fp32(module, {"A_log", "e_score_correction_bias"})
    assert module.A_log.dtype == torch.float32 and module.e_score_correction_bias.dtype == torch.float32
    assert module.weight.dtype == torch.bfloat16
