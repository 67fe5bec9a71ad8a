"""A tiny, seeded, random Llama written as a real GGUF file (no hub, no llama.cpp).

`build_tiny_gguf` writes what llama.cpp's `convert_hf_to_gguf.py` would write for a Llama: the
`llama.*` hyper-parameters, a byte-level BPE vocabulary under `tokenizer.ggml.*` (model "gpt2",
the same vocabulary and merges `tiny_models.build_tokenizer` trains) with a ChatML
`tokenizer.chat_template`, and the weights under GGUF names (`token_embd`, `blk.N.attn_q`, ...,
`output_norm`, `output`): matrices as F16, norms as F32, nothing quantized.

Two quirks of real files are reproduced on purpose:

* llama.cpp permutes the rows of `attn_q` / `attn_k` for its rotary layout (`_llama_permute`
  below, a copy of `LlamaModel.permute`), and transformers' GGUF loader un-permutes them. The
  HF-layout weights are kept (`tiny_gguf_state_dict`), so a test can check that the round trip
  lands every weight where it started; a random model's logits alone would not notice.
* Special tokens. The vocabulary's first ids are SmolLM2's: 0 `<|endoftext|>`, 1 `<|im_start|>`
  (bos), 2 `<|im_end|>`; there is no padding id, as in SmolLM2's file. What transformers 5.17
  makes of the ids (checked by tests/models/test_gguf.py):
  - the config takes `tokenizer.ggml.bos_token_id` / `eos_token_id` verbatim
    (`GGUF_CONFIG_MAPPING["tokenizer"]` in transformers/integrations/ggml.py);
  - the tokenizer does not: `GGUFLlamaConverter.tokenizer` (used for every `llama` file) sets
    both its bos and its eos to `tokens[bos_token_id]`, so a Llama GGUF always loads with
    eos = `<|im_start|>`. That is the mismatch `onboard.models.tokens.fix_special_tokens`
    repairs from the config, and why a converted SmolLM2 says eos = `<|im_start|>` without it.
  `eos_token_id` picks the metadata's eos id: `<|im_end|>` (the default, a correct file), or
  `GGUF_BOS_ID` for a file that really does say eos = bos (then config and tokenizer agree on
  `<|im_start|>` and there is nothing to repair).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import tiny_models
import torch

HIDDEN_SIZE = 64
NUM_LAYERS = 2
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = HIDDEN_SIZE // NUM_HEADS
FFN_SIZE = 128
CONTEXT_LENGTH = 512
ROPE_THETA = 10000.0
RMS_EPS = 1e-5
MODEL_NAME = "tiny-llama-gguf"

GGUF_BOS_ID = tiny_models.BOS_TOKEN_ID  # <|im_start|>
GGUF_EOS_ID = tiny_models.EOS_TOKEN_ID  # <|im_end|>

_LAYER_NAMES = {  # GGUF leaf name -> HF module path inside `model.layers.N`
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def vocabulary() -> tuple[list[str], list[str], list[int]]:
    """(tokens in id order, merges as "a b" strings, ggml token types) of the tiny tokenizer."""
    model = json.loads(tiny_models._train_bpe().to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    if [vocab[t] for t in tokens] != list(range(len(tokens))):
        raise RuntimeError("the tiny vocabulary's ids are not contiguous")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    special = set(tiny_models.SPECIAL_TOKENS)
    types = [int(gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL) for t in tokens]
    return tokens, merges, types


def tiny_gguf_state_dict(seed: int = 0, vocab_size: int = tiny_models.VOCAB_SIZE) -> dict:
    """The model's float32 weights in HF names and HF layout (q/k not permuted)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std

    def norm() -> torch.Tensor:
        # Not all ones, so a norm loaded into the wrong slot (or not at all) changes the logits.
        return 1.0 + rand(HIDDEN_SIZE, std=0.1)

    linear, embed = tiny_models.LINEAR_STD, tiny_models.EMBED_STD
    state = {"model.embed_tokens.weight": rand(vocab_size, HIDDEN_SIZE, std=embed)}
    for i in range(NUM_LAYERS):
        p = f"model.layers.{i}."
        state[p + "input_layernorm.weight"] = norm()
        state[p + "self_attn.q_proj.weight"] = rand(NUM_HEADS * HEAD_DIM, HIDDEN_SIZE, std=linear)
        state[p + "self_attn.k_proj.weight"] = rand(NUM_KV_HEADS * HEAD_DIM, HIDDEN_SIZE, std=linear)
        state[p + "self_attn.v_proj.weight"] = rand(NUM_KV_HEADS * HEAD_DIM, HIDDEN_SIZE, std=linear)
        state[p + "self_attn.o_proj.weight"] = rand(HIDDEN_SIZE, NUM_HEADS * HEAD_DIM, std=linear)
        state[p + "post_attention_layernorm.weight"] = norm()
        state[p + "mlp.gate_proj.weight"] = rand(FFN_SIZE, HIDDEN_SIZE, std=linear)
        state[p + "mlp.up_proj.weight"] = rand(FFN_SIZE, HIDDEN_SIZE, std=linear)
        state[p + "mlp.down_proj.weight"] = rand(HIDDEN_SIZE, FFN_SIZE, std=linear)
    state["model.norm.weight"] = norm()
    state["lm_head.weight"] = rand(vocab_size, HIDDEN_SIZE, std=embed)
    return state


