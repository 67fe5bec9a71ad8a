"""`scheme: auto` on tiny models: groups, the knapsack, the measured search, and the stage."""

import itertools
import json
import math
from pathlib import Path

import pytest
import tiny_models
import torch
from artifacts import stored_tensors

from onboard.errors import OnboardError
from onboard.evaluate.replay import LayerReplay
from onboard.models import inspect_checkpoint, load_model, load_tokenizer
from onboard.quantize.auto import Selection, search_windows
from onboard.quantize.bits import effective_bits as stored_effective_bits
from onboard.quantize.bits import layer_bits
from onboard.quantize.calibration import calibration_dataset
from onboard.quantize.compose import Composer
from onboard.quantize.groups import Group, decision_groups, effective_bits, fits
from onboard.quantize.knapsack import additive_selection, capacity_bits, predicted_kl
from onboard.quantize.schemes import LADDERS, SCHEMES
from onboard.quantize.stage import run_quantize
from onboard.recipes import NEVER_QUANTIZE, Calibration, Quantize, Search, recipe_for
from onboard.workspace import RunDir

CALIB = Calibration(num_samples=4, max_seq_length=64)
SETTINGS = Quantize(calibration=CALIB, search=Search(tokens=128, steps=6))


@pytest.fixture(scope="module")
def selection(tiny_llama: Path) -> Selection:
    torch.manual_seed(0)
    checkpoint = inspect_checkpoint(tiny_llama)
    tokenizer = load_tokenizer(checkpoint)
    model = load_model(checkpoint)
    return Selection(model, tokenizer, SETTINGS, calibration_dataset(tokenizer, CALIB, None), [])


def synthetic_groups(count: int) -> list[Group]:
    shapes = [((64, 64),), ((128, 64), (128, 64)), ((64, 128),)]
    return [Group(f"g{i}", "x", i, (f"g{i}",), (f"g{i}",), shapes[i % 3], f"re:^g{i}$") for i in range(count)]


# ---------------------------------------------------------------------------------------------
# groups
# ---------------------------------------------------------------------------------------------


def test_dense_groups_follow_the_fused_kernels(selection: Selection) -> None:
    by_name = {g.name: g for g in selection.groups}
    assert len(by_name) == 4 * 2  # qkv, o, gate_up, down per layer
    qkv = by_name["model.layers.1.self_attn.qkv"]
    assert qkv.kind == "qkv" and qkv.layer == 1
    assert sorted(m.rpartition(".")[2] for m in qkv.modules) == ["k_proj", "q_proj", "v_proj"]
    assert sorted(by_name["model.layers.0.mlp.gate_up"].modules) == [
        "model.layers.0.mlp.gate_proj",
        "model.layers.0.mlp.up_proj",
    ]
    assert by_name["model.layers.0.mlp.down_proj"].modules == ("model.layers.0.mlp.down_proj",)
    # Each pattern matches its own modules and nothing else.
    from onboard.quantize.patterns import matches

    every = [m for g in selection.groups for m in g.modules]
    for group in selection.groups:
        assert [m for m in every if matches(m, [group.pattern])] == list(group.modules)


def test_moe_experts_form_one_group_per_layer(tiny_qwen3_moe: Path) -> None:
    from onboard.quantize.modifiers import quantized_copy

    checkpoint = inspect_checkpoint(tiny_qwen3_moe)
    model = load_model(checkpoint)
    quantized = quantized_copy(model, load_tokenizer(checkpoint), Quantize(scheme="fp8"), "fp8", None)
    groups = {g.name: g for g in decision_groups(quantized)}
    experts = groups["model.layers.0.mlp.experts"]
    assert experts.kind == "experts" and experts.units == ("model.layers.0.mlp.experts",)
    assert len(experts.modules) == 3 * 4  # gate, up, down of 4 experts
    assert not any(g.rpartition(".")[0][-8:] == "mlp.gate" for g in groups)  # the router is never a group


