"""GGUF files: converted once to a bf16 safetensors checkpoint that loads like any other.

Every GGUF here is the real tiny Llama `gguf_fixture.build_tiny_gguf` writes with `gguf.GGUFWriter`
(F16 matrices, F32 norms, a byte-level BPE vocabulary and a ChatML template in the metadata).
"""

import json
import os
import random
import struct
from pathlib import Path

import gguf_fixture
import pytest
import tiny_models
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from onboard.errors import OnboardError
from onboard.models import gguf as gguf_module
from onboard.models import inspect_checkpoint, load_model, load_tokenizer, resolve_model
from onboard.models.gguf import convert_gguf, converted_gguf

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France? def mean(values): 2 + 2 = 4"},
]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama GGUF (metadata eos = <|im_end|>). Shared: do not modify."""
    return gguf_fixture.build_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.F16.gguf")


@pytest.fixture(scope="module")
def converted(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`convert_gguf(tiny_gguf)`. Shared: do not modify."""
    return convert_gguf(tiny_gguf, tmp_path_factory.mktemp("converted") / "checkpoint")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private `$ONBOARD_CACHE`, so cache hits and misses are this test's own."""
    path = tmp_path / "cache"
    monkeypatch.setenv("ONBOARD_CACHE", str(path))
    return path


def _input_ids(tokenizer) -> torch.Tensor:
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    return torch.tensor([tokenizer(text, add_special_tokens=False).input_ids])


# ---------------------------------------------------------------------------------------------
# The fixture itself
# ---------------------------------------------------------------------------------------------


def test_fixture_is_a_real_deterministic_gguf(tiny_gguf: Path, tmp_path: Path) -> None:
    import gguf

    again = gguf_fixture.build_tiny_gguf(tmp_path / "again.gguf")
    assert again.read_bytes() == tiny_gguf.read_bytes()
    assert gguf_fixture.build_tiny_gguf(tmp_path / "s1.gguf", seed=1).read_bytes() != again.read_bytes()

    reader = gguf.GGUFReader(tiny_gguf)
    assert reader.get_field("general.architecture").contents() == "llama"
    assert reader.get_field("tokenizer.ggml.model").contents() == "gpt2"
    assert reader.get_field("llama.block_count").contents() == gguf_fixture.NUM_LAYERS
    assert reader.get_field("tokenizer.chat_template").contents() == tiny_models.CHAT_TEMPLATE
    assert reader.get_field("tokenizer.ggml.padding_token_id") is None
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == "F16"
    assert types["blk.0.attn_norm.weight"] == "F32"
    assert len(types) == 3 + 9 * gguf_fixture.NUM_LAYERS


# ---------------------------------------------------------------------------------------------
# convert_gguf
# ---------------------------------------------------------------------------------------------


