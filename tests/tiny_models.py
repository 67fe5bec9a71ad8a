"""Tiny, seeded, random causal LMs saved as real Hugging Face checkpoint directories.

Everything here is built locally (no hub access): a byte-level BPE tokenizer trained on a small
built-in corpus, and llama / qwen3 / qwen3_moe models small enough to build, quantize and evaluate
on a CPU in seconds.  Every builder is deterministic: the same arguments give the same files, byte
for byte.

Shapes are chosen for NVFP4: every Linear (and every fused MoE expert matrix) has in and out
features that are multiples of 16.  The one exception is the MoE router `mlp.gate` (out = number
of experts = 4), which NVFP4 recipes leave unquantized; its input dim is still 64.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

# ---------------------------------------------------------------------------------------------
# Sizes and special tokens
# ---------------------------------------------------------------------------------------------

VOCAB_SIZE = 512
HIDDEN_SIZE = 64
INTERMEDIATE_SIZE = 128
MOE_INTERMEDIATE_SIZE = 64
NUM_EXPERTS = 4
NUM_EXPERTS_PER_TOK = 2
NUM_HIDDEN_LAYERS = 2
NUM_ATTENTION_HEADS = 4
NUM_KEY_VALUE_HEADS = 2
HEAD_DIM = 16
MAX_POSITION_EMBEDDINGS = 512

PAD_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN]  # ids 0, 1, 2
PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID = 0, 1, 2

ARCHS = ("llama", "qwen3", "qwen3_moe", "deepseek_v3", "deepseek_v32", "glm_moe_dsa")
# The DeepSeek-style families: MLA (latent KV), DSA (indexer + top-k), DeepSeek MoE routing.
MLA_ARCHS = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa")
DSA_ARCHS = ("deepseek_v32", "glm_moe_dsa")

# MLA / DSA / DeepSeek-MoE sizes (multiples of 16 for NVFP4, except routers and the indexer's
# per-head weights, which recipes keep in BF16).
KV_LORA_RANK = 32
Q_LORA_RANK = 32
QK_NOPE_HEAD_DIM = 16
QK_ROPE_HEAD_DIM = 16
V_HEAD_DIM = 16
NUM_ROUTED_EXPERTS = 8
NUM_EXPERT_GROUPS = 2
INDEX_TOPK = 16  # below the parity prompts' lengths, so selection really is sparse there
INDEX_HEAD_DIM = 32
INDEX_N_HEADS = 8
DEEPSEEK_LAYERS = 3  # layer 0 dense (first_k_dense_replace = 1), layers 1-2 MoE
# DeepSeek-V3's published rope: YaRN with mscale (factor and original length scaled down).
YARN_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}

# Std of the re-initialised weights (transformers' default is 0.02).  With 0.1 everywhere the
# next-token distribution is nearly uniform (entropy ~5.9 of log(512) = 6.24 nats); these values
# give a mean entropy of ~3.3 nats with max-probabilities from ~0.1 to ~0.8 across positions, for
# all three archs (qwen3 ties lm_head to the embedding, so both share EMBED_STD).
LINEAR_STD = 0.15
EMBED_STD = 0.35

# ChatML.  Roles: system, user, assistant; `add_generation_prompt` opens an assistant turn.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('Unsupported role: ' + message['role']) -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

# A few KB of fixed English, Python and math text: enough for 253 BPE merges.
CORPUS = r'''
The quick brown fox jumps over the lazy dog. A model is only as good as the data it was trained on,
and a quantized model is only as good as the calibration data used to measure it. We measure the
KL divergence between the original model and the quantized copy on held-out prompts, one token at
a time, and report the mean, the median and the worst positions.

Once upon a time there was a small language model that lived on a laptop. It could not write
poems, but it could count, and it could tell the difference between a list and a dictionary. Every
morning it read the same short book, and every evening it forgot most of it again.

The weather today is cloudy with a chance of rain in the afternoon. Temperatures will reach twenty
degrees in the city and fifteen degrees near the coast. Tomorrow should be sunny and warmer, with a
light wind from the west.

Please answer the following question. What is the capital of France? The capital of France is
Paris. What is the largest planet in the solar system? The largest planet is Jupiter. How many days
are there in a week? There are seven days in a week.

def fibonacci(n: int) -> int:
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def mean(values: list[float]) -> float:
    if not values:
        raise ValueError("mean of an empty list")
    return sum(values) / len(values)


class Counter:
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def add(self, key: str) -> None:
        self.counts[key] = self.counts.get(key, 0) + 1

    def most_common(self, k: int = 3) -> list[tuple[str, int]]:
        return sorted(self.counts.items(), key=lambda kv: (-kv[1], kv[0]))[:k]


import math

for i in range(10):
    print(i, i * i, math.sqrt(i), fibonacci(i))

with open("data.txt", encoding="utf-8") as f:
    lines = [line.strip() for line in f if line.strip()]

Let x = 3 and y = 4. Then x + y = 7, x * y = 12 and x^2 + y^2 = 25 = 5^2.
The derivative of f(x) = x^2 is f'(x) = 2x, and the integral of 2x dx is x^2 + C.
For all integers n >= 1, 1 + 2 + ... + n = n(n + 1) / 2.
The quadratic formula: x = (-b +- sqrt(b^2 - 4ac)) / (2a).
Euler's identity: e^(i*pi) + 1 = 0. The sum of the angles in a triangle is 180 degrees.
If p is prime and p divides ab, then p divides a or p divides b.
KL(P || Q) = sum_i p_i * log(p_i / q_i) >= 0, with equality if and only if P = Q.
The softmax of a vector z is exp(z_i) / sum_j exp(z_j); its entropy is at most log(n).
2 + 2 = 4, 10 - 3 = 7, 6 * 7 = 42, 81 / 9 = 9, 2^10 = 1024, 3.14159 is close to pi.

User: Can you write a function that reverses a string?
Assistant: Sure. In Python you can write `def reverse(s): return s[::-1]`, which uses slicing.
User: Thank you! What does the [::-1] mean?
Assistant: It is a slice with a step of minus one, so it walks the string from the end to the start.

The history of computing is a history of making machines smaller, faster and cheaper. The first
computers filled whole rooms; today a phone in your pocket is thousands of times more powerful.
Numbers are stored in binary, as ones and zeros, and floating point numbers trade precision for
range. A four bit float can only represent sixteen different values, so every group of sixteen
weights shares one scale, and the scales themselves are stored in eight bits.
'''


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


def _train_bpe() -> Tokenizer:
    """Train the byte-level BPE on CORPUS (deterministic: same merges on every run)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        show_progress=False,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS.strip().split("\n\n"), trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"trained vocab has {tok.get_vocab_size()} tokens, want {VOCAB_SIZE}")
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != i:
            raise RuntimeError(f"special token {t!r} got id {tok.token_to_id(t)}, want {i}")
    return tok


