"""Loading checkpoints and artifacts: special tokens, decompression, MODEL resolution."""

from pathlib import Path

import pytest
import tiny_models
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer

from onboard.errors import OnboardError
from onboard.models import inspect_checkpoint, load_model, load_tokenizer, resolve_model
from onboard.models.tokens import fix_special_tokens
from onboard.recipes import Calibration, Quantize

# FP4 E2M1 code points (OCP microscaling spec).
E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


# ---------------------------------------------------------------------------------------------
# fix_special_tokens / load_tokenizer
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def tokenizer(tiny_llama: Path):
    return AutoTokenizer.from_pretrained(tiny_llama)


@pytest.fixture
def config(tiny_llama: Path):
    return AutoConfig.from_pretrained(tiny_llama)


def test_pad_set_from_eos_when_missing(tokenizer, config) -> None:
    tokenizer.pad_token = None
    assert tokenizer.pad_token is None
    fixed = fix_special_tokens(tokenizer, config)
    assert fixed.pad_token == tiny_models.EOS_TOKEN
    assert fixed.pad_token_id == tiny_models.EOS_TOKEN_ID
    assert fixed.eos_token_id == tiny_models.EOS_TOKEN_ID


def test_existing_pad_is_kept(tokenizer, config) -> None:
    fixed = fix_special_tokens(tokenizer, config)
    assert (fixed.pad_token, fixed.pad_token_id) == (
        tiny_models.PAD_TOKEN,
        tiny_models.PAD_TOKEN_ID,
    )
    assert (fixed.eos_token, fixed.eos_token_id) == (
        tiny_models.EOS_TOKEN,
        tiny_models.EOS_TOKEN_ID,
    )


@pytest.mark.parametrize("eos", [tiny_models.BOS_TOKEN_ID, [tiny_models.BOS_TOKEN_ID, tiny_models.EOS_TOKEN_ID]])
def test_eos_follows_the_model_config(tokenizer, config, eos) -> None:
    """A GGUF-style tokenizer whose eos disagrees with the config: the config wins."""
    config.eos_token_id = eos
    fixed = fix_special_tokens(tokenizer, config)
    assert fixed.eos_token_id == tiny_models.BOS_TOKEN_ID
    assert fixed.eos_token == tiny_models.BOS_TOKEN


def test_eos_from_config_also_becomes_pad(tokenizer, config) -> None:
    tokenizer.pad_token = None
    config.eos_token_id = tiny_models.BOS_TOKEN_ID
    fixed = fix_special_tokens(tokenizer, config)
    assert fixed.pad_token_id == fixed.eos_token_id == tiny_models.BOS_TOKEN_ID


@pytest.mark.parametrize("eos", [None, [], tiny_models.VOCAB_SIZE + 5])
def test_unusable_config_eos_leaves_tokenizer_alone(tokenizer, config, eos) -> None:
    config.eos_token_id = eos
    fixed = fix_special_tokens(tokenizer, config)
    assert fixed.eos_token_id == tiny_models.EOS_TOKEN_ID
    assert fixed.pad_token_id == tiny_models.PAD_TOKEN_ID


def test_load_tokenizer(tiny_llama: Path) -> None:
    tokenizer = load_tokenizer(inspect_checkpoint(tiny_llama))
    assert len(tokenizer) == tiny_models.VOCAB_SIZE
    assert tokenizer.eos_token_id == tiny_models.EOS_TOKEN_ID
    assert tokenizer.pad_token_id == tiny_models.PAD_TOKEN_ID
    assert tokenizer.chat_template == tiny_models.CHAT_TEMPLATE


# ---------------------------------------------------------------------------------------------
# resolve_model
# ---------------------------------------------------------------------------------------------


def test_resolve_model_on_a_checkpoint_dir(tiny_llama: Path) -> None:
    for given in (tiny_llama, str(tiny_llama)):
        checkpoint = resolve_model(given)
        assert checkpoint.path == tiny_llama
        assert checkpoint.architectures == ["LlamaForCausalLM"]
        assert checkpoint.model_type == "llama"
        assert checkpoint.config["vocab_size"] == tiny_models.VOCAB_SIZE
        assert not checkpoint.allow_pickle and not checkpoint.trust_remote_code


