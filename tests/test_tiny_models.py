"""The tiny checkpoints are real, loadable, non-trivial, NVFP4-shaped and deterministic."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tiny_models
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

TESTS_DIR = Path(__file__).resolve().parent

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Write a Python function for the mean of a list, then 2 + 2 = ?"},
]


@pytest.fixture(scope="module")
def arch_dirs(request: pytest.FixtureRequest) -> dict[str, Path]:
    return {arch: request.getfixturevalue(f"tiny_{arch}") for arch in tiny_models.ARCHS}


def _dir_bytes(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


def _safetensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


def test_tokenizer_specials_and_chat_template(tiny_llama: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    assert len(tok) == tiny_models.VOCAB_SIZE
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert (tok.pad_token, tok.pad_token_id) == ("<|endoftext|>", 0)
    assert (tok.bos_token, tok.bos_token_id) == ("<|im_start|>", 1)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)

    convo = [*MESSAGES, {"role": "assistant", "content": "def mean(xs): return sum(xs) / len(xs)"}]
    text = tok.apply_chat_template(convo, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWrite a Python function for the mean of a list, then 2 + 2 = ?"
        "<|im_end|>\n"
        "<|im_start|>assistant\ndef mean(xs): return sum(xs) / len(xs)<|im_end|>\n"
    )
    prompt = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert not tok.apply_chat_template(MESSAGES, tokenize=False).endswith("assistant\n")

    # Specials are single tokens, nothing is added implicitly, and text round-trips (byte-level).
    ids = tok(prompt)["input_ids"]
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2
    assert tok.decode(ids) == prompt
    odd = "naïve café ∑ x² — 日本語 \t\n  emoji 🙂"
    assert tok.decode(tok(odd)["input_ids"]) == odd
    # A trained BPE, not just bytes: common corpus words compress.
    assert len(tok("the model and the data")["input_ids"]) < len("the model and the data") / 2


def test_tokenizer_build_is_deterministic(tmp_path: Path) -> None:
    tiny_models.build_tokenizer(tmp_path / "a")
    tiny_models.build_tokenizer(tmp_path / "b")
    a, b = _dir_bytes(tmp_path / "a"), _dir_bytes(tmp_path / "b")
    assert "tokenizer.json" in a
    assert a == b


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", tiny_models.ARCHS)
def test_checkpoint_files_and_config(arch: str, arch_dirs: dict[str, Path]) -> None:
    d = arch_dirs[arch]
    names = {p.name for p in d.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names
    assert not any(n.endswith((".bin", ".pt", ".pth")) for n in names)

    raw = json.loads((d / "config.json").read_text())
    assert raw["model_type"] == arch
    assert raw["dtype"] == "bfloat16"
    assert raw["vocab_size"] == tiny_models.VOCAB_SIZE
    assert raw["tie_word_embeddings"] is (arch == "qwen3")
    assert (raw["bos_token_id"], raw["eos_token_id"], raw["pad_token_id"]) == (1, 2, 0)

    gen = GenerationConfig.from_pretrained(d)
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (1, 2, 0)

    tensors = _safetensors(d / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert ("lm_head.weight" in tensors) is (arch != "qwen3")  # tied: stored once
    assert tensors["model.embed_tokens.weight"].shape == (512, 64)


@pytest.mark.parametrize("arch", tiny_models.ARCHS)
def test_forward_is_finite_and_not_uniform(arch: str, arch_dirs: dict[str, Path]) -> None:
    d = arch_dirs[arch]
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).eval()
    assert model.dtype == torch.bfloat16
    assert model.config.model_type == arch
    assert model.get_input_embeddings().weight.shape[0] == len(tok) == 512

    enc = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    input_ids = enc["input_ids"]
    with torch.no_grad():
        logits = model(**enc).logits.float()
    assert logits.shape == (1, input_ids.shape[1], tiny_models.VOCAB_SIZE)
    assert torch.isfinite(logits).all()

    probs = logits.softmax(-1)[0]
    entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
    max_prob = probs.max(-1).values
    # Uniform would be log(512) = 6.24 nats everywhere; demand a clear margin and real spread.
    assert entropy.mean().item() < math.log(tiny_models.VOCAB_SIZE) - 1.5
    assert entropy.max().item() - entropy.min().item() > 1.0
    assert max_prob.max().item() > 0.3
    assert max_prob.std().item() > 0.05
    # Different positions predict different tokens.
    assert logits[0].argmax(-1).unique().numel() > 3


@pytest.mark.parametrize("arch", tiny_models.ARCHS)
def test_every_projection_is_nvfp4_shaped(arch: str, arch_dirs: dict[str, Path]) -> None:
    """Every Linear (and fused expert matrix) has in/out features divisible by 16."""
    model = AutoModelForCausalLM.from_pretrained(arch_dirs[arch], dtype=torch.bfloat16)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert "lm_head" in linears
    attention = "self_attn.kv_b_proj" if arch in tiny_models.MLA_ARCHS else "self_attn.k_proj"
    assert any(n.endswith(attention) for n in linears)
    # The DSA indexer's per-head weights (out = index heads) stay BF16 in every recipe, as routers do.
    small = ("indexer.weights_proj",)
    for name, lin in linears.items():
        if name.endswith(small):
            continue
        assert lin.in_features % 16 == 0, (name, lin.in_features)
        assert lin.out_features % 16 == 0, (name, lin.out_features)
    # On disk (what a quantizer reading the checkpoint sees), every 2-D weight except the router
    # and the embedding is a projection: check both dims there too.
    for key, t in _safetensors(arch_dirs[arch] / "model.safetensors").items():
        if t.ndim == 2 and not key.endswith(
            ("mlp.gate.weight", "embed_tokens.weight", *(f"{s}.weight" for s in small))
        ):
            assert t.shape[0] % 16 == 0 and t.shape[1] % 16 == 0, (key, tuple(t.shape))
        if key.endswith("mlp.gate.weight"):
            assert t.shape[1] % 16 == 0, (key, tuple(t.shape))


def test_moe_has_router_and_experts(tiny_qwen3_moe: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe, dtype=torch.bfloat16).eval()
    modules = dict(model.named_modules())
    for i in range(tiny_models.NUM_HIDDEN_LAYERS):
        gate = modules[f"model.layers.{i}.mlp.gate"]
        assert gate.weight.shape == (tiny_models.NUM_EXPERTS, tiny_models.HIDDEN_SIZE)
        assert gate.top_k == tiny_models.NUM_EXPERTS_PER_TOK
        experts = modules[f"model.layers.{i}.mlp.experts"]
        assert experts.num_experts == tiny_models.NUM_EXPERTS
        # transformers 5 holds experts fused as 3-D params: (experts, out, in).
        assert experts.gate_up_proj.shape == (4, 2 * 64, 64)
        assert experts.down_proj.shape == (4, 64, 64)

    # On disk the experts are in the classic per-expert layout.
    with safe_open(str(tiny_qwen3_moe / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    for i in range(tiny_models.NUM_HIDDEN_LAYERS):
        assert f"model.layers.{i}.mlp.gate.weight" in keys
        for e in range(tiny_models.NUM_EXPERTS):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert f"model.layers.{i}.mlp.experts.{e}.{proj}.weight" in keys

    # The router really spreads tokens over several experts.
    chosen: list[torch.Tensor] = []
    hook = modules["model.layers.0.mlp.gate"].register_forward_hook(lambda _m, _i, out: chosen.append(out[2].flatten()))
    try:
        with torch.no_grad():
            model(torch.arange(3, 131).unsqueeze(0))
    finally:
        hook.remove()
    counts = torch.bincount(torch.cat(chosen), minlength=tiny_models.NUM_EXPERTS)
    assert (counts > 0).sum().item() >= 3, counts


# ---------------------------------------------------------------------------------------------
# Determinism
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", tiny_models.ARCHS)
def test_model_build_is_deterministic(arch: str, arch_dirs: dict[str, Path], tmp_path) -> None:
    again = tiny_models.build_model(tmp_path / "again", arch, seed=0)
    assert _dir_bytes(again) == _dir_bytes(arch_dirs[arch])
    other = tiny_models.build_model(tmp_path / "other", arch, seed=1)
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()


def test_build_is_deterministic_across_processes(tiny_llama: Path, tmp_path: Path) -> None:
    """A fresh interpreter (different hash seed) writes the same bytes."""
    out = tmp_path / "fresh"
    env = {**os.environ, "PYTHONHASHSEED": "12345", "TOKENIZERS_PARALLELISM": "true"}
    code = "import sys, tiny_models; tiny_models.build_model(sys.argv[1], 'llama')"
    subprocess.run([sys.executable, "-c", code, str(out)], cwd=TESTS_DIR, env=env, check=True)
    assert _dir_bytes(out) == _dir_bytes(tiny_llama)


# ---------------------------------------------------------------------------------------------
# Broken / unsupported checkpoints
# ---------------------------------------------------------------------------------------------


def test_pickle_only_checkpoint(tiny_llama: Path, tmp_path: Path) -> None:
    d = tiny_models.build_pickle_only(tmp_path / "pickle")
    names = {p.name for p in d.iterdir()}
    assert "pytorch_model.bin" in names
    assert not any(n.endswith(".safetensors") for n in names)
    assert json.loads((d / "config.json").read_text())["model_type"] == "llama"
    # Same weights as the safetensors llama, just pickled.
    pickled = torch.load(d / "pytorch_model.bin", map_location="cpu", weights_only=True)
    safe = _safetensors(tiny_llama / "model.safetensors")
    assert set(pickled) == set(safe)
    for k, v in safe.items():
        assert torch.equal(pickled[k], v), k


def test_unknown_arch_checkpoint(tmp_path: Path) -> None:
    d = tiny_models.build_unknown_arch(tmp_path / "unknown")
    raw = json.loads((d / "config.json").read_text())
    assert raw["model_type"] == "notamodel"
    assert raw["architectures"] == ["NotAModelForCausalLM"]
    assert _safetensors(d / "model.safetensors")
    with pytest.raises((ValueError, KeyError)):
        AutoConfig.from_pretrained(d)


# ---------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------


def test_llama_copy_is_private(tiny_llama: Path, tiny_llama_copy: Path) -> None:
    assert tiny_llama_copy != tiny_llama
    assert _dir_bytes(tiny_llama_copy) == _dir_bytes(tiny_llama)
    (tiny_llama_copy / "model.safetensors").write_bytes(b"corrupt")
    assert (tiny_llama / "model.safetensors").read_bytes() != b"corrupt"


def test_environment_is_isolated(onboard_cache: Path) -> None:
    from onboard.paths import cache_dir

    assert os.environ.get("HF_HUB_OFFLINE") and os.environ.get("TRANSFORMERS_OFFLINE")
    assert cache_dir() == onboard_cache
