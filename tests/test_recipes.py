"""The recipe schema and the shipped recipes: they load, say how to use them, and fail loudly."""

import re
from pathlib import Path

import pytest
import transformers
import yaml

from onboard.errors import OnboardError
from onboard.paths import RECIPES_DIR
from onboard.quantize.patterns import matches
from onboard.recipes import Calibration, Eval, Recipe, SpeculatorSettings, load_recipe, recipe_for, shipped_recipes

SHIPPED = shipped_recipes()


def write_recipe(tmp_path: Path, data: object, name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def test_recipes_are_shipped() -> None:
    assert SHIPPED, f"no recipes in {RECIPES_DIR}"
    assert all(path.suffix == ".yaml" and path.parent == RECIPES_DIR for path in SHIPPED)
    assert {path.name for path in SHIPPED} >= {
        "llama.yaml",
        "qwen3.yaml",
        "qwen3_moe.yaml",
        "deepseek_v3.yaml",
        "deepseek_v32.yaml",
        "glm_moe_dsa.yaml",
    }


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_recipe_loads_and_documents_its_use(path: Path) -> None:
    recipe = load_recipe(path)
    assert isinstance(recipe, Recipe)
    first = path.read_text().splitlines()[0]
    assert first.startswith("#"), f"{path.name} must open with a usage comment"
    assert "onboard " in first
    assert f"--recipe recipes/{path.name}" in first


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_recipe_states_its_method_and_why(path: Path) -> None:
    assert "method" in yaml.safe_load(path.read_text())["quantize"], f"{path.name} must state quantize.method"
    lines = path.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith("method:"))
    assert lines[at - 1].strip().startswith("#"), f"{path.name}: say above quantize.method why it is chosen"


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_recipe_architectures_are_transformers_classes(path: Path) -> None:
    recipe = load_recipe(path)
    patterns = [p for names in recipe.quantize.formats.values() for p in names]
    if any(re.search(r"layers\\?\.\(?\d", p) for p in patterns):
        # a selection pinned layer by layer belongs to one checkpoint: --recipe only (a format per
        # kind of module, any layer, is the family's)
        assert not recipe.architectures, f"{path.name} pins formats by layer, so recipe_for must never pick it"
        return
    assert recipe.architectures, f"{path.name} names no architecture, recipe_for can never pick it"
    for arch in recipe.architectures:
        assert hasattr(transformers, arch), f"{path.name}: transformers has no class {arch}"


def test_shipped_recipes_claim_disjoint_architectures() -> None:
    """recipe_for takes the first match, so two recipes claiming one class would shadow."""
    seen: dict[str, str] = {}
    for path in SHIPPED:
        for arch in load_recipe(path).architectures:
            assert arch not in seen, f"{arch} is in both {seen[arch]} and {path.name}"
            seen[arch] = path.name


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_recipe_for_picks_each_shipped_recipe(path: Path) -> None:
    recipe = load_recipe(path)
    for arch in recipe.architectures:
        picked, picked_path = recipe_for([arch])
        assert picked_path == path
        assert picked == recipe


def test_pinned_smollm2_recipe_keeps_fused_groups_whole() -> None:
    """Every pattern pins q/k/v or gate/up together, never one of them: vLLM fuses them."""
    recipe = load_recipe(RECIPES_DIR / "smollm2-mixed.yaml")
    pinned = [p for patterns in recipe.quantize.formats.values() for p in patterns]
    assert pinned
    for layer in range(30):
        for fused in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            parent = "self_attn" if fused[0] == "q_proj" else "mlp"
            hits = {matches(f"model.layers.{layer}.{parent}.{name}", pinned) for name in fused}
            assert len(hits) == 1, (layer, fused)


def test_recipe_for_unknown_architecture_gives_defaults() -> None:
    recipe, path = recipe_for(["NoSuchModelForCausalLM"])
    assert path is None
    assert recipe == Recipe()
    assert recipe_for([]) == (Recipe(), None)