def build_tokenizer(out_dir: Path) -> transformers.PreTrainedTokenizerFast:
    """Train the tiny tokenizer, save it into `out_dir` and return it."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=_train_bpe(),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        model_max_length=MAX_POSITION_EMBEDDINGS,
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )
    tokenizer.save_pretrained(out_dir)
    return tokenizer


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------


def _common_kwargs() -> dict:
    return dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_HIDDEN_LAYERS,
        num_attention_heads=NUM_ATTENTION_HEADS,
        num_key_value_heads=NUM_KEY_VALUE_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        initializer_range=LINEAR_STD,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=PAD_TOKEN_ID,
    )


def _config(arch: str) -> transformers.PretrainedConfig:
    common = _common_kwargs()
    if arch == "llama":
        return transformers.LlamaConfig(**common, tie_word_embeddings=False)
    if arch == "qwen3":
        return transformers.Qwen3Config(**common, tie_word_embeddings=True)
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common,
            tie_word_embeddings=False,
            moe_intermediate_size=MOE_INTERMEDIATE_SIZE,
            num_experts=NUM_EXPERTS,
            num_experts_per_tok=NUM_EXPERTS_PER_TOK,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    if arch in MLA_ARCHS:
        return _deepseek_config(arch, common)
    raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")


def _deepseek_config(arch: str, common: dict, num_layers: int = DEEPSEEK_LAYERS) -> transformers.PretrainedConfig:
    """deepseek_v3 without q_lora_rank (the V2-Lite form) and with YaRN; deepseek_v32 with
    q_lora_rank, YaRN and the DSA indexer; glm_moe_dsa with the indexer on layers 0 and 2 and
    layer 1 reusing layer 0's selection ("shared")."""
    mla = {k: v for k, v in common.items() if k not in ("head_dim", "num_key_value_heads")}
    mla.update(
        num_hidden_layers=num_layers,
        num_key_value_heads=NUM_ATTENTION_HEADS,
        tie_word_embeddings=False,
        kv_lora_rank=KV_LORA_RANK,
        q_lora_rank=Q_LORA_RANK,
        qk_nope_head_dim=QK_NOPE_HEAD_DIM,
        qk_rope_head_dim=QK_ROPE_HEAD_DIM,
        v_head_dim=V_HEAD_DIM,
        moe_intermediate_size=MOE_INTERMEDIATE_SIZE // 2,
        n_routed_experts=NUM_ROUTED_EXPERTS,
        num_experts_per_tok=NUM_EXPERTS_PER_TOK,
        n_group=NUM_EXPERT_GROUPS,
        topk_group=1,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        first_k_dense_replace=1,
        rms_norm_eps=1e-5,  # not the 1e-6 MLA's latent norms always use: a mix-up shows
    )
    if arch == "deepseek_v3":
        mla.update(q_lora_rank=None, rope_parameters=dict(YARN_ROPE), rope_interleave=True)
        return transformers.DeepseekV3Config(**mla)
    mla.update(index_topk=INDEX_TOPK, index_head_dim=INDEX_HEAD_DIM, index_n_heads=INDEX_N_HEADS)
    if arch == "deepseek_v32":
        return transformers.DeepseekV32Config(**mla, rope_parameters=dict(YARN_ROPE))
    # layers 0 and 2 run the indexer, 1 reuses 0's; longer stacks alternate, ending on a full layer
    indexer_types = ["full" if i % 2 == 0 or i == num_layers - 1 else "shared" for i in range(num_layers)]
    return transformers.GlmMoeDsaConfig(**mla, indexer_types=indexer_types)


