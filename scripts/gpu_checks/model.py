"""The random-weight model of a real shape: its transformers config, a word-level tokenizer of
exactly its vocabulary, random prompts, and the build phase that makes the checkpoint on the device
(in /dev/shm when it fits) and measures that its logits are not degenerate."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from .context import CheckContext
from .settings import BOS_ID, FIRST_PROMPT_ID, PAD_ID, Shape


def llama_config(shape: Shape):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.hidden_size // shape.num_attention_heads,
        hidden_act="silu",
        max_position_embeddings=shape.max_position_embeddings,
        rms_norm_eps=shape.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        initializer_range=shape.init_std,
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        # No EOS in the model's configs: transformers then never stops nor suppresses a token, and
        # the engine (ignore_eos) never stops either, so both sides decode every requested token.
        eos_token_id=None,
        pad_token_id=PAD_ID,
    )


def build_tokenizer(vocab_size: int, out_dir: Path):
    """A word-level tokenizer with exactly `vocab_size` entries ("<pad>", "<s>", "</s>", "<unk>",
    then "t4", "t5", ...), so every model id is a valid prompt id for the engine."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {token: i for i, token in enumerate(specials)}
    vocab.update({f"t{i}": i for i in range(len(specials), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=1 << 20,
        clean_up_tokenization_spaces=False,
    )
    if len(tokenizer) != vocab_size:
        raise RuntimeError(f"the tokenizer has {len(tokenizer)} entries, want {vocab_size}")
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(FIRST_PROMPT_ID, vocab_size, (length,), generator=gen).tolist() for _ in range(count)]


def greedy(max_tokens: int, logprobs: int | None = None):
    from onboard.engine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)


class BuildPhase(CheckContext):
    """The `build` phase: the random model, saved as the checkpoint every other phase loads."""

    def build(self) -> None:
        from transformers import AutoModelForCausalLM, GenerationConfig

        shape = self.shape
        config = llama_config(shape)
        self.tmp = Path(tempfile.mkdtemp(prefix="gpu_check-", dir=self.workdir(config)))
        path = self.tmp / f"random-{self.s.shape}"
        began = time.monotonic()
        torch.manual_seed(self.s.seed)
        with torch.device(self.device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        if next(model.parameters()).device.type != self.device.type:  # the context did not reach the init
            model.to(self.device)
        model.eval()
        model.generation_config = GenerationConfig(bos_token_id=BOS_ID, pad_token_id=PAD_ID)
        self.sync()
        init_s = time.monotonic() - began
        began = time.monotonic()
        model.save_pretrained(path)  # safetensors (transformers 5 writes nothing else)
        build_tokenizer(shape.vocab_size, path)
        save_s = time.monotonic() - began
        if not list(path.glob("*.safetensors")):
            raise RuntimeError(f"save_pretrained wrote no safetensors into {path}")
        self.hf, self.path = model, path
        params = sum(p.numel() for p in model.parameters())
        logits = self._hf_logits(random_prompts(1, self.s.prompt_tokens, shape.vocab_size, self.s.seed)[0])
        probs = logits.softmax(-1)
        self.report["model"] = {
            "path": str(path),
            "parameters": params,
            "parameters_b": round(params / 1e9, 3),
            "checkpoint_gib": round(sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2**30, 2),
            "init_s": round(init_s, 2),
            "save_s": round(save_s, 2),
            # Not degenerate: logits spread, a next-token distribution far from uniform.
            "logit_std": round(float(logits.std()), 4),
            "mean_entropy_nats": round(float(-(probs * probs.clamp_min(1e-30).log()).sum(-1).mean()), 4),
            "uniform_entropy_nats": round(float(torch.log(torch.tensor(float(shape.vocab_size)))), 4),
        }

    def workdir(self, text) -> str | None:
        """`--workdir`, else /dev/shm when the bf16 checkpoint and the quantized artifacts fit there
        with room to spare (no disk write of 16 GB, and the engine loads from memory), else the
        system's temporary directory."""
        if self.s.workdir is not None:
            return str(self.s.workdir)
        layer = 4 * text.hidden_size**2 * (1 + text.num_key_value_heads / text.num_attention_heads) / 2
        layer += 3 * text.hidden_size * text.intermediate_size
        linears, outer = text.num_hidden_layers * layer, 2 * text.vocab_size * text.hidden_size
        size = 2 * (linears + outer)  # bf16 bytes
        # The artifacts (embeddings and lm_head stay bf16): FP8 one byte a weight, NVFP4 4.5 bits.
        # Each is removed after its phase unless --keep.
        artifacts = [
            bytes_
            for phase, bytes_ in (("parity_fp8", linears + 2 * outer), ("parity_nvfp4", 0.5625 * linears + 2 * outer))
            if phase in self.s.phases
        ]
        size += sum(artifacts) if self.s.keep else max(artifacts, default=0)
        shm = Path("/dev/shm")
        with contextlib.suppress(OSError):
            if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 1.25 * size + 2**32:
                return str(shm)
        return None