def test_qwen3_moe_recipe_keeps_routers_in_high_precision() -> None:
    recipe, path = recipe_for(["Qwen3MoeForCausalLM"])
    assert path is not None and path.name == "qwen3_moe.yaml"
    assert recipe.quantize.scheme == "nvfp4"
    ignore = recipe.quantize.ignore
    assert matches("lm_head", ignore)
    for router in ("model.layers.0.mlp.gate", "model.layers.47.mlp.gate"):
        assert matches(router, ignore), router
    for quantized in (
        "model.layers.0.mlp.experts.0.gate_proj",
        "model.layers.0.mlp.experts.17.up_proj",
        "model.layers.0.mlp.gate_proj",
        "model.layers.0.self_attn.q_proj",
    ):
        assert not matches(quantized, ignore), quantized


@pytest.mark.parametrize(
    ("architecture", "name", "dsa"),
    [
        ("DeepseekV3ForCausalLM", "deepseek_v3.yaml", False),
        ("DeepseekV32ForCausalLM", "deepseek_v32.yaml", True),
        ("GlmMoeDsaForCausalLM", "glm_moe_dsa.yaml", True),
    ],
)
def test_deepseek_family_recipes_keep_routers_indexer_and_mla_down_projections(
    architecture: str, name: str, dsa: bool
) -> None:
    recipe, path = recipe_for([architecture])
    assert path is not None and path.name == name
    assert recipe.quantize.scheme == "nvfp4"
    ignore = recipe.quantize.ignore
    kept = ["lm_head", "model.layers.1.mlp.gate", "model.layers.60.mlp.gate"]
    kept += [f"model.layers.{i}.self_attn.{p}" for i in (0, 7) for p in ("q_a_proj", "kv_a_proj_with_mqa", "kv_b_proj")]
    if dsa:
        kept += [f"model.layers.3.self_attn.indexer.{p}" for p in ("wq_b", "wk", "weights_proj")]
    for module in kept:
        assert matches(module, ignore), module
    for quantized in (
        "model.layers.0.mlp.gate_proj",  # the dense first layers
        "model.layers.0.mlp.down_proj",
        "model.layers.3.mlp.experts.17.gate_proj",
        "model.layers.3.mlp.experts.255.down_proj",
        "model.layers.3.mlp.shared_experts.gate_proj",
        "model.layers.3.mlp.shared_experts.down_proj",
        "model.layers.3.self_attn.q_b_proj",
        "model.layers.3.self_attn.q_proj",  # without q_lora_rank
        "model.layers.3.self_attn.o_proj",
    ):
        assert not matches(quantized, ignore), quantized
    # The first line says how to run it; the comments cite what the decisions rest on.
    text = path.read_text()
    assert "llm-compressor" in text and "nats" in text


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_speculator_sections_spell_out_every_setting(path: Path) -> None:
    """Each lever of the speculator's data and init is set in the file, at the current behaviour
    until the ablation (scripts/speculator_ablation.py) says otherwise."""
    section = yaml.safe_load(path.read_text()).get("speculator")
    if section is None:
        return
    assert set(section) == set(SpeculatorSettings.model_fields), path.name
    settings = load_recipe(path).speculator
    assert settings.generation_concurrency == 64
    assert settings.teacher_forced_data == [] and settings.teacher_forced_max_sequences == 2000
    assert settings.init_from_last_layer is False


def test_speculator_levers_load_from_a_recipe(tmp_path: Path) -> None:
    levers = {
        "generation_concurrency": 256,
        "teacher_forced_data": ["data/gsm8k.jsonl", "/abs/alpaca.json"],
        "teacher_forced_max_sequences": 500,
        "init_from_last_layer": True,
    }
    settings = load_recipe(write_recipe(tmp_path, {"speculator": levers})).speculator
    assert settings.model_dump(include=set(levers)) == levers
    assert settings.num_prompts == SpeculatorSettings().num_prompts