def _mla_groups(checkpoint_dir: Path, settings: Quantize, fmt: str = "fp8") -> tuple[dict[str, Group], torch.nn.Module]:
    from onboard.quantize.modifiers import quantized_copy

    checkpoint = inspect_checkpoint(checkpoint_dir)
    quantized = quantized_copy(load_model(checkpoint), load_tokenizer(checkpoint), settings, fmt, None)
    return {g.name: g for g in decision_groups(quantized)}, quantized


def _modules(group: Group) -> list[str]:
    return sorted(m.rpartition(".")[2] for m in group.modules)


def test_deepseek_v32_groups_follow_vllm_fused_kernels(tiny_deepseek_v32: Path) -> None:
    """Every Linear but the routers quantized (the indexer too, which the default ignore list keeps
    in BF16): the groups vLLM's DeepseekV2MLAAttention, DeepseekV2MLP and fused MoE impose.
    q_a_proj and kv_a_proj_with_mqa are one fused_qkv_a_proj."""
    from onboard.quantize.patterns import matches

    ignore = [p for p in NEVER_QUANTIZE if "indexer" not in p]
    groups, quantized = _mla_groups(tiny_deepseek_v32, Quantize(ignore=ignore), "nvfp4a16")
    layers = range(tiny_models.DEEPSEEK_LAYERS)
    expected = {}
    for layer in layers:
        attn = f"model.layers.{layer}.self_attn"
        expected |= {
            f"{attn}.qkv_a": ("qkv_a", ["kv_a_proj_with_mqa", "q_a_proj"]),
            f"{attn}.q_b_proj": ("q_b_proj", ["q_b_proj"]),
            f"{attn}.kv_b_proj": ("kv_b_proj", ["kv_b_proj"]),
            f"{attn}.o_proj": ("o_proj", ["o_proj"]),
            f"{attn}.indexer": ("indexer", ["weights_proj", "wk", "wq_b"]),
        }
        mlp = f"model.layers.{layer}.mlp"
        if layer == 0:  # first_k_dense_replace = 1
            expected |= {
                f"{mlp}.gate_up": ("gate_up", ["gate_proj", "up_proj"]),
                f"{mlp}.down_proj": ("down_proj", ["down_proj"]),
            }
        else:
            expected |= {
                f"{mlp}.experts": (
                    "experts",
                    sorted(["gate_proj", "up_proj", "down_proj"] * tiny_models.NUM_ROUTED_EXPERTS),
                ),
                f"{mlp}.shared_experts.gate_up": ("gate_up", ["gate_proj", "up_proj"]),
                f"{mlp}.shared_experts.down_proj": ("down_proj", ["down_proj"]),
            }
    assert {name: (g.kind, _modules(g)) for name, g in groups.items()} == expected
    assert all(g.layer == int(g.name.split(".")[2]) for g in groups.values())
    every = [m for g in groups.values() for m in g.modules]
    for group in groups.values():
        assert [m for m in every if matches(m, [group.pattern])] == list(group.modules), group.name
    assert not any(matches(f"model.layers.{i}.mlp.gate", [g.pattern for g in groups.values()]) for i in layers)
    # llmcompressor shares one NVFP4 global scale across a fused group, as vLLM's merged linear needs.
    for layer in layers:
        attn = quantized.get_submodule(f"model.layers.{layer}.self_attn")
        assert torch.equal(attn.q_a_proj.weight_global_scale, attn.kv_a_proj_with_mqa.weight_global_scale)
        if layer:
            shared = quantized.get_submodule(f"model.layers.{layer}.mlp.shared_experts")
            assert torch.equal(shared.gate_proj.weight_global_scale, shared.up_proj.weight_global_scale)


def test_deepseek_v32_recipe_groups(tiny_deepseek_v32: Path) -> None:
    """With the shipped recipe the BF16 modules (routers, indexer, MLA down-projections, kv_b_proj)
    are no groups: `auto` chooses formats for q_b_proj, o_proj, the MLPs and the experts only."""
    recipe, _ = recipe_for(["DeepseekV32ForCausalLM"])
    groups, _ = _mla_groups(tiny_deepseek_v32, recipe.quantize)
    kinds = {(g.layer, g.kind) for g in groups.values()}
    assert kinds == {(0, "q_b_proj"), (0, "o_proj"), (0, "gate_up"), (0, "down_proj")} | {
        (layer, kind)
        for layer in range(1, tiny_models.DEEPSEEK_LAYERS)
        for kind in ("q_b_proj", "o_proj", "experts", "gate_up", "down_proj")
    }
    assert "model.layers.1.mlp.shared_experts.gate_up" in groups