def test_convert_writes_a_bf16_safetensors_checkpoint(converted: Path) -> None:
    names = {p.name for p in converted.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names
    assert not [n for n in names if n.endswith((".bin", ".gguf", ".pt"))]
    assert not [p for p in converted.parent.iterdir() if p.name.startswith(".")], "staging left over"

    config = json.loads((converted / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["model_type"] == "llama"
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["hidden_size"] == gguf_fixture.HIDDEN_SIZE
    assert config["num_hidden_layers"] == gguf_fixture.NUM_LAYERS
    assert config["num_attention_heads"] == gguf_fixture.NUM_HEADS
    assert config["num_key_value_heads"] == gguf_fixture.NUM_KV_HEADS
    assert config["intermediate_size"] == gguf_fixture.FFN_SIZE
    assert config["vocab_size"] == tiny_models.VOCAB_SIZE
    assert config["tie_word_embeddings"] is False

    with safe_open(str(converted / "model.safetensors"), "pt") as handle:
        keys = set(handle.keys())
        assert {handle.get_tensor(k).dtype for k in keys} == {torch.bfloat16}
    assert keys == set(gguf_fixture.tiny_gguf_state_dict())

    checkpoint = inspect_checkpoint(converted)
    assert checkpoint.model_type == "llama"
    assert checkpoint.architectures == ["LlamaForCausalLM"]


def test_convert_undoes_llama_cpp_qk_permutation(converted: Path) -> None:
    """Every weight lands where it started in HF layout, q/k included (to F16 -> bf16 rounding)."""
    original = gguf_fixture.tiny_gguf_state_dict()
    with safe_open(str(converted / "model.safetensors"), "pt") as handle:
        for name, expected in original.items():
            got = handle.get_tensor(name).float()
            torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-3, msg=name)


def test_converted_logits_match_loading_the_gguf_directly(tiny_gguf: Path, converted: Path) -> None:
    checkpoint = inspect_checkpoint(converted)
    model = load_model(checkpoint)
    assert model.dtype == torch.bfloat16
    assert getattr(model, "hf_quantizer", None) is None
    direct = AutoModelForCausalLM.from_pretrained(
        tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.bfloat16
    ).eval()

    input_ids = _input_ids(load_tokenizer(checkpoint))
    assert input_ids.shape[1] > 20
    with torch.no_grad():
        ours = model(input_ids).logits.float()
        theirs = direct(input_ids).logits.float()
    assert ours.shape == (1, input_ids.shape[1], tiny_models.VOCAB_SIZE)
    torch.testing.assert_close(ours, theirs, rtol=1.6e-2, atol=1e-2)
    # a real, input-dependent model: positions disagree about the next token
    assert ours[0].argmax(-1).unique().numel() > 1


def test_converted_tokenizer_and_chat_template(converted: Path, tmp_path: Path) -> None:
    """Same vocabulary, merges and ChatML template as the tokenizer the GGUF was made from."""
    reference = tiny_models.build_tokenizer(tmp_path / "reference")
    tokenizer = load_tokenizer(inspect_checkpoint(converted))
    assert len(tokenizer) == len(reference)

    ours = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    expected = reference.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert ours == expected
    assert ours.endswith("<|im_start|>assistant\n")
    assert tokenizer(ours, add_special_tokens=False).input_ids == reference(ours, add_special_tokens=False).input_ids
    # the template travels with the checkpoint, not only in memory
    assert AutoTokenizer.from_pretrained(converted).chat_template == tiny_models.CHAT_TEMPLATE


@pytest.mark.parametrize(
    ("gguf_eos", "want_eos"),
    [
        # A correct file: transformers' GGUFLlamaConverter still makes the tokenizer's eos the bos
        # token (<|im_start|>); the config says <|im_end|>, and fix_special_tokens must win.
        pytest.param(tiny_models.EOS_TOKEN_ID, tiny_models.EOS_TOKEN, id="eos=im_end"),
        # A file that itself says eos = bos: config and tokenizer agree, nothing to repair.
        pytest.param(tiny_models.BOS_TOKEN_ID, tiny_models.BOS_TOKEN, id="eos=bos"),
    ],
)
def test_converted_special_tokens_agree_with_config(gguf_eos: int, want_eos: str, tmp_path: Path) -> None:
    gguf_file = gguf_fixture.build_tiny_gguf(tmp_path / "tiny.gguf", eos_token_id=gguf_eos)
    # What transformers itself makes of the file (the premise of fix_special_tokens).
    raw = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    assert raw.eos_token == tiny_models.BOS_TOKEN
    assert raw.pad_token is None

    out = convert_gguf(gguf_file, tmp_path / "checkpoint")
    config = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    assert config["eos_token_id"] == gguf_eos

    # Saved files, read without onboard's fix-ups.
    saved = AutoTokenizer.from_pretrained(out)
    assert saved.eos_token == want_eos
    assert saved.eos_token_id == config["eos_token_id"]
    assert saved.bos_token == tiny_models.BOS_TOKEN
    assert saved.pad_token is not None
    assert generation["eos_token_id"] == config["eos_token_id"]
    assert generation["pad_token_id"] == saved.pad_token_id

    loaded = load_tokenizer(inspect_checkpoint(out))
    assert loaded.eos_token_id == config["eos_token_id"]
    assert loaded.pad_token_id is not None


def test_convert_replaces_an_existing_output(tiny_gguf: Path, tmp_path: Path) -> None:
    out = tmp_path / "checkpoint"
    out.mkdir()
    (out / "stale.safetensors").write_bytes(b"old")
    (tmp_path / ".checkpoint.partial").mkdir()  # a crashed earlier attempt
    convert_gguf(tiny_gguf, out)
    assert not (out / "stale.safetensors").exists()
    assert (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]


# ---------------------------------------------------------------------------------------------
# resolve_model / converted_gguf: the cache
# ---------------------------------------------------------------------------------------------


def test_resolve_model_converts_once_into_the_cache(
    tiny_gguf: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checkpoint = resolve_model(tiny_gguf)
    out = checkpoint.path
    assert out.parent == cache / "gguf"
    assert out.name.startswith(tiny_gguf.stem + "-")
    assert (out / "config.json").is_file()
    assert checkpoint.model_type == "llama"
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name], "staging left in the cache"
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in [out, *out.iterdir()]}

    def no_second_conversion(*args, **kwargs):
        raise AssertionError("converted again although the cache holds the checkpoint")

    monkeypatch.setattr(gguf_module, "convert_gguf", no_second_conversion)
    again = resolve_model(tiny_gguf)
    assert again.path == out
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in [out, *out.iterdir()]} == before
    # `~` is expanded, as for checkpoint directories
    monkeypatch.setenv("HOME", str(tiny_gguf.parent.parent))
    tilde = Path("~") / tiny_gguf.parent.name / tiny_gguf.name
    assert resolve_model(tilde).path == out