def _make_model(
    arch: str, seed: int, config: transformers.PretrainedConfig | None = None, auto=transformers.AutoModelForCausalLM
) -> transformers.PreTrainedModel:
    """Build the model in float32 from a fixed seed, re-initialise, and cast to bfloat16."""
    config = config or _config(arch)
    torch.manual_seed(seed)
    model = auto.from_config(config, dtype=torch.float32)
    # Re-draw every weight from our own generator, in parameter-name order, so the values do not
    # depend on transformers' init internals.  Norm weights stay at 1.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("norm.weight"):
                continue
            std = EMBED_STD if ("embed_tokens" in name or "lm_head" in name) else LINEAR_STD
            param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * std)
        # DeepSeek routers' selection bias is a buffer: random too, so that it changes the choice.
        for name, buffer in sorted(model.named_buffers(), key=lambda kv: kv[0]):
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=gen, dtype=torch.float32) * 0.1)
    model = model.to(torch.bfloat16).eval()
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID
    )
    return model


def _write(out_dir: Path, seed: int, config: transformers.PretrainedConfig) -> Path:
    """A causal LM of `config` (seeded weights) and the tokenizer, in `out_dir`."""
    out_dir = Path(out_dir)
    _make_model(config.model_type, seed, config).save_pretrained(out_dir)
    build_tokenizer(out_dir)
    return out_dir