def _llama_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp `convert_hf_to_gguf.py` LlamaModel.permute (transformers undoes it on load)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _gguf_tensors(state: dict) -> dict[str, np.ndarray]:
    hf_to_gguf = {}
    for name in state:
        if name.startswith("model.layers."):
            layer, module = name.removeprefix("model.layers.").split(".", 1)
            leaf = {v: k for k, v in _LAYER_NAMES.items()}[module.removesuffix(".weight")]
            hf_to_gguf[name] = f"blk.{layer}.{leaf}.weight"
    hf_to_gguf |= {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    out = {}
    for hf_name, tensor in state.items():
        gguf_name = hf_to_gguf[hf_name]
        array = tensor.numpy()
        if ".attn_q." in gguf_name:
            array = _llama_permute(array, NUM_HEADS, NUM_HEADS)
        elif ".attn_k." in gguf_name:
            array = _llama_permute(array, NUM_HEADS, NUM_KV_HEADS)
        # llama.cpp keeps 1-D tensors (norms) in F32 and writes the matrices in the file type.
        out[gguf_name] = array.astype(np.float32 if array.ndim == 1 else np.float16)
    return out


def build_tiny_gguf(path: Path, seed: int = 0, *, eos_token_id: int = GGUF_EOS_ID) -> Path:
    """Write the tiny Llama to `path` (a `.gguf` file) and return `path`. Deterministic."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens, merges, types = vocabulary()

    writer = gguf.GGUFWriter(path, "llama")  # also writes general.architecture
    writer.add_name(MODEL_NAME)
    writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16))
    writer.add_vocab_size(len(tokens))
    writer.add_context_length(CONTEXT_LENGTH)
    writer.add_embedding_length(HIDDEN_SIZE)
    writer.add_block_count(NUM_LAYERS)
    writer.add_feed_forward_length(FFN_SIZE)
    writer.add_head_count(NUM_HEADS)
    writer.add_head_count_kv(NUM_KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_layer_norm_rms_eps(RMS_EPS)

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(GGUF_BOS_ID)
    writer.add_eos_token_id(eos_token_id)  # no padding id, as in SmolLM2's file
    writer.add_add_bos_token(False)
    writer.add_chat_template(tiny_models.CHAT_TEMPLATE)

    for name, array in _gguf_tensors(tiny_gguf_state_dict(seed, len(tokens))).items():
        writer.add_tensor(name, array)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