def test_resolve_model_rejects_what_it_cannot_load(tmp_path: Path) -> None:
    with pytest.raises(OnboardError, match="does not exist"):
        resolve_model(tmp_path / "absent")
    stray = tmp_path / "weights.txt"
    stray.write_text("not a model")
    with pytest.raises(OnboardError, match=r"neither a checkpoint directory nor a \.gguf file"):
        resolve_model(stray)
    with pytest.raises(OnboardError, match=r"no config\.json"):
        resolve_model(tmp_path)


# ---------------------------------------------------------------------------------------------
# load_model on a compressed-tensors artifact
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def artifact(tiny_llama: Path, quantized_run) -> Path:
    settings = Quantize(scheme="nvfp4", calibration=Calibration(num_samples=2, max_seq_length=64))
    return quantized_run(tiny_llama, settings) / "artifact"


def stored_tensors(directory: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(directory / "model.safetensors"), framework="pt") as handle:
        return {k: handle.get_tensor(k) for k in handle.keys()}  # noqa: SIM118


def test_load_model_decompresses_so_the_decoder_runs_alone(artifact: Path, tiny_llama: Path) -> None:
    """Regression: transformers defers decompression to a hook on the top-level forward, so the
    KL eval's `model.base_model(...)` on a fresh model would meet packed weights."""
    model = load_model(inspect_checkpoint(artifact))
    assert not model.training
    ids = torch.tensor([load_tokenizer(inspect_checkpoint(tiny_llama))("def mean(values): return 2 + 2")["input_ids"]])

    # The very first call is the decoder alone.
    with torch.no_grad():
        hidden = model.base_model(input_ids=ids).last_hidden_state
        full = model(ids, output_hidden_states=True)
    assert hidden.shape == (1, ids.shape[1], tiny_models.HIDDEN_SIZE)
    assert torch.isfinite(hidden).all()
    torch.testing.assert_close(hidden, full.hidden_states[-1], rtol=0, atol=0)


def test_a_loaded_artifact_holds_plain_tensors_that_move_with_it(artifact: Path) -> None:
    """compressed-tensors' decompression offloads every module (its tensors in a cache that copies
    them back to the CPU on each access); `.to(device)` would then leave the model on the CPU."""
    from compressed_tensors.offload.cache import OffloadCache

    model = load_model(inspect_checkpoint(artifact))
    assert not any(isinstance(m._parameters, OffloadCache) for m in model.modules())
    weight = model.get_submodule("model.layers.0.self_attn.q_proj").weight
    assert type(weight) is torch.nn.Parameter and weight.device.type == "cpu"
    model.to("meta")  # a move reaches every tensor, as it would reach a GPU
    assert all(p.device.type == "meta" for p in model.parameters())


def test_load_model_returns_the_stored_weights_decoded(artifact: Path, tiny_llama: Path) -> None:
    model = load_model(inspect_checkpoint(artifact))
    stored = stored_tensors(artifact)
    reference = stored_tensors(tiny_llama)
    linears = [name.removesuffix(".weight_packed") for name in stored if name.endswith(".weight_packed")]
    assert len(linears) == 7 * tiny_models.NUM_HIDDEN_LAYERS
    for name in linears:
        module = model.get_submodule(name)
        assert not hasattr(module, "weight_packed"), name
        weight = module.weight
        assert weight.dtype == torch.bfloat16
        assert weight.shape == reference[f"{name}.weight"].shape
        # Decode by hand: FP4 codes (low nibble first) x FP8 block scale / FP32 global scale.
        packed = stored[f"{name}.weight_packed"]
        codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
        scale = stored[f"{name}.weight_scale"].float() / stored[f"{name}.weight_global_scale"]
        decoded = E2M1[codes.long()] * scale.repeat_interleave(16, dim=1)
        torch.testing.assert_close(weight.float(), decoded.to(torch.bfloat16).float(), rtol=0, atol=0)
        assert not torch.equal(weight, reference[f"{name}.weight"])  # quantized, not the original
    assert torch.equal(model.lm_head.weight, reference["lm_head.weight"])


def test_load_model_on_plain_checkpoint(tiny_llama: Path) -> None:
    model = load_model(inspect_checkpoint(tiny_llama))
    reference = stored_tensors(tiny_llama)
    assert not model.training
    assert model.dtype == torch.bfloat16
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, reference[name]), name
    as_float = load_model(inspect_checkpoint(tiny_llama), dtype=torch.float32)
    assert as_float.dtype == torch.float32