def build_model(out_dir: Path, arch: str, seed: int = 0) -> Path:
    """Write a tiny `arch` checkpoint (config, safetensors, tokenizer, generation config)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = _make_model(arch, seed)
    # transformers 5 always writes safetensors (`safe_serialization` is gone from the signature).
    model.save_pretrained(out_dir)
    build_tokenizer(out_dir)
    if not (out_dir / "model.safetensors").is_file():
        raise RuntimeError(f"save_pretrained did not write {out_dir / 'model.safetensors'}")
    return out_dir


# The real releases' layer counts: transformers' MtpModel finds the MTP layers by their real index
# (its `_keys_to_ignore_on_load_unexpected` pattern), so the main stacks are this deep.
def _add_mtp_glue(weights: dict[str, torch.Tensor], model: str, index: int, seed: int) -> None:
    """Make decoder layer `index` under `model` (`model.` or a VLM's `model.language_model.`) a
    DeepSeek-layout MTP block: `enorm`, `hnorm`, `eh_proj`, `shared_head.norm` and copies of the
    embedding and the head."""
    gen = torch.Generator().manual_seed(seed + 1)
    prefix = f"{model}layers.{index}."
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        weights[f"{prefix}{norm}.weight"] = torch.ones(HIDDEN_SIZE, dtype=torch.bfloat16)
    eh_proj = torch.randn(HIDDEN_SIZE, 2 * HIDDEN_SIZE, generator=gen) * LINEAR_STD
    weights[f"{prefix}eh_proj.weight"] = eh_proj.to(torch.bfloat16)
    weights[f"{prefix}embed_tokens.weight"] = weights[f"{model}embed_tokens.weight"].clone()
    weights[f"{prefix}shared_head.head.weight"] = weights["lm_head.weight"].clone()


MTP_MAIN_LAYERS = {"deepseek_v3": 61, "deepseek_v32": 61, "glm_moe_dsa": 78}


def build_mtp_model(
    out_dir: Path,
    arch: str,
    seed: int = 0,
    residual_scale: float = 1.0,
    release_depth: bool = False,
    vllm_cpu_shapes: bool = False,
) -> Path:
    """A tiny `arch` checkpoint with one MTP layer stored as DeepSeek and GLM release it:
    `model.layers.{N}.*` after the N main layers, the decoder block (MoE) plus `enorm`, `hnorm`,
    `eh_proj`, `shared_head.norm` and copies of the embedding and the head; the config declares
    `num_nextn_predict_layers: 1`.  Built as an N+1-layer model whose last layer becomes the block.
    N is DEEPSEEK_LAYERS, or with `release_depth` the release's (61, or 78 for GLM-5), which
    transformers' own `MtpModel.from_pretrained` needs: it finds the layers by that number.
    `vllm_cpu_shapes`: MLA in shapes vLLM's CPU kernels take (`kv_lora_rank + qk_rope_head_dim`
    = 320, one of its MLA head sizes; head dims a multiple of 32) and DeepSeek-V3's release router
    keys (`topk_method: noaux_tc`, sigmoid scores), which vLLM reads.

    `residual_scale` multiplies every main layer's attention and MLP output projections: at 0 the
    next token is a fixed function of the current one and greedy text walks a short cycle that an
    MTP layer can learn (its random one does not know it); small values keep it mostly so."""
    if arch not in MTP_MAIN_LAYERS:
        raise ValueError(f"no MTP layout for {arch!r}; expected one of {sorted(MTP_MAIN_LAYERS)}")
    from safetensors.torch import load_file

    main = MTP_MAIN_LAYERS[arch] if release_depth else DEEPSEEK_LAYERS
    config = _deepseek_config(arch, _common_kwargs(), num_layers=main + 1)
    if vllm_cpu_shapes:
        config.qk_nope_head_dim, config.v_head_dim, config.kv_lora_rank = 32, 32, 256
        config.qk_rope_head_dim = config.head_dim = 64
        config.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _make_model(arch, seed, config).save_pretrained(out_dir)
    build_tokenizer(out_dir)
    weights = load_file(out_dir / "model.safetensors")
    _add_mtp_glue(weights, "model.", main, seed)
    if residual_scale != 1.0:
        for name in list(weights):
            layer, _, rest = name.removeprefix("model.layers.").partition(".")
            outputs = rest == "self_attn.o_proj.weight" or (
                rest.startswith("mlp.") and rest.endswith("down_proj.weight")
            )
            if name.startswith("model.layers.") and int(layer) < main and outputs:
                weights[name] = (weights[name].float() * residual_scale).to(weights[name].dtype)
    save_file(weights, out_dir / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((out_dir / "config.json").read_text())
    raw["num_hidden_layers"] = main
    for key in ("mlp_layer_types", "layer_types", "indexer_types"):
        if raw.get(key):
            raw[key] = raw[key][:main]
    raw["num_nextn_predict_layers"] = 1
    if vllm_cpu_shapes:
        raw.update(topk_method="noaux_tc", scoring_func="sigmoid")
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    return out_dir


def mtp_speculator_settings(**overrides):
    """`--draft mtp` settings sized for the tiny MTP models: a few dozen generated sequences, enough
    epochs for a layer to learn a residual_scale=0 model's walk, a few held-out prompts."""
    from onboard.recipes import SpeculatorSettings

    settings = dict(
        draft="mtp",
        traffic="chat",
        num_prompts=8,
        responses_per_prompt=2,
        max_new_tokens=24,
        max_prompt_tokens=128,
        generation_concurrency=16,
        stdlib_files=0,
        num_speculative_tokens=2,
        epochs=12,
        learning_rate=3e-3,
        batch_sequences=4,
        max_seq_len=128,
        eval_prompts=3,
        eval_max_tokens=20,
    )
    return SpeculatorSettings(**{**settings, **overrides})


