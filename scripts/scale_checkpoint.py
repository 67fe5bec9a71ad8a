"""A random-weight checkpoint of a real family's shape and a chosen size, written shard by shard.

    python scripts/scale_checkpoint.py OUT_DIR --tokenizer DEMO_CHECKPOINT [--family F] [--layers N]

Families (`--family`):
* deepseek_v32 (the default): DeepSeek-V3.2's architecture (MLA with LoRA-compressed queries and
  latent KV, the DSA lightning indexer with its published heads and top-k, DeepSeek MoE with
  grouped routing, shared experts and dense first layers) at a width one 2-core machine can
  compute on: hidden 2048, 64 routed experts of 768, 8 per token, 16 heads.  One MoE layer is
  about 0.6 GB of bf16, so 26 layers make about 16 GB.
* qwen3_moe: issue #37's Qwen3-MoE: hidden 1024, 64 experts of 768, top-8, 25 layers make 7.9 GB.
* qwen3_5_moe: a Qwen3.5-MoE release of the same MoE (Gated DeltaNet on three layers in four, a
  sigmoid-gated shared expert), as the Hub ships it: the VLM with a small vision tower, and an
  MTP module under `mtp.*`.
* glm5_next: a GLM-5.3-Flash release (the VLM) of the same width: KDA on three layers in four,
  NoPE MLA with the pooled-key DSA indexer on the fourth, hyper-connections, 64 clamped experts.

Names and shapes are the checkpoint's own (transformers' model built on the meta device, its
conversions reverted: experts one by one).  Tensors are generated one at a time (seeded by name)
and written in 2 GB shards, so the script itself never holds more than a shard; the tokenizer is
the demo model's.
"""

import argparse
import hashlib
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

SHARD_BYTES = 2 * 10**9
STD = 0.02


def deepseek_v32(layers: int, vocab: int) -> dict:
    return {
        "architectures": ["DeepseekV32ForCausalLM"],
        "model_type": "deepseek_v32",
        "vocab_size": vocab,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": layers,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "n_shared_experts": 1,
        "n_routed_experts": 64,
        "num_experts_per_tok": 8,
        "n_group": 8,
        "topk_group": 4,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "first_k_dense_replace": 1,
        "q_lora_rank": 512,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "index_n_heads": 64,
        "index_head_dim": 128,
        "index_topk": 2048,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        "dtype": "bfloat16",
    }


def qwen3_moe(layers: int, vocab: int) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        **_qwen_moe_text(layers, vocab),
        "dtype": "bfloat16",
    }


def _qwen_moe_text(layers: int, vocab: int) -> dict:
    return {
        "vocab_size": vocab,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "moe_intermediate_size": 768,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "num_hidden_layers": layers,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
    }


def _vlm(architecture: str, model_type: str, text: dict) -> dict:
    """The release as the Hub ships it: `text` beside a small vision tower of the text's width."""
    vision = {"depth": 2, "hidden_size": 256, "intermediate_size": 512, "num_heads": 4, "out_hidden_size": 1024}
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "text_config": text,
        "vision_config": vision,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
    }


def qwen3_5_moe(layers: int, vocab: int) -> dict:
    text = {
        **_qwen_moe_text(layers, vocab),
        "model_type": "qwen3_5_moe_text",
        "shared_expert_intermediate_size": 768,
        "layer_types": ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)],
        "linear_num_key_heads": 8,
        "linear_num_value_heads": 16,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "partial_rotary_factor": 0.25,
        "mtp_num_hidden_layers": 1,
    }
    return _vlm("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe", text)