def test_partial_recipe_keeps_other_defaults(tmp_path: Path) -> None:
    path = write_recipe(tmp_path, {"quantize": {"scheme": "fp8", "calibration": {"num_samples": 3}}})
    recipe = load_recipe(path)
    assert recipe.quantize.scheme == "fp8"
    assert recipe.quantize.calibration.num_samples == 3
    assert recipe.quantize.calibration.max_seq_length == Calibration().max_seq_length
    assert recipe.eval == Eval()


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"quantise": {"scheme": "fp8"}}, "quantise"),
        ({"quantize": {"schema": "fp8"}}, "quantize.schema"),
        ({"quantize": {"calibration": {"num_sample": 8}}}, "quantize.calibration.num_sample"),
        ({"eval": {"windows": 8}}, "eval.windows"),
    ],
)
def test_unknown_keys_are_named_with_the_file(tmp_path: Path, data: dict, key: str) -> None:
    path = write_recipe(tmp_path, data, name="typo.yaml")
    with pytest.raises(OnboardError) as info:
        load_recipe(path)
    message = str(info.value)
    assert f"'{key}'" in message
    assert "unknown key" in message
    assert str(path) in message


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"quantize": {"scheme": "int4"}}, "quantize.scheme"),
        ({"quantize": {"calibration": {"num_samples": 0}}}, "quantize.calibration.num_samples"),
        ({"quantize": {"calibration": {"num_samples": -4}}}, "quantize.calibration.num_samples"),
        (
            {"quantize": {"calibration": {"max_seq_length": 1}}},
            "quantize.calibration.max_seq_length",
        ),
        (
            {"quantize": {"calibration": {"num_samples": "many"}}},
            "quantize.calibration.num_samples",
        ),
        ({"quantize": {"calibration": {"traffic": ["poetry"]}}}, "quantize.calibration.traffic"),
        ({"quantize": {"ignore": "lm_head"}}, "quantize.ignore"),
        ({"eval": {"max_tokens": 0}}, "eval.max_tokens"),
        ({"eval": {"window": 0}}, "eval.window"),
        ({"architectures": "LlamaForCausalLM"}, "architectures"),
        ({"speculator": {"generation_concurrency": 0}}, "speculator.generation_concurrency"),
        ({"speculator": {"teacher_forced_data": "gsm8k.jsonl"}}, "speculator.teacher_forced_data"),
        ({"speculator": {"teacher_forced_max_sequences": 0}}, "speculator.teacher_forced_max_sequences"),
        ({"speculator": {"init_from_last_layer": "maybe"}}, "speculator.init_from_last_layer"),
        ({"quantize": "nvfp4"}, "quantize"),
    ],
)
def test_invalid_values_raise(tmp_path: Path, data: dict, field: str) -> None:
    path = write_recipe(tmp_path, data, name="bad.yaml")
    with pytest.raises(OnboardError) as info:
        load_recipe(path)
    message = str(info.value)
    assert str(path) in message
    assert f"'{field}" in message


@pytest.mark.parametrize(
    "text",
    ["- a\n- list\n", "just a string\n", "", "quantize: [unclosed\n"],
    ids=["list", "scalar", "empty", "bad-yaml"],
)
def test_non_mapping_or_broken_yaml_raises(tmp_path: Path, text: str) -> None:
    path = write_recipe(tmp_path, text, name="odd.yaml")
    with pytest.raises(OnboardError, match=r"odd\.yaml"):
        load_recipe(path)


def test_missing_recipe_raises(tmp_path: Path) -> None:
    with pytest.raises(OnboardError, match="does not exist"):
        load_recipe(tmp_path / "absent.yaml")


def test_recipes_are_frozen() -> None:
    recipe = Recipe()
    with pytest.raises(ValueError):
        recipe.name = "changed"  # type: ignore[misc]