def build_pickle_only(out_dir: Path) -> Path:
    """The tiny llama, but with its weights in a pickled `pytorch_model.bin` and no safetensors."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = _make_model("llama", seed=0)
    # transformers 5 cannot save pickle any more, so write the legacy file by hand.
    model.config.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    state_dict = {k: v.contiguous() for k, v in model.state_dict().items()}
    torch.save(state_dict, out_dir / "pytorch_model.bin")
    build_tokenizer(out_dir)
    return out_dir


def build_unknown_arch(out_dir: Path) -> Path:
    """A checkpoint dir whose architecture no library knows (`notamodel`)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["NotAModelForCausalLM"],
        "model_type": "notamodel",
        "hidden_size": 16,
        "num_hidden_layers": 1,
        "vocab_size": 32,
        "dtype": "bfloat16",
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "model.embed_tokens.weight": torch.randn(32, 16, generator=gen).to(torch.bfloat16),
        "model.layers.0.proj.weight": torch.randn(16, 16, generator=gen).to(torch.bfloat16),
    }
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


QWEN3_5_LINEAR = dict(
    layer_types=["linear_attention", "full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=HEAD_DIM,
    linear_value_head_dim=HEAD_DIM,
)


# A vision tower as small as transformers builds one: what the tests need of it is that it is
# carried byte for byte and never quantized.
QWEN3_5_VISION = dict(
    depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=HIDDEN_SIZE, patch_size=4
)
# What a VLM release ships beside its weights for the image processor (kept in the artifact).
PREPROCESSOR_CONFIG = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 4, "merge_size": 2}


def qwen3_5_text_config(moe: bool = False) -> transformers.PretrainedConfig:
    if not moe:
        return transformers.Qwen3_5TextConfig(**_common_kwargs(), tie_word_embeddings=False, **QWEN3_5_LINEAR)
    return transformers.Qwen3_5MoeTextConfig(
        **_common_kwargs(),
        tie_word_embeddings=False,
        **QWEN3_5_LINEAR,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=NUM_EXPERTS_PER_TOK,
        moe_intermediate_size=MOE_INTERMEDIATE_SIZE,
        shared_expert_intermediate_size=MOE_INTERMEDIATE_SIZE,
    )


def build_qwen3_5(out_dir: Path, seed: int = 0, moe: bool = False) -> Path:
    """A whole tiny Qwen3.5 release as the Hub ships it (`Qwen3_5ForConditionalGeneration`, or
    `Qwen3_5MoeForConditionalGeneration` with routed experts and a sigmoid-gated shared expert):
    the text model under `model.language_model.` (one Gated DeltaNet layer, then one output-gated
    full-attention layer with partial rotary), a vision tower under `model.visual.`, an MTP module
    under `mtp.*` counted by `text_config.mtp_num_hidden_layers`, and a preprocessor config."""
    text = qwen3_5_text_config(moe)
    family = transformers.models.qwen3_5_moe if moe else transformers.models.qwen3_5
    vision = (family.Qwen3_5MoeVisionConfig if moe else family.Qwen3_5VisionConfig)(**QWEN3_5_VISION)
    config_class = transformers.Qwen3_5MoeConfig if moe else transformers.Qwen3_5Config
    config = config_class(text_config=text.to_dict(), vision_config=vision.to_dict(), tie_word_embeddings=False)
    out_dir = Path(out_dir)
    _make_model(config.model_type, seed, config, transformers.AutoModelForImageTextToText).save_pretrained(out_dir)
    build_tokenizer(out_dir)
    (out_dir / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=2) + "\n")
    _add_qwen_mtp(out_dir, seed, text)
    return out_dir


