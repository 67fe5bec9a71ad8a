"""A random-weight DeepSeek-V3.2-shaped checkpoint of a chosen size, written shard by shard.

    python scripts/scale_checkpoint.py OUT_DIR --tokenizer DEMO_CHECKPOINT [--layers 26]

DeepSeek-V3.2's architecture (MLA with LoRA-compressed queries and latent KV, the DSA lightning
indexer with its published heads and top-k, DeepSeek MoE with grouped routing, shared experts and
dense first layers) at a width one 2-core machine can compute on: hidden 2048, 64 routed experts
of 768, 8 per token, 16 heads.  One MoE layer is about 0.6 GB of bf16, so 26 layers make about
16 GB.  Tensors are generated one at a time (seeded by name) and written in 2 GB shards, so the
script itself never holds more than a shard; the tokenizer is the demo model's.
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


def config(layers: int, vocab: int) -> dict:
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


def stored_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes as DeepSeek checkpoints store them (experts one by one)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf, dtype=torch.bfloat16)
    shapes = {}
    for name, tensor in model.state_dict().items():
        prefix, _, leaf = name.rpartition("mlp.experts.")
        if leaf == "gate_up_proj":
            experts, rows, cols = tensor.shape
            for e in range(experts):
                shapes[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = (rows // 2, cols)
                shapes[f"{prefix}mlp.experts.{e}.up_proj.weight"] = (rows // 2, cols)
        elif leaf == "down_proj":
            for e in range(tensor.shape[0]):
                shapes[f"{prefix}mlp.experts.{e}.down_proj.weight"] = tuple(tensor.shape[1:])
        else:
            shapes[name] = tuple(tensor.shape)
    return shapes


def value(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    if name.endswith(("norm.weight", "layernorm.weight")):
        return torch.ones(shape, dtype=torch.bfloat16)
    if name.endswith(("bias", "e_score_correction_bias")):
        return torch.zeros(shape, dtype=torch.float32 if "e_score" in name else torch.bfloat16)
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * STD).to(torch.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--tokenizer", type=Path, required=True, help="a checkpoint whose tokenizer files to copy")
    parser.add_argument("--layers", type=int, default=26)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    vocab = json.loads((args.tokenizer / "config.json").read_text())["vocab_size"]
    cfg = config(args.layers, vocab)
    shapes = stored_shapes(cfg)
    order = sorted(shapes, key=lambda n: (n.startswith("model.layers."), n))
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
        tensors = {name: value(name, shapes[name]) for name in names}
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
    print(f"{args.out}: {total / 1e9:.1f} GB in {len(shards)} shards, {args.layers} layers")


if __name__ == "__main__":
    main()