def test_cache_key_follows_the_file_content(tiny_gguf: Path, cache: Path, tmp_path: Path) -> None:
    first = converted_gguf(tiny_gguf)
    other = gguf_fixture.build_tiny_gguf(tmp_path / "other" / tiny_gguf.name, seed=1)
    second = converted_gguf(other)
    assert second != first
    assert second.parent == first.parent == cache / "gguf"


def test_cache_discards_a_crashed_conversion(tiny_gguf: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A half-written `.partial` (or a dir without config.json) is redone, not trusted."""
    calls = []
    real = gguf_module.convert_gguf
    monkeypatch.setattr(gguf_module, "convert_gguf", lambda src, dst: calls.append(dst) or real(src, dst))
    out = converted_gguf(tiny_gguf)
    atomic_partial = out.with_name(f".{out.name}.partial")
    (out / "config.json").unlink()
    atomic_partial.mkdir()
    (atomic_partial / "junk").write_text("x")
    assert converted_gguf(tiny_gguf) == out
    assert calls == [out, out]
    assert (out / "config.json").is_file()
    assert not atomic_partial.exists()


def test_missing_gguf_is_an_onboard_error(tmp_path: Path, cache: Path) -> None:
    missing = tmp_path / "nope" / "model.gguf"
    with pytest.raises(OnboardError, match="does not exist"):
        resolve_model(missing)
    assert not (cache / "gguf").exists()


def _random_bytes(n: int) -> bytes:
    data = random.Random(0).randbytes(n)
    assert not data.startswith(b"GGUF")
    return data


def _assert_one_line_error(err: pytest.ExceptionInfo, path: Path) -> None:
    message = str(err.value)
    assert "\n" not in message
    assert str(path) in message


def test_corrupt_gguf_is_a_one_line_onboard_error(tmp_path: Path, cache: Path) -> None:
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(_random_bytes(4096))
    with pytest.raises(OnboardError) as err:
        resolve_model(bad)
    _assert_one_line_error(err, bad)
    assert "GGUF" in str(err.value)
    # nothing half-made is left to be mistaken for a conversion
    assert not list(cache.glob("gguf/*/config.json"))
    assert not list(cache.glob("gguf/.*"))


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda data: b"", id="empty"),
        pytest.param(lambda data: data[: len(data) - 1000], id="tensor-data-truncated"),
        pytest.param(lambda data: b"GGUF" + struct.pack("<I", 99) + data[8:], id="unknown-version"),
    ],
)
def test_damaged_gguf_is_a_one_line_onboard_error(make, tiny_gguf: Path, tmp_path: Path) -> None:
    bad = tmp_path / "damaged.gguf"
    bad.write_bytes(make(tiny_gguf.read_bytes()))
    with pytest.raises(OnboardError) as err:
        convert_gguf(bad, tmp_path / "out")
    _assert_one_line_error(err, bad)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["damaged.gguf"]


@pytest.mark.parametrize("keep", [4, 100, 5000], ids=["magic-only", "in-header", "in-metadata"])
def test_truncated_gguf_header_is_an_onboard_error(keep: int, tiny_gguf: Path, tmp_path: Path) -> None:
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(tiny_gguf.read_bytes()[:keep])
    with pytest.raises(OnboardError) as err:
        convert_gguf(bad, tmp_path / "out")
    _assert_one_line_error(err, bad)


def test_corrupt_gguf_from_the_cli_is_one_line(tmp_path: Path, onboard_process) -> None:
    """The CLI turns the OnboardError into `onboard: error: ...` and exit status 2."""
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(_random_bytes(4096))
    env = {**os.environ, "ONBOARD_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    result = onboard_process.run(["quantize", str(bad), "--out", str(tmp_path / "run")], env=env, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("onboard: error:")]
    assert len(errors) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert str(bad) in errors[0]
    assert not (tmp_path / "run").exists()