def build_qwen3_5_moe(out_dir: Path, seed: int = 0) -> Path:
    return build_qwen3_5(out_dir, seed, moe=True)


def build_qwen3_next(out_dir: Path, seed: int = 0) -> Path:
    """A tiny Qwen3-Next (`Qwen3NextForCausalLM`, text only): Qwen3.5-MoE's layers with Gated
    DeltaNet's fused `in_proj_qkvz`/`in_proj_ba` (two value heads per key head, so the per-group
    regrouping shows), a dense MLP on layer 0 (`mlp_only_layers`) and routed experts with the gated
    shared expert on layer 1."""
    config = transformers.Qwen3NextConfig(
        **_common_kwargs(),
        tie_word_embeddings=False,
        **QWEN3_5_LINEAR,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=NUM_EXPERTS_PER_TOK,
        moe_intermediate_size=MOE_INTERMEDIATE_SIZE,
        shared_expert_intermediate_size=MOE_INTERMEDIATE_SIZE,
        mlp_only_layers=[0],
    )
    return _write(out_dir, seed, config)


def build_glm4_moe_lite(out_dir: Path, seed: int = 0) -> Path:
    """A tiny GLM-4.7-Flash (`Glm4MoeLiteForCausalLM`): DeepSeek-V3's MLA with a query latent and
    its MoE (`mlp_layer_types`: layer 0 dense), in DeepSeek-V3.2's fixture sizes, interleaved rope."""
    mla = {k: v for k, v in _deepseek_config("deepseek_v32", _common_kwargs()).to_dict().items()}
    keep = set(transformers.Glm4MoeLiteConfig().to_dict()) - {"architectures", "model_type", "transformers_version"}
    config = transformers.Glm4MoeLiteConfig(**{k: v for k, v in mla.items() if k in keep and not k.startswith("index")})
    return _write(out_dir, seed, config)


def build_minimax_m2(out_dir: Path, seed: int = 0) -> Path:
    """A tiny MiniMax-M2 (`MiniMaxM2ForCausalLM`): RMSNorms over the whole q and k projections,
    half-rotary heads, and in every layer a sigmoid router with a random selection bias over 8
    experts stored under Mixtral's names (`block_sparse_moe.experts.E.w1/w3/w2`). config.json also
    carries the release's keys transformers does not read and vLLM does (`rotary_dim`,
    `scoring_func`, `use_routing_bias`: without the last vLLM drops the selection bias)."""
    config = transformers.MiniMaxM2Config(
        **{**_common_kwargs(), "intermediate_size": MOE_INTERMEDIATE_SIZE},
        num_local_experts=NUM_ROUTED_EXPERTS,
        num_experts_per_tok=NUM_EXPERTS_PER_TOK,
        rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5},
        tie_word_embeddings=False,
        rotary_dim=HEAD_DIM // 2,
        scoring_func="sigmoid",
        use_routing_bias=True,
    )
    return _write(out_dir, seed, config)


def build_gpt_oss(out_dir: Path, seed: int = 0) -> Path:
    """A tiny gpt-oss (`GptOssForCausalLM`): a learned sink per head, a 16-token sliding layer then
    a full one, q/k/v/o biases, YaRN, and a biased router over 8 clamped experts stored as 3-D
    tensors with biases (gate and up interleaved), as transformers saves them."""
    config = transformers.GptOssConfig(
        **{**_common_kwargs(), "intermediate_size": MOE_INTERMEDIATE_SIZE},
        num_local_experts=NUM_ROUTED_EXPERTS,
        num_experts_per_tok=NUM_EXPERTS_PER_TOK,
        sliding_window=16,
        tie_word_embeddings=False,
    )
    return _write(out_dir, seed, config)