def test_deepseek_v3_without_q_lora_has_no_fused_projection(tiny_deepseek_v3: Path) -> None:
    """Without q_lora_rank vLLM runs q_proj and kv_a_proj_with_mqa as separate linears."""
    groups, _ = _mla_groups(tiny_deepseek_v3, Quantize(ignore=NEVER_QUANTIZE))
    attn = {g.kind: _modules(g) for g in groups.values() if g.layer == 1 and ".self_attn." in g.name + "."}
    assert attn == {
        "q_proj": ["q_proj"],
        "kv_a_proj_with_mqa": ["kv_a_proj_with_mqa"],
        "kv_b_proj": ["kv_b_proj"],
        "o_proj": ["o_proj"],
    }


def test_layer_replay_of_glm_shared_indexer_layers(tiny_glm_moe_dsa: Path) -> None:
    """GLM-5's decoder layers return (hidden, top-k indices) and a "shared" layer reuses the
    previous layer's selection: replaying from any layer, from the reference's or a candidate's
    recorded inputs, must equal the plain forward."""
    from onboard.quantize.modifiers import quantized_copy

    checkpoint = inspect_checkpoint(tiny_glm_moe_dsa)
    tokenizer = load_tokenizer(checkpoint)
    model = load_model(checkpoint)
    replay = LayerReplay(model, search_windows(calibration_dataset(tokenizer, CALIB, None), 128))
    assert isinstance(replay.reference_inputs[1], tuple)  # (hidden, top-k indices of layer 0)
    for start in range(1, len(replay.layers)):
        assert replay.mean_kl(start, replay.reference_inputs[start])[0] < 1e-6
    # A candidate with layer 0 quantized (its indexer too): replaying layer 2 from the candidate's
    # recorded input gives the candidate's own logits.
    source = quantized_copy(model, tokenizer, Quantize(ignore=NEVER_QUANTIZE), "fp8", None)
    composer = Composer(model, {"fp8": source}, decision_groups(source))
    composer.apply({g.name: "fp8" for g in composer.groups if g.layer == 0})
    try:
        full, inputs = replay.mean_kl()
        assert full > 0.01
        assert replay.mean_kl(2, inputs[2])[0] == pytest.approx(full, rel=1e-9)
        assert replay.mean_kl(2, replay.reference_inputs[2])[0] < 1e-6  # layers 2.. are the reference's
    finally:
        composer.reset()


# ---------------------------------------------------------------------------------------------
# the additive knapsack
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_knapsack_fits_and_matches_brute_force(seed: int) -> None:
    groups = synthetic_groups(6)
    ladder = LADDERS["nvfp4"]
    generator = torch.Generator().manual_seed(seed)
    sensitivity = {}
    for g in groups:
        nvfp4 = float(torch.rand(1, generator=generator))
        sensitivity[g.name] = {"nvfp4": nvfp4, "fp8": nvfp4 * float(torch.rand(1, generator=generator)) * 0.2}
    uniform = effective_bits(groups, {g.name: "nvfp4" for g in groups})
    budget = round(uniform + 2.0 * (seed + 1) / 4, 3)
    chosen = additive_selection(groups, sensitivity, ladder, budget)
    assert fits(effective_bits(groups, chosen), budget)
    assert sum(g.bits(chosen[g.name]) for g in groups) <= capacity_bits(groups, budget)
    # Rounding costs up loses at most one capacity unit per group: the knapsack is optimal among
    # the assignments that fit a budget smaller by that much.
    slack = capacity_bits(groups, budget) - sum(g.bits("nvfp4") for g in groups)
    margin = len(groups) * math.ceil(slack / 4000 + 1)
    best = min(
        predicted_kl(sensitivity, dict(zip([g.name for g in groups], combo, strict=True)))
        for combo in itertools.product(ladder, repeat=len(groups))
        if sum(g.bits(f) for g, f in zip(groups, combo, strict=True)) <= capacity_bits(groups, budget) - margin
    )
    assert predicted_kl(sensitivity, chosen) <= best + 1e-12


