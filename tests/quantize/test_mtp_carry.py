"""The quantize stage carries a source's MTP layers into the artifact (llm-compressor, through
transformers, drops them): byte for byte, counted in the config, named in the ignore list, loaded
back by transformers' `MtpModel` and served by the engine; an artifact that lacks them is refused."""

import json
import shutil
from pathlib import Path

import pytest
import tiny_models
import torch
import transformers

from onboard.adapt.parity import compare_greedy
from onboard.engine.config import EngineConfig
from onboard.engine.llm_engine import LLMEngine
from onboard.engine.sampler import SamplingParams
from onboard.models.headers import safetensors_entries
from onboard.models.mtp import mtp_entries
from onboard.quantize.mtp_carry import MtpLost, check_mtp_kept
from onboard.recipes import Calibration, Quantize, recipe_for
from onboard.speculator.drafts import load_draft
from onboard.speculator.mtp_draft import load_mtp_draft

FAMILIES = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa")
MTP = f"model.layers.{tiny_models.DEEPSEEK_LAYERS}"  # after the main layers


def settings(source: Path, scheme: str) -> Quantize:
    """The family's recipe in `scheme`, calibrated on two short samples."""
    config = json.loads((source / "config.json").read_text())
    recipe, _ = recipe_for(config["architectures"])
    data = {
        **recipe.quantize.model_dump(),
        "scheme": scheme,
        "calibration": Calibration(num_samples=2, max_seq_length=64).model_dump(),
    }
    return Quantize.model_validate(data)


@pytest.fixture(scope="module")
def artifacts(quantized_run, request: pytest.FixtureRequest):
    """(source, shared run directory) of the family's MTP model quantized to NVFP4. Do not modify."""

    def build(arch: str) -> tuple[Path, Path]:
        source = request.getfixturevalue(f"tiny_mtp_{arch}")
        return source, quantized_run(source, settings(source, "nvfp4"))

    return build