def build_gemma3_text(out_dir: Path, seed: int = 0) -> Path:
    """A tiny Gemma 3 text model (`Gemma3ForCausalLM`: sandwich norms, zero-centred norms, scaled
    embeddings): a family the engine does not serve."""
    config = transformers.Gemma3TextConfig(**_common_kwargs(), sliding_window=16, tie_word_embeddings=True)
    return _write(out_dir, seed, config)


def _add_qwen_mtp(out_dir: Path, seed: int, text: transformers.PretrainedConfig) -> None:
    """One MTP layer as Qwen3.5 releases it, in its own shard: an `mtp.` module beside `model.`
    (`fc` over the normed embedding and hidden state, one full-attention decoder layer of the text
    model's kind, experts stored one by one, a final norm), counted by the text config's
    `mtp_num_hidden_layers` (transformers drops both on load)."""
    family = transformers.models.qwen3_5_moe.modeling_qwen3_5_moe if text.model_type.endswith("moe_text") else None
    family = family or transformers.models.qwen3_5.modeling_qwen3_5
    layer_class = next(getattr(family, n) for n in dir(family) if n.endswith("DecoderLayer"))
    torch.manual_seed(seed + 1)
    layer = layer_class(text, layer_idx=text.layer_types.index("full_attention"))
    gen = torch.Generator().manual_seed(seed + 1)
    tensors: dict[str, torch.Tensor] = {}
    for name, param in sorted(layer.state_dict().items()):
        value = param.float() if name.endswith("norm.weight") else torch.randn(param.shape, generator=gen) * LINEAR_STD
        if name.endswith("experts.gate_up_proj"):  # the Hub stores experts one by one
            for e, (gate, up) in enumerate(zip(*value.chunk(2, dim=1), strict=True)):
                tensors[f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight"] = gate
                tensors[f"mtp.layers.0.mlp.experts.{e}.up_proj.weight"] = up
        elif name.endswith("experts.down_proj"):
            for e, down in enumerate(value):
                tensors[f"mtp.layers.0.mlp.experts.{e}.down_proj.weight"] = down
        else:
            tensors[f"mtp.layers.0.{name}"] = value
    tensors["mtp.fc.weight"] = torch.randn(HIDDEN_SIZE, 2 * HIDDEN_SIZE, generator=gen) * LINEAR_STD
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = torch.zeros(HIDDEN_SIZE)  # zero-centred: a scale of 1
    tensors = {name: value.to(torch.bfloat16).contiguous() for name, value in tensors.items()}
    save_file(tensors, str(out_dir / "mtp.safetensors"), {"format": "pt"})
    (out_dir / "model.safetensors").rename(out_dir / "model-00001-of-00001.safetensors")
    with safe_open(str(out_dir / "model-00001-of-00001.safetensors"), framework="pt") as handle:
        names = {name: "model-00001-of-00001.safetensors" for name in handle.keys()}  # noqa: SIM118
    index = {"metadata": {}, "weight_map": {**names, **{name: "mtp.safetensors" for name in tensors}}}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    config = json.loads((out_dir / "config.json").read_text())
    config["text_config"]["mtp_num_hidden_layers"] = 1
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


# GLM-5.3-Flash's text model, small: two KDA layers, then a DSA layer that runs the pooled indexer
# and one that shares its selection; layer 0 dense, the rest MoE (8 experts in 2 groups, top 2);
# clamps that bind (random activations reach a few units); 4 hyper-connection streams.
GLM5_NEXT_TEXT = dict(
    layer_types=["linear_attention", "linear_attention", "deepseek_sparse_attention", "deepseek_sparse_attention"],
    indexer_types=["full", "full", "full", "shared"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    num_attention_heads=NUM_ATTENTION_HEADS,
    num_key_value_heads=NUM_ATTENTION_HEADS,
    kv_lora_rank=KV_LORA_RANK,
    q_lora_rank=Q_LORA_RANK,
    qk_nope_head_dim=QK_NOPE_HEAD_DIM,
    qk_rope_head_dim=0,
    v_head_dim=V_HEAD_DIM,
    moe_intermediate_size=MOE_INTERMEDIATE_SIZE // 2,
    n_routed_experts=NUM_ROUTED_EXPERTS,
    num_experts_per_tok=NUM_EXPERTS_PER_TOK,
    n_group=NUM_EXPERT_GROUPS,
    topk_group=1,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    index_topk=8,  # two pools of 4 and the visible tail: sparse from 12 keys on
    index_kpool=4,
    index_head_dim=INDEX_HEAD_DIM,
    index_n_heads=INDEX_N_HEADS,
    swiglu_limit=1.5,
    linear_num_heads=4,
    linear_head_dim=HEAD_DIM,
    linear_conv_kernel_dim=4,
    hc_mult=4,
    hc_sinkhorn_iters=3,
)
GLM5_NEXT_VISION = dict(
    depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=HIDDEN_SIZE, patch_size=4,
    projection_intermediate_size=64,
)  # fmt: skip


def build_glm5_next(out_dir: Path, seed: int = 0) -> Path:
    """A tiny GLM-5.3-Flash release as the Hub ships it (`Glm5NextForConditionalGeneration`): the
    text model under `model.language_model.` (`GLM5_NEXT_TEXT`), a vision tower under
    `model.visual.`, a preprocessor config, and one MTP layer in the DeepSeek layout,
    `model.language_model.layers.{N}.*` (a residual DSA decoder block with its MoE, no
    hyper-connections, as the release's next-N layer is; plus `enorm`, `hnorm`, `eh_proj`,
    `shared_head.norm` and copies of the embedding and the head), counted by
    `text_config.num_nextn_predict_layers`.  Built as an N+1-layer model whose last layer becomes
    the block."""
    glm = transformers.models.glm5_next
    main = len(GLM5_NEXT_TEXT["layer_types"])
    text = dict(_common_kwargs(), tie_word_embeddings=False, **GLM5_NEXT_TEXT)
    for key in ("head_dim", "intermediate_size"):
        text.pop(key)
    text.update(num_hidden_layers=main + 1, intermediate_size=INTERMEDIATE_SIZE)
    for key, last in (
        ("layer_types", "deepseek_sparse_attention"),
        ("indexer_types", "full"),
        ("mlp_layer_types", "sparse"),
    ):
        text[key] = [*text[key], last]
    config = glm.Glm5NextConfig(
        text_config=glm.Glm5NextTextConfig(**text).to_dict(),
        vision_config=glm.Glm5NextVisionConfig(**GLM5_NEXT_VISION).to_dict(),
        tie_word_embeddings=False,
    )
    out_dir = Path(out_dir)
    _make_model(config.model_type, seed, config, transformers.AutoModelForImageTextToText).save_pretrained(out_dir)
    build_tokenizer(out_dir)
    (out_dir / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=2) + "\n")
    from safetensors.torch import load_file

    weights = load_file(out_dir / "model.safetensors")
    _add_mtp_glue(weights, "model.language_model.", main, seed)
    for name in [n for n in weights if n.startswith(f"model.language_model.layers.{main}.hc_")]:
        del weights[name]
    save_file(weights, out_dir / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((out_dir / "config.json").read_text())
    raw["text_config"]["num_hidden_layers"] = main
    for key in ("layer_types", "indexer_types", "mlp_layer_types"):
        raw["text_config"][key] = raw["text_config"][key][:main]
    raw["text_config"]["num_nextn_predict_layers"] = 1
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    return out_dir


def build_engine_lacks(out_dir: Path) -> Path:
    """A Llama-4-shaped checkpoint dir (transformers knows `llama4`, the engine does not): only what
    is read before any stage runs, a config and one tensor in the VLM wrapper's names."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    text = {"hidden_size": 16, "num_hidden_layers": 1, "vocab_size": 32, "intermediate_size": 32}
    config = {
        "architectures": ["Llama4ForConditionalGeneration"],
        "model_type": "llama4",
        "text_config": {**text, "model_type": "llama4_text"},
        "dtype": "bfloat16",
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    weight = torch.randn(32, 16, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    save_file({"language_model.model.embed_tokens.weight": weight}, str(out_dir / "model.safetensors"))
    return out_dir