def test_knapsack_at_base_bits_is_uniform_and_below_is_an_error() -> None:
    groups = synthetic_groups(5)
    sensitivity = {g.name: {"nvfp4": 1.0, "fp8": 0.1} for g in groups}
    uniform = {g.name: "nvfp4" for g in groups}
    base_bits = round(effective_bits(groups, uniform), 3)
    assert additive_selection(groups, sensitivity, LADDERS["nvfp4"], base_bits) == uniform
    with pytest.raises(OnboardError, match="below"):
        additive_selection(groups, sensitivity, LADDERS["nvfp4"], base_bits - 0.01)


# ---------------------------------------------------------------------------------------------
# sensitivity and the measured search
# ---------------------------------------------------------------------------------------------


def test_layer_replay_equals_the_plain_forward(selection: Selection) -> None:
    replay = selection.replay
    with torch.inference_mode():  # the decoder as transformers runs it, the head in float32
        hidden = replay.model.base_model(input_ids=replay.input_ids).last_hidden_state
        plain = hidden.reshape(-1, hidden.shape[-1]).float() @ replay.model.lm_head.weight.float().T
    assert torch.allclose(torch.softmax(plain, -1), replay.reference_logp.exp(), rtol=1e-5, atol=1e-9)
    for start in range(1, len(replay.layers)):
        assert replay.mean_kl(start, replay.reference_inputs[start])[0] < 1e-6


def test_replay_kl_is_the_float64_kl(selection: Selection) -> None:
    replay = selection.replay
    selection.composer.apply(selection.uniform())
    try:
        _, hidden = replay.run()
    finally:
        selection.composer.reset()
    logits = hidden.double() @ replay.model.lm_head.weight.double().T
    reference = replay.reference_logp.double()
    exact = (reference.exp() * (reference - torch.log_softmax(logits, -1))).sum(-1)
    assert torch.allclose(replay.kl(hidden), exact, rtol=1e-3, atol=1e-5)
    assert float(replay.kl(hidden).mean()) == pytest.approx(float(exact.mean()), rel=1e-4)


def test_measured_sensitivity_is_the_end_to_end_kl_of_one_group(selection: Selection) -> None:
    group = selection.groups[0]
    selection.composer.apply({group.name: "nvfp4"})
    try:
        kl, _ = selection.replay.mean_kl()  # the whole model from layer 0, no replay
    finally:
        selection.composer.reset()
    assert kl == pytest.approx(selection.measured[group.name]["nvfp4"], rel=1e-9)
    for per in selection.measured.values():
        assert per["nvfp4"] > per["fp8"] > 0  # 4 bits cost more than 8 on every group
    assert set(selection.fisher) == set(selection.measured)


def test_search_never_returns_worse_than_its_start(selection: Selection) -> None:
    budget = round(effective_bits(selection.groups, selection.uniform()) + 1.0, 3)
    final, record = selection.select(budget, steps=8)
    trace = record["search"]
    assert trace[0]["move"] == "additive start"
    assert record["final"]["measured_kld"] <= record["additive"]["measured_kld"]
    assert [row["best_kld"] for row in trace] == sorted((row["best_kld"] for row in trace), reverse=True)
    assert all(fits(row["effective_bits"], budget) for row in trace)
    assert fits(effective_bits(selection.groups, final), budget)
    # The final assignment measured again from scratch gives the recorded KL.
    selection.composer.apply(final)
    try:
        assert selection.replay.mean_kl()[0] == pytest.approx(record["final"]["measured_kld"], rel=1e-9)
    finally:
        selection.composer.reset()


def test_base_bits_budget_returns_the_uniform_base(selection: Selection) -> None:
    uniform = selection.uniform()
    final, record = selection.select(round(effective_bits(selection.groups, uniform), 3), steps=8)
    assert final == uniform
    assert record["pinned"] == {} and len(record["search"]) == 1