def glm5_next(layers: int, vocab: int) -> dict:
    """GLM-5.3-Flash's release layout (the VLM) at Qwen3-MoE's width: KDA on three layers in four,
    NoPE MLA with the pooled-key DSA indexer on every fourth, hyper-connections over four streams,
    a dense first layer, then 64 clamped SwiGLU experts of 768 (8 per token, sigmoid routing in
    groups) and a shared one. No MTP layer (its DeepSeek-layout glue is built by the tiny fixture
    only)."""
    text = {
        "model_type": "glm5_next_text",
        "vocab_size": vocab,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "moe_intermediate_size": 768,
        "num_hidden_layers": layers,
        "layer_types": ["deepseek_sparse_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)],
        "indexer_types": ["full"] * layers,
        "mlp_layer_types": ["dense"] + ["sparse"] * (layers - 1),
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "q_lora_rank": 512,
        "kv_lora_rank": 256,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 0,
        "v_head_dim": 128,
        "n_routed_experts": 64,
        "num_experts_per_tok": 8,
        "n_group": 8,
        "topk_group": 4,
        "n_shared_experts": 1,
        "routed_scaling_factor": 2.5,
        "index_topk": 512,
        "index_kpool": 4,
        "index_head_dim": 64,
        "index_n_heads": 8,
        "swiglu_limit": 7.0,
        "linear_num_heads": 16,
        "linear_head_dim": 64,
        "linear_conv_kernel_dim": 4,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 3,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
    }
    return _vlm("Glm5NextForConditionalGeneration", "glm5_next", text)


FAMILIES = {"deepseek_v32": deepseek_v32, "qwen3_moe": qwen3_moe, "qwen3_5_moe": qwen3_5_moe, "glm5_next": glm5_next}
ZERO_CENTRED_NORMS = {"qwen3_5_moe"}  # stored as w, applied as 1 + w: a zero is a scale of one


def stored_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes as the family's checkpoints store them (transformers' conversions
    reverted on the meta device: experts one by one), its MTP module included."""
    from transformers import AutoConfig
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import revert_weight_conversion

    from onboard.models.vlm import auto_model_class

    hf = AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = auto_model_class(cfg).from_config(hf, dtype=torch.bfloat16)
    model._weight_conversions = get_model_conversion_mapping(model, add_legacy=False)
    shapes = {name: tuple(t.shape) for name, t in revert_weight_conversion(model, model.state_dict()).items()}
    text = hf.get_text_config()
    if getattr(text, "mtp_num_hidden_layers", 0):  # Qwen's `mtp.` module: one full-attention layer
        decoder = model.get_decoder()
        layer = decoder.layers[text.layer_types.index("full_attention")]
        prefix = next(n for n in shapes if n.endswith("embed_tokens.weight")).removesuffix("embed_tokens.weight")
        full = text.layer_types.index("full_attention")
        for name, shape in list(shapes.items()):
            if name.startswith(f"{prefix}layers.{full}."):
                shapes["mtp.layers.0." + name.removeprefix(f"{prefix}layers.{full}.")] = shape
        hidden = text.hidden_size
        shapes["mtp.fc.weight"] = (hidden, 2 * hidden)
        for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            shapes[f"mtp.{norm}.weight"] = (hidden,)
        del decoder, layer
    return shapes


def value(name: str, shape: tuple[int, ...], zero_centred: bool = False) -> torch.Tensor:
    if name.endswith(("norm.weight", "layernorm.weight")) and "visual" not in name:
        return (torch.zeros if zero_centred else torch.ones)(shape, dtype=torch.bfloat16)
    if name.endswith(("bias", "e_score_correction_bias")):
        return torch.zeros(shape, dtype=torch.float32 if "e_score" in name else torch.bfloat16)
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * STD).to(torch.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--tokenizer", type=Path, required=True, help="a checkpoint whose tokenizer files to copy")
    parser.add_argument("--family", choices=sorted(FAMILIES), default="deepseek_v32")
    parser.add_argument(
        "--layers", type=int, default=None, help="decoder layers (default: 26, 25 for the Qwens, 24 for GLM-5.3-Flash)"
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    vocab = json.loads((args.tokenizer / "config.json").read_text())["vocab_size"]
    layers = args.layers or {"deepseek_v32": 26, "glm5_next": 24}.get(args.family, 25)
    cfg = FAMILIES[args.family](layers, vocab)
    shapes = stored_shapes(cfg)
    zero_centred = args.family in ZERO_CENTRED_NORMS
    order = sorted(shapes, key=lambda n: (".layers." in n, n))
    shards: list[list[str]] = [[]]
    size = 0
    for name in order:
        nbytes = 2 * torch.Size(shapes[name]).numel()
        if size + nbytes > SHARD_BYTES and shards[-1]:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    weight_map, total = {}, 0
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: value(name, shapes[name], zero_centred) for name in names}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, args.out / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
        print(f"{file}: {len(names)} tensors", flush=True)
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (args.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (args.out / "config.json").write_text(json.dumps(cfg, indent=2))
    for file in args.tokenizer.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy(file, args.out / file.name)
    print(f"{args.out}: {total / 1e9:.1f} GB in {len(shards)} shards, {layers} layers")


if __name__ == "__main__":
    main()