@pytest.mark.parametrize("arch", FAMILIES)
def test_mtp_tensors_are_kept_byte_for_byte(artifacts, arch: str) -> None:
    source, root = artifacts(arch)
    artifact = root / "artifact"
    wanted = mtp_entries(source)
    assert len(wanted) > 40 and all(name.startswith(f"{MTP}.") for name in wanted)
    stored = safetensors_entries(artifact)
    for name, entry in wanted.items():
        assert stored[name].read() == entry.read() and stored[name].dtype == "BF16"
    main = [name for name in stored if name.startswith("model.layers.0.")]
    assert any(name.endswith("weight_packed") for name in main)  # the main stack was quantized

    config = json.loads((artifact / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    assert rf"re:model\.layers\.({tiny_models.DEEPSEEK_LAYERS})\." in config["quantization_config"]["ignore"]
    index = json.loads((artifact / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(stored)
    record = json.loads((root / "quantize/selection.json").read_text())["mtp"]
    assert record == {
        "layers": 1,
        "tensors": len(wanted),
        "bytes": sum(e.nbytes for e in wanted.values()),
        "dtypes": ["BF16"],
        "kept": True,
    }


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_artifact_loads_in_transformers_and_serves_its_mtp_head(artifacts, arch: str) -> None:
    """transformers loads the quantized artifact (the MTP tensors are keys it ignores), the MTP
    draft loads from it with the source's weights, and the engine serves it, losslessly."""
    source, root = artifacts(arch)
    artifact = root / "artifact"
    transformers.AutoModelForCausalLM.from_pretrained(artifact, dtype=torch.bfloat16)
    embed, head = torch.randn(512, 64), torch.randn(512, 64)
    theirs = load_mtp_draft(artifact, embed, head, torch.bfloat16).state_dict()
    want = load_mtp_draft(source, embed, head, torch.bfloat16).state_dict()
    assert theirs.keys() == want.keys() and all(torch.equal(theirs[k], want[k]) for k in want)

    engine = LLMEngine(artifact, EngineConfig(block_size=4, num_blocks=256, max_model_len=128), torch.float32)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)
    prompt = list(range(5, 30))
    (plain,) = engine.generate([prompt], params)
    draft, _ = load_draft(Path("mtp"), artifact, engine)
    engine.set_speculator(draft, 2)
    (spec,) = engine.generate([prompt], params)
    assert engine.speculator.stats.num_drafts > 0
    # W4A4 re-quantizes every linear's input, so a verification row's last-bit difference from a
    # decode row's may pick another token: adapt's near-tie rule, as `measure_acceptance` judges.
    tops = [[[token for token, _ in entry["top"]] for entry in c.logprobs] for c in (spec, plain)]
    assert compare_greedy(spec.token_ids, plain.token_ids, *tops).near_tie


def test_an_artifact_without_the_mtp_layers_is_refused(artifacts, tmp_path: Path) -> None:
    """What llm-compressor alone writes (the artifact without its mtp-*.safetensors) and an
    artifact whose MTP tensor was rewritten are refused in one line."""
    source, root = artifacts("deepseek_v3")
    lost = Path(shutil.copytree(root / "artifact", tmp_path / "lost"))
    for shard in lost.glob("mtp-*.safetensors"):
        shard.unlink()
    with pytest.raises(MtpLost) as err:
        check_mtp_kept(source, lost)
    message = str(err.value)
    assert "\n" not in message and "lacks 42 of the 42 MTP tensors" in message

    from safetensors.torch import load_file, save_file

    changed = Path(shutil.copytree(root / "artifact", tmp_path / "changed"))
    shard = next(changed.glob("mtp-*.safetensors"))
    tensors = load_file(shard)
    tensors[f"{MTP}.eh_proj.weight"] = tensors[f"{MTP}.eh_proj.weight"] * 2
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(MtpLost, match=r"eh_proj\.weight differs"):
        check_mtp_kept(source, changed)
    assert check_mtp_kept(source, changed, byte_equal=False)["kept"]  # a retrained head keeps its shape


def test_a_declared_but_absent_mtp_layer_is_not_claimed_by_the_artifact(tiny_deepseek_v3: Path, quantized_run) -> None:
    """tiny_deepseek_v3 declares transformers' default of one MTP layer and holds none (as a
    checkpoint re-saved through transformers does): its artifact declares none, so no server looks."""
    assert json.loads((tiny_deepseek_v3 / "config.json").read_text())["num_nextn_predict_layers"] == 1
    root = quantized_run(tiny_deepseek_v3, settings(tiny_deepseek_v3, "nvfp4a16"))  # test_mla_artifacts' run too
    config = json.loads((root / "artifact/config.json").read_text())
    assert config["num_nextn_predict_layers"] == 0
    assert not list((root / "artifact").glob("mtp-*"))
    assert json.loads((root / "quantize/selection.json").read_text())["mtp"]["declared"] == 1


def test_the_gate_checks_the_vision_tower_is_still_in_the_artifact(quantized_run, tiny_qwen3_5, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    from onboard.gate import evaluate_gate

    stripped = Path(shutil.copytree(quantized_run(tiny_qwen3_5, settings(tiny_qwen3_5, "nvfp4")), tmp_path / "run"))
    shard = stripped / "artifact" / "model.safetensors"
    tensors = load_file(shard)
    save_file({k: v for k, v in tensors.items() if not k.startswith("model.visual.")}, str(shard), {"format": "pt"})
    check = next(c for c in evaluate_gate(stripped)["checks"] if c["name"] == "vision_kept")
    assert check["value"] is False and not check["passed"]


def test_the_gate_checks_the_mtp_layers_are_still_in_the_artifact(artifacts, tmp_path: Path) -> None:
    from onboard.gate import evaluate_gate

    _, root = artifacts("deepseek_v3")
    check = next(c for c in evaluate_gate(root)["checks"] if c["name"] == "mtp_kept")
    assert check["value"] is True and check["passed"]
    stripped = Path(shutil.copytree(root, tmp_path / "run"))
    for shard in (stripped / "artifact").glob("mtp-*.safetensors"):
        shard.unlink()  # what re-saving the artifact through transformers does
    check = next(c for c in evaluate_gate(stripped)["checks"] if c["name"] == "mtp_kept")
    assert check["value"] is False and not check["passed"]


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_a_qwen_release_keeps_its_mtp_module_and_vision_tower(arch: str, quantized_run, request) -> None:
    """Qwen3.5's VLM release: the MTP module (`mtp.*`, counted by `text_config.mtp_num_hidden_layers`)
    and the vision tower kept byte for byte, the one named in the ignore list and neither quantized,
    the processor's config beside them, both checked by the gate; the artifact is the release's VLM
    class, the engine serves its text model with the module as its draft, and a MoE artifact
    (experts linearized) loads in transformers without the MTP tensors."""
    from onboard.gate import evaluate_gate
    from onboard.models import inspect_checkpoint, load_model
    from onboard.models.vlm import vision_entries

    source = request.getfixturevalue(f"tiny_{arch}")
    root = quantized_run(source, settings(source, "nvfp4"))
    artifact = root / "artifact"
    wanted, stored = mtp_entries(source), safetensors_entries(artifact)
    assert len(wanted) == (29 if arch.endswith("moe") else 15)
    assert all(stored[name].read() == entry.read() for name, entry in wanted.items())
    vision = vision_entries(source)
    assert len(vision) > 4 and all(stored[name].read() == entry.read() for name, entry in vision.items())
    assert (artifact / "preprocessor_config.json").read_bytes() == (source / "preprocessor_config.json").read_bytes()
    config = json.loads((artifact / "config.json").read_text())
    assert config["architectures"] == json.loads((source / "config.json").read_text())["architectures"]
    assert config["text_config"]["mtp_num_hidden_layers"] == 1
    assert r"re:mtp\." in config["quantization_config"]["ignore"]
    checks = {c["name"]: c for c in evaluate_gate(root)["checks"]}
    assert checks["mtp_kept"]["passed"] and checks["vision_kept"]["passed"]
    llm = LLMEngine(artifact, EngineConfig(block_size=4, num_blocks=64, max_model_len=128))
    (out,) = llm.generate([list(range(5, 25))], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    draft, _ = load_draft(Path("mtp"), artifact, llm)  # the kept module, served as the engine's draft
    llm.set_speculator(draft, 2)
    (drafted,) = llm.generate([list(range(5, 25))], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert drafted.token_ids == out.token_ids and llm.speculator.stats.num_drafts > 0
    reference = load_model(inspect_checkpoint(artifact), torch.bfloat16)
    want = reference.generate(torch.tensor([list(range(5, 25))]), max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert out.token_ids == want[0, 20:].tolist()