def test_search_windows_are_calibration_windows(tiny_llama: Path) -> None:
    tokenizer = load_tokenizer(inspect_checkpoint(tiny_llama))
    dataset = calibration_dataset(tokenizer, CALIB, None)
    ids = search_windows(dataset, 128)
    assert ids.shape == (2, 64)
    assert ids.tolist() == dataset["input_ids"][:2]


# ---------------------------------------------------------------------------------------------
# the stage
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def auto_run(quantized_run, tiny_llama: Path) -> tuple[Path, dict]:
    settings = Quantize(scheme="auto", bits_budget=5.7, calibration=CALIB, search=Search(tokens=128, steps=4))
    root = quantized_run(tiny_llama, settings)
    return root, json.loads((root / "quantize/selection.json").read_text())


def test_auto_artifact_respects_budget_and_groups(auto_run) -> None:
    root, selection = auto_run
    layers = layer_bits(root / "artifact")
    assert fits(stored_effective_bits(layers), 5.7)
    formats = {name: entry["format"] for name, entry in layers.items()}
    upgraded = {g["name"]: g["format"] for g in selection["groups"] if g["format"] != "nvfp4"}
    assert upgraded, "a 5.7-bit budget upgrades some group of the tiny llama"
    for group in selection["groups"]:
        assert {formats[m] for m in group["modules"]} == {group["format"]}, group["name"]
    assert selection["effective_bits"] == pytest.approx(effective_bits_of(selection), abs=1e-4)


def effective_bits_of(selection: dict) -> float:
    groups = selection["groups"]
    return sum(g["bits"][g["format"]] * g["weights"] for g in groups) / sum(g["weights"] for g in groups)


def test_auto_artifact_is_what_the_search_measured(auto_run) -> None:
    """The artifact, quantized by llmcompressor from the pinned recipe, scores on the search's
    tokens exactly what the search measured for the assignment it chose (RTN)."""
    _, selection = auto_run
    assert selection["artifact_kld"] == pytest.approx(selection["final"]["measured_kld"], rel=1e-9)
    assert selection["final"]["measured_kld"] <= selection["additive"]["measured_kld"]
    assert set(selection["sensitivity"]["rank_correlation"]) == {"nvfp4", "fp8"}


def test_pinned_recipe_reproduces_the_selection(auto_run, tiny_llama: Path, tmp_path: Path) -> None:
    root, selection = auto_run
    pinned = Quantize(scheme="nvfp4", formats=selection["pinned"], calibration=CALIB)
    with RunDir(tmp_path / "pinned") as run:
        run_quantize(run, inspect_checkpoint(tiny_llama), pinned, None)
    assert stored_tensors(tmp_path / "pinned/artifact").keys() == stored_tensors(root / "artifact").keys()
    for name, tensor in stored_tensors(root / "artifact").items():
        assert torch.equal(stored_tensors(tmp_path / "pinned/artifact")[name], tensor), name


def test_auto_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="bits budget"):
        Quantize(scheme="auto")
    with pytest.raises(ValueError, match="only read by scheme auto"):
        Quantize(scheme="nvfp4", bits_budget=5.0)
    with pytest.raises(ValueError, match="pin them"):
        Quantize(scheme="auto", bits_budget=5.0, formats={"fp8": ["re:.*"]})


def test_stored_bits_formula_matches_the_checkpoint(tiny_llama: Path, tmp_path: Path) -> None:
    """Every format's size formula, against the tensors a mixed checkpoint really stores."""
    pins = {
        "fp8_weight": ["re:.*layers\\.0\\.self_attn\\.(q|k|v)_proj$"],
        "fp8": ["re:.*layers\\.1\\.self_attn\\.o_proj$"],
        "nvfp4": ["re:.*layers\\.0\\.mlp\\.(gate|up)_proj$"],
        "bf16": ["re:.*layers\\.1\\.mlp\\.down_proj$"],
    }
    with RunDir(tmp_path) as run:
        run_quantize(
            run, inspect_checkpoint(tiny_llama), Quantize(scheme="nvfp4a16", formats=pins, calibration=CALIB), None
        )
    reference = stored_tensors(tiny_llama)
    seen = set()
    for name, entry in layer_bits(tmp_path / "artifact").items():
        if name.startswith("model.layers."):
            out, inp = reference[f"{name}.weight"].shape
            assert round(SCHEMES[entry["format"]].stored_bits(out, inp) / (out * inp), 4) == entry["bits"], name
            seen.add(entry["format"])
    assert seen == {"nvfp4", "nvfp4a16", "fp8", "bf16"}
    groups = json.loads((tmp_path / "artifact/config.json").read_text())["quantization_config"]["config_groups"]
    weight_only_fp8 = [g for g in groups.values() if g["weights"]["num_bits"] == 8 and not g["input_activations"]]
    assert len(weight_only_fp8) == 1


def test_replay_rejects_a_model_without_layers() -> None:
    class NoLayers(torch.nn.Module):
        def get_decoder(self):
            return self

    with pytest.raises(OnboardError, match="no decoder layer list"):
        LayerReplay(NoLayers(), torch.zeros(1, 4, dtype=torch.long))


def test_pinned_patterns_name_exactly_the_upgraded_modules(selection: Selection) -> None:
    from onboard.quantize.auto import pinned_patterns
    from onboard.quantize.patterns import matches

    formats = ["fp8", "nvfp4", "bf16", "fp8", "nvfp4", "fp8", "nvfp4", "fp8"]
    assignment = {g.name: f for g, f in zip(selection.groups, formats, strict=True)}
    pinned = pinned_patterns(selection.groups, assignment, "nvfp4")
    assert set(pinned) == {"fp8", "bf16"}
    assert len(pinned["fp8"]) < formats.count("fp8")  # same kind across layers: one pattern
    for group in selection.groups:
        for module in group.modules:
            hits = {fmt for fmt, patterns in pinned.items() if matches(module, patterns)}
            assert hits == ({assignment[group.name]} - {"nvfp4"}), module


def test_auto_over_nvfp4a16_picks_weight_only_formats(tmp_path: Path, tiny_llama: Path) -> None:
    settings = Quantize(
        scheme="auto", base="nvfp4a16", bits_budget=6.5, calibration=CALIB, search=Search(tokens=128, steps=3)
    )
    with RunDir(tmp_path) as run:
        run_quantize(run, inspect_checkpoint(tiny_llama), settings, None)
    selection = json.loads((tmp_path / "quantize/selection.json").read_text())
    assert selection["formats"] == ["nvfp4a16", "fp8_weight", "bf16"]
    assert {g["format"] for g in selection["groups"]} - {"nvfp4a16"}, "6.5 bits upgrades some group"
    assert selection["artifact_kld"] == pytest.approx(selection["final"]["measured_kld"], rel=1e-9)
    config = json.loads((tmp_path / "artifact/config.json").read_text())["quantization_config"]
    assert all(not group["input_activations"] for group in config["config_groups"].values())  # weights only


@pytest.mark.slow
def test_auto_on_glm_moe_dsa_with_its_recipe(tmp_path: Path, tiny_glm_moe_dsa: Path) -> None:
    """`scheme: auto` end to end on GLM-5's shared-indexer layers: the artifact llmcompressor
    builds from the pinned selection scores what the search measured, group by group formats."""
    recipe, _ = recipe_for(["GlmMoeDsaForCausalLM"])
    settings = recipe.quantize.model_copy(
        update={"scheme": "auto", "bits_budget": 5.5, "calibration": CALIB, "search": Search(tokens=128, steps=3)}
    )
    with RunDir(tmp_path) as run:
        run_quantize(run, inspect_checkpoint(tiny_glm_moe_dsa), settings, None)
    selection = json.loads((tmp_path / "quantize/selection.json").read_text())
    assert selection["artifact_kld"] == pytest.approx(selection["final"]["measured_kld"], rel=1e-9)
    assert {g["kind"] for g in selection["groups"]} == {"q_b_proj", "o_proj", "gate_up", "down_proj", "experts"}
    formats = {name: entry["format"] for name, entry in layer_bits(tmp_path / "artifact").items()}
    for group in selection["groups"]:
        assert {formats[m] for m in group["modules"]} == {group["format"]}, group["name"]
    assert fits(effective_bits_of(selection), 5.5)  # over the groups: the recipe's BF16 modules are none
