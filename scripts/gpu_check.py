"""A GPU check for a lent device: the reference engine on a random-weight model of a real size.

No network and no weights travel: a Llama-3-8B-shaped model (hidden 4096, 32 layers, GQA 32/8,
vocabulary 128256, rope theta 500000, bf16) is built with random weights directly on the device,
saved as a checkpoint the engine loads, and then measured against transformers on the same weights:

* throughput: the engine (fast numerics) against `transformers.generate` (greedy, 64 new tokens,
  EOS never stops either side) at concurrency 1, 16 and 64 on random prompts of 128 tokens;
* parity in float32 and bfloat16: the engine in exact numerics against transformers: teacher-forced
  logits (max |Δ logit|, top-1 agreement) and greedy continuations, one prompt at a time;
* speculative decoding's exactness: a random-weight EAGLE-3 draft (`engine.set_speculator(draft, 3)`)
  must leave greedy outputs exactly as plain greedy decoding gives them (exact numerics: token for
  token; fast numerics: the match rate is reported); the acceptance length is reported too (about
  1 with a random draft: this is an exactness check, not a speed one).

Phases run in the order that puts the pass criteria first (the build, bf16 parity, exact spec
decoding, fp32 parity, then throughput and fast spec decoding); each has a time budget, prints its
elapsed time, and a phase that would end past `--deadline` is skipped.  The JSON report (`--out`)
is rewritten after every phase, so a run cut short still leaves what it measured.

Exit status 0 when fp32 exact parity has top-1 agreement >= 0.99 and speculative decoding in
exact numerics reproduces plain greedy decoding token for token, 1 otherwise (one-line reason).

    scripts/gpu_check.sh                                   # llama3-8b shape on cuda (< 8 min on one H200)
    scripts/gpu_check.sh --shape tiny --device cpu         # the same code on the CPU (< 1 min)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without the package installed
    sys.path.insert(0, str(ROOT))

PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
FIRST_PROMPT_ID = 4  # random prompts never contain the special tokens
TOP = 5  # top-k ids compared at a greedy divergence (near-tie rule, as `onboard adapt`)
FP32_TOP1_MIN = 0.99


# ---------------------------------------------------------------------------------------------
# Shapes and settings
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    rope_theta: float
    max_position_embeddings: int
    rms_norm_eps: float
    init_std: float  # transformers' initializer_range: 0.02 gives logits of std ~1.3 at hidden 4096
    draft_vocab_size: int
    budgets: dict[str, float]  # seconds per phase
    workload: dict[str, int] = field(default_factory=dict)  # Settings defaults this shape changes


PHASES = ("build", "parity_bf16", "spec_exact", "parity_fp32", "throughput", "spec_fast")

SHAPES = {
    "llama3-8b": Shape(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        init_std=0.02,
        draft_vocab_size=32000,
        # Estimates for one H200 (model init + a 16 GB save; engine loads of 16 and 32 GB): 420 s in all.
        budgets={
            "build": 90,
            "parity_bf16": 50,
            "spec_exact": 50,
            "parity_fp32": 80,
            "throughput": 110,
            "spec_fast": 40,
        },
    ),
    "tiny": Shape(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        rope_theta=500000.0,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        # At hidden 64, 0.02 leaves the next-token distribution nearly uniform (bf16 ties everywhere).
        init_std=0.15,
        draft_vocab_size=256,
        # On 2 busy CPU cores; the speculative runs cost most (the draft runs one sequence at a time).
        budgets={
            "build": 10,
            "parity_bf16": 10,
            "spec_exact": 15,
            "parity_fp32": 10,
            "throughput": 15,
            "spec_fast": 15,
        },
        workload={"spec_tokens": 16},
    ),
}


@dataclass
class Settings:
    shape: str = "llama3-8b"
    device: str = "cuda"
    out: Path = Path("gpu_check.json")
    workdir: Path | None = None
    keep: bool = False
    seed: int = 0
    prompt_tokens: int = 128
    new_tokens: int = 64
    concurrency: list[int] = field(default_factory=lambda: [1, 16, 64])
    parity_prompts: int = 4
    parity_tokens: int = 32
    spec_prompts: int = 16
    spec_tokens: int = 32
    spec_k: int = 3
    deadline: float = 470.0  # seconds: a phase that would end later (at its budget) is skipped
    phases: list[str] = field(default_factory=lambda: list(PHASES))


# ---------------------------------------------------------------------------------------------
# The checkpoint
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# The speculator
# ---------------------------------------------------------------------------------------------


def build_draft(engine, shape: Shape, dtype: torch.dtype, seed: int):
    """A random-weight EAGLE-3 draft for the engine's model, on its device: draft vocabulary a seeded
    random subset of `shape.draft_vocab_size` target ids, auxiliary layers 2, L//2 and L-3."""
    from onboard.speculator.data import default_aux_layers
    from onboard.speculator.draft import Eagle3Draft, draft_layer_config

    text = engine.hf_config.get_text_config()
    size = min(shape.draft_vocab_size, engine.vocab_size)
    ids = torch.randperm(engine.vocab_size, generator=torch.Generator().manual_seed(seed))[:size].sort().values
    torch.manual_seed(seed)
    with torch.device(engine.config.device):  # factory calls inside (set_vocab's arange too) land there
        draft = Eagle3Draft(draft_layer_config(engine.hf_config), size, default_aux_layers(text.num_hidden_layers))
        draft.set_vocab(ids.to(engine.config.device))
        target = engine.target_tensors()
        draft.init_from_target(target["embed_tokens"], target["lm_head"], target["norm"])
        del target
    return draft.to(dtype).eval()


# ---------------------------------------------------------------------------------------------
# The check
# ---------------------------------------------------------------------------------------------


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:400]


class GpuCheck:
    def __init__(self, settings: Settings):
        self.s = settings
        self.shape = SHAPES[settings.shape]
        self.device = torch.device(settings.device)
        self.start = time.monotonic()
        self.path: Path | None = None
        self.tmp: Path | None = None
        self.hf = None  # the transformers model, on the device, in bf16 unless a phase says otherwise
        self.engines: dict[tuple[str, torch.dtype], Any] = {}
        self.report: dict[str, Any] = {
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(settings).items()},
            "shape": asdict(self.shape),
            "environment": self._environment(),
            "phases": {},
            "throughput": None,
            "parity": {},
            "spec": {},
        }

    # -- bookkeeping ------------------------------------------------------------------------------

    def _environment(self) -> dict[str, Any]:
        import transformers

        env = {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "device": str(self.device),
            "cpu_threads": torch.get_num_threads(),
        }
        if self.device.type == "cuda" and torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(self.device)
            env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(self.device).total_memory / 2**30, 1)
            env["cuda"] = torch.version.cuda
            env["matmul_allow_tf32"] = torch.backends.cuda.matmul.allow_tf32
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            env["commit"] = subprocess.run(
                ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
            ).stdout.strip()
        return env

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def write(self) -> None:
        out = Path(self.s.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(self.report, indent=2, default=str) + "\n")
        tmp.replace(out)

    def phase(self, name: str, fn: Callable[[], None]) -> None:
        budget = float(self.shape.budgets[name])
        record: dict[str, Any] = {"budget_s": budget}
        self.report["phases"][name] = record
        if name not in self.s.phases:
            record["status"] = "skipped (not selected)"
        elif name != "build" and self.path is None:
            record["status"] = "skipped (no checkpoint)"
        elif self.elapsed() + budget > self.s.deadline:
            record["status"] = (
                f"skipped (deadline: {self.elapsed():.0f} s + budget {budget:.0f} s > {self.s.deadline:.0f} s)"
            )
        else:
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            began = time.monotonic()
            try:
                fn()
                record["status"] = "ok"
            except Exception as err:  # a failed phase is a result; the others still run
                record["status"] = "error"
                record["error"] = _first_line(err)
                record["traceback"] = traceback.format_exc()[-4000:]
            self.sync()
            record["elapsed_s"] = round(time.monotonic() - began, 2)
            record["over_budget"] = record["elapsed_s"] > budget
            if self.device.type == "cuda":
                record["peak_gpu_memory_gib"] = round(torch.cuda.max_memory_allocated(self.device) / 2**30, 2)
        line = f"[gpu_check] {name:<12} {record['status']}"
        if "elapsed_s" in record:
            line += f"  {record['elapsed_s']:.1f} s (budget {budget:.0f} s{', OVER' if record['over_budget'] else ''})"
        if "error" in record:
            line += f"  {record['error']}"
        print(line + f"  [total {self.elapsed():.1f} s]", flush=True)
        self.write()

    # -- models ------------------------------------------------------------------------------------

    def engine_config(self, numerics: str):
        from onboard.engine import EngineConfig

        s = self.s
        block_size = 16
        longest = s.prompt_tokens + max(s.new_tokens, s.parity_tokens, s.spec_tokens) + s.spec_k + 1
        # Prompt + completion of every request running at once, with a quarter to spare (never preempts).
        concurrent = max([*s.concurrency, s.spec_prompts, 2])
        num_blocks = max(256, -(-concurrent * longest // block_size) * 5 // 4)
        return EngineConfig(
            device=str(self.device),
            numerics=numerics,
            block_size=block_size,
            num_blocks=num_blocks,
            max_num_seqs=max(64, concurrent),
            # Prefill of the widest batch in one step.
            max_num_batched_tokens=max(2048, concurrent * s.prompt_tokens),
            max_model_len=min(4096, self.shape.max_position_embeddings),
            # Random prompts share nothing, and exact parity wants every prompt computed in full.
            enable_prefix_caching=False,
            max_logprobs=TOP,
        )

    def engine(self, numerics: str, dtype: torch.dtype):
        """The engine in these numerics and dtype (one kept at a time: the others are freed first)."""
        from onboard.engine import LLMEngine

        key = (numerics, dtype)
        if key not in self.engines:
            self.free_engines()
            began = time.monotonic()
            self.engines[key] = LLMEngine(self.path, self.engine_config(numerics), dtype=dtype)
            self.sync()
            self.report.setdefault("engine_load_s", {})[f"{numerics}/{str(dtype).removeprefix('torch.')}"] = round(
                time.monotonic() - began, 2
            )
        return self.engines[key]

    def free_engines(self) -> None:
        self.engines.clear()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def hf_as(self, dtype: torch.dtype):
        """The transformers model in `dtype`, converted in place (bf16 -> fp32 -> bf16 is lossless)."""
        if self.hf.dtype != dtype:
            self.hf.to(dtype)
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        return self.hf

    # -- phases --------------------------------------------------------------------------------------

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
        """`--workdir`, else /dev/shm when the bf16 checkpoint fits there with room to spare (no disk
        write of 16 GB, and the engine loads from memory), else the system's temporary directory."""
        if self.s.workdir is not None:
            return str(self.s.workdir)
        layer = 4 * text.hidden_size**2 * (1 + text.num_key_value_heads / text.num_attention_heads) / 2
        layer += 3 * text.hidden_size * text.intermediate_size
        size = 2 * (text.num_hidden_layers * layer + 2 * text.vocab_size * text.hidden_size)  # bf16 bytes
        shm = Path("/dev/shm")
        with contextlib.suppress(OSError):
            if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 1.25 * size + 2**32:
                return str(shm)
        return None

    @torch.inference_mode()
    def _hf_logits(self, token_ids: list[int]) -> torch.Tensor:
        return self.hf(torch.tensor([token_ids], device=self.device)).logits[0].float()

    @torch.inference_mode()
    def _hf_greedy(self, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[list[int]]]:
        """transformers' greedy continuation on two copies of the prompt (the engine runs every linear
        on at least two rows; `onboard adapt` compares the same way) and the top-5 ids at each step."""
        out = self.hf.generate(
            torch.tensor([prompt, prompt], device=self.device),
            attention_mask=torch.ones(2, len(prompt), dtype=torch.long, device=self.device),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=PAD_ID,
            output_logits=True,
            return_dict_in_generate=True,
        )
        tokens = out.sequences[0, len(prompt) :].tolist()
        return tokens, [step[0].float().topk(TOP).indices.tolist() for step in out.logits]

    def parity(self, dtype: torch.dtype) -> None:
        from onboard.adapt.parity import compare_greedy

        name = str(dtype).removeprefix("torch.")
        self.report["parity"][name] = None
        engine = self.engine("exact", dtype)  # frees the other engine first
        self.hf_as(dtype)
        prompts = random_prompts(self.s.parity_prompts, self.s.prompt_tokens, self.shape.vocab_size, self.s.seed + 1)
        params = greedy(self.s.parity_tokens, logprobs=TOP)
        max_diff, agree, positions, kl_sum, bitwise, cases = 0.0, 0, 0, 0.0, True, []
        for prompt in prompts:
            (mine,) = engine.generate([prompt], params)
            theirs, their_top = self._hf_greedy(prompt, self.s.parity_tokens)
            mine_top = [[token for token, _ in entry["top"]] for entry in mine.logprobs]
            verdict = compare_greedy(mine.token_ids, theirs, mine_top, their_top)
            forced = prompt + theirs
            ref = self._hf_logits(forced)
            got = engine.score(forced).float().to(ref.device)
            bitwise = bitwise and torch.equal(got, ref)
            max_diff = max(max_diff, float((got - ref).abs().max()))
            agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
            positions += ref.shape[0]
            ref_lp, got_lp = ref.log_softmax(-1), got.log_softmax(-1)
            kl_sum += float((ref_lp.exp() * (ref_lp - got_lp)).sum(-1).clamp_min(0).sum())
            cases.append(
                {
                    "matched": verdict.matched,
                    "first_divergence": verdict.first_divergence,
                    "near_tie": verdict.near_tie,
                }
            )
            del ref, got, ref_lp, got_lp
        self.report["parity"][name] = {
            "numerics": "exact",
            "dtype": name,
            "num_prompts": len(prompts),
            "prompt_tokens": self.s.prompt_tokens,
            "greedy_tokens": self.s.parity_tokens,
            "max_abs_logit_diff": max_diff,
            "bitwise_equal_logits": bitwise,
            "top1_agreement": agree / positions,
            "mean_kld": kl_sum / positions,
            "num_positions": positions,
            "greedy_match_rate": sum(c["matched"] for c in cases) / len(cases),
            "mean_matched_tokens": sum(
                self.s.parity_tokens if c["first_divergence"] is None else c["first_divergence"] for c in cases
            )
            / len(cases),
            "divergences_all_near_ties": all(c["near_tie"] for c in cases),
            "cases": cases,
        }

    def spec(self, numerics: str) -> None:
        dtype = torch.bfloat16
        self.report["spec"][numerics] = None
        engine = self.engine(numerics, dtype)
        prompts = random_prompts(self.s.spec_prompts, self.s.prompt_tokens, self.shape.vocab_size, self.s.seed + 2)
        params = greedy(self.s.spec_tokens)
        engine.set_speculator(None, 0)
        began = time.monotonic()
        plain = engine.generate(prompts, params)
        self.sync()
        plain_s = time.monotonic() - began
        draft = build_draft(engine, self.shape, dtype, self.s.seed)
        result: dict[str, Any] = {
            "numerics": numerics,
            "dtype": "bfloat16",
            "num_prompts": len(prompts),
            "new_tokens": self.s.spec_tokens,
            "num_speculative_tokens": self.s.spec_k,
            "draft_vocab_size": draft.draft_vocab_size,
            "aux_layer_ids": draft.aux_layer_ids,
        }
        engine.set_speculator(draft, self.s.spec_k)
        began = time.monotonic()
        spec = engine.generate(prompts, params)
        self.sync()
        spec_s = time.monotonic() - began
        stats = engine.speculator.stats
        engine.set_speculator(None, 0)
        del draft
        total = sum(len(p.token_ids) for p in plain)
        same = sum(
            a == b for s_, p in zip(spec, plain, strict=True) for a, b in zip(s_.token_ids, p.token_ids, strict=False)
        )
        matches = [s_.token_ids == p.token_ids for s_, p in zip(spec, plain, strict=True)]
        result.update(
            {
                "exact": all(matches),
                "prompt_match_rate": sum(matches) / len(matches),
                "token_match_rate": same / total if total else 0.0,
                "num_drafts": stats.num_drafts,
                "num_draft_tokens": stats.num_draft_tokens,
                "num_accepted_tokens": stats.num_accepted_tokens,
                "accepted_per_position": list(stats.accepted_per_position),
                # Tokens emitted per verification step (1 + accepted proposals per draft).
                "acceptance_length": 1 + stats.num_accepted_tokens / stats.num_drafts if stats.num_drafts else None,
                "plain_s": round(plain_s, 3),
                "spec_s": round(spec_s, 3),
                "kv_blocks_all_free": engine.block_manager.num_free_blocks == engine.config.num_blocks,
            }
        )
        self.report["spec"][numerics] = result

    @torch.inference_mode()
    def _hf_generate(self, prompts: list[list[int]], new_tokens: int) -> torch.Tensor:
        ids = torch.tensor(prompts, device=self.device)
        return self.hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=PAD_ID,
        )[:, ids.shape[1] :]

    def throughput(self) -> None:
        s = self.s
        self.report["throughput"] = None
        self.hf_as(torch.bfloat16)
        engine = self.engine("fast", torch.bfloat16)
        warm = random_prompts(2, s.prompt_tokens, self.shape.vocab_size, s.seed + 99)
        engine.generate(warm, greedy(4))
        self._hf_generate(warm, 4)
        rows = []
        for c in s.concurrency:
            prompts = random_prompts(c, s.prompt_tokens, self.shape.vocab_size, s.seed + 100 + c)
            preemptions = engine.stats()["num_preemptions"]
            self.sync()
            began = time.monotonic()
            outs = engine.generate(prompts, greedy(s.new_tokens))
            self.sync()
            engine_s = time.monotonic() - began
            engine_tokens = sum(len(o.token_ids) for o in outs)
            began = time.monotonic()
            hf_out = self._hf_generate(prompts, s.new_tokens)
            self.sync()
            hf_s = time.monotonic() - began
            hf_tokens = hf_out.numel()
            hf_rows = hf_out.tolist()
            engine_tps, hf_tps = engine_tokens / engine_s, hf_tokens / hf_s
            rows.append(
                {
                    "concurrency": c,
                    "engine_tokens": engine_tokens,
                    "engine_s": round(engine_s, 3),
                    "engine_tps": engine_tps,
                    "hf_tokens": hf_tokens,
                    "hf_s": round(hf_s, 3),
                    "hf_tps": hf_tps,
                    "ratio": engine_tps / hf_tps,
                    # Fast numerics against bf16 transformers, batched: informative, not a criterion.
                    "same_greedy_outputs": sum(o.token_ids == h for o, h in zip(outs, hf_rows, strict=True)) / c,
                    "engine_preemptions": engine.stats()["num_preemptions"] - preemptions,
                }
            )
            self.report["throughput"] = {
                "numerics": "fast",
                "dtype": "bfloat16",
                "prompt_tokens": s.prompt_tokens,
                "new_tokens": s.new_tokens,
                "results": rows,
            }

    # -- the whole run ---------------------------------------------------------------------------------

    def run(self) -> int:
        try:
            self.phase("build", self.build)
            self.phase("parity_bf16", lambda: self.parity(torch.bfloat16))
            self.phase("spec_exact", lambda: self.spec("exact"))
            self.phase("parity_fp32", lambda: self.parity(torch.float32))
            self.phase("throughput", self.throughput)
            self.phase("spec_fast", lambda: self.spec("fast"))
        finally:
            self.free_engines()
            self.hf = None
            if self.tmp is not None and not self.s.keep:
                shutil.rmtree(self.tmp, ignore_errors=True)
        self.report["total_s"] = round(self.elapsed(), 2)
        reasons = self.verdict()
        self.report["passed"] = not reasons
        self.report["reason"] = "; ".join(reasons) if reasons else "all checks passed"
        self.write()
        print_tables(self.report)
        print(("PASS: " if not reasons else "FAIL: ") + self.report["reason"], flush=True)
        return 0 if not reasons else 1

    def verdict(self) -> list[str]:
        reasons = []
        phases = self.report["phases"]
        fp32 = self.report["parity"].get("float32")
        if not fp32:
            reasons.append(f"fp32 parity did not run ({phases.get('parity_fp32', {}).get('status', 'missing')})")
        elif fp32["top1_agreement"] < FP32_TOP1_MIN:
            reasons.append(f"fp32 exact parity top-1 agreement {fp32['top1_agreement']:.4f} < {FP32_TOP1_MIN}")
        exact = self.report["spec"].get("exact")
        if not exact:
            reasons.append(f"exact spec decoding did not run ({phases.get('spec_exact', {}).get('status', 'missing')})")
        else:
            if not exact["exact"]:
                bad = round((1 - exact["prompt_match_rate"]) * exact["num_prompts"])
                reasons.append(
                    f"spec decoding (exact numerics) differs from plain greedy on {bad}/{exact['num_prompts']} prompts"
                )
        return reasons


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------


def _num(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        if value and abs(value) < 1e-3:
            return f"{value:.{max(digits, 1)}g}"
        text = f"{value:,.{digits}f}"
        return text.rstrip("0").rstrip(".") if "." in text else text
    return str(value)


def print_tables(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=120)
    env = report["environment"]
    model = report.get("model") or {}
    console.print(
        f"gpu_check: shape {report['settings']['shape']} on {env.get('gpu', env['device'])}, "
        f"{_num(model.get('parameters', 0) / 1e6, 1)}M parameters, "
        f"torch {env['torch']}, transformers {env['transformers']}"
    )

    table = Table(title="throughput (engine fast numerics vs transformers.generate, bf16, greedy)")
    for col in ("concurrency", "engine tok/s", "HF tok/s", "ratio", "same outputs", "preemptions"):
        table.add_column(col, justify="right")
    for row in (report.get("throughput") or {}).get("results", []):
        table.add_row(
            str(row["concurrency"]),
            f"{row['engine_tps']:,.1f}",
            f"{row['hf_tps']:,.1f}",
            f"{row['ratio']:.2f}x",
            f"{row['same_greedy_outputs']:.2f}",
            str(row["engine_preemptions"]),
        )
    console.print(table)

    table = Table(title="parity (engine exact numerics vs transformers, teacher-forced and greedy)")
    for col in ("dtype", "max |Δ logit|", "bitwise", "top-1 agree", "mean KL", "greedy match", "matched tokens"):
        table.add_column(col, justify="right")
    for name, row in report["parity"].items():
        if row:
            table.add_row(
                name,
                _num(row["max_abs_logit_diff"]),
                _num(row["bitwise_equal_logits"]),
                _num(row["top1_agreement"]),
                _num(row["mean_kld"]),
                _num(row["greedy_match_rate"]),
                f"{row['mean_matched_tokens']:.1f}/{row['greedy_tokens']}",
            )
    console.print(table)

    table = Table(title="speculative decoding (random EAGLE-3 draft) vs plain greedy, bf16")
    for col in ("numerics", "k", "exact", "prompt match", "token match", "accept len"):
        table.add_column(col, justify="right")
    for name, row in report["spec"].items():
        if row:
            table.add_row(
                name,
                str(row["num_speculative_tokens"]),
                _num(row["exact"]),
                _num(row["prompt_match_rate"]),
                _num(row["token_match_rate"]),
                _num(row["acceptance_length"]),
            )
    console.print(table)

    table = Table(title=f"phases (total {report.get('total_s', 0):.1f} s)")
    for col in ("phase", "status", "elapsed s", "budget s", "peak GPU GiB"):
        table.add_column(col, justify="right")
    for name, row in report["phases"].items():
        status = row["status"] + (f": {row['error']}" if "error" in row else "")
        table.add_row(
            name,
            status[:60],
            _num(row.get("elapsed_s"), 1),
            _num(row["budget_s"], 0),
            _num(row.get("peak_gpu_memory_gib"), 1),
        )
    console.print(table)


WORKLOAD = (
    "prompt_tokens",
    "new_tokens",
    "parity_prompts",
    "parity_tokens",
    "spec_prompts",
    "spec_tokens",
    "spec_k",
)


def parse_args(argv: list[str] | None = None) -> Settings:
    defaults = Settings()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default=defaults.shape)
    parser.add_argument("--device", default=None, help="torch device (default: cuda, or cpu for --shape tiny)")
    parser.add_argument("--out", type=Path, default=defaults.out, help="JSON report (default: %(default)s)")
    parser.add_argument("--workdir", type=Path, default=None, help="where the temporary checkpoint goes")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint directory")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    for name in WORKLOAD:
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=int, default=None, help=f"default {getattr(defaults, name)}"
        )
    parser.add_argument(
        "--concurrency",
        type=lambda v: [int(x) for x in v.split(",")],
        default=defaults.concurrency,
        help="e.g. 1,16,64",
    )
    parser.add_argument("--deadline", type=float, default=defaults.deadline, help="seconds (default: %(default)s)")
    parser.add_argument(
        "--phases",
        type=lambda v: [p.strip() for p in v.split(",") if p.strip()],
        default=list(PHASES),
        help=f"comma-separated subset of {','.join(PHASES)} (build always runs)",
    )
    args = parser.parse_args(argv)
    unknown = set(args.phases) - set(PHASES)
    if unknown:
        parser.error(f"unknown phases: {', '.join(sorted(unknown))}")
    device = args.device or ("cpu" if args.shape == "tiny" else "cuda")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {device}: CUDA is not available in torch {torch.__version__}")
    shape = SHAPES[args.shape]
    workload = {
        name: getattr(args, name)
        if getattr(args, name) is not None
        else shape.workload.get(name, getattr(defaults, name))
        for name in WORKLOAD
    }
    return Settings(
        shape=args.shape,
        device=device,
        out=args.out,
        workdir=args.workdir,
        keep=args.keep,
        seed=args.seed,
        concurrency=args.concurrency,
        deadline=args.deadline,
        phases=sorted({"build", *args.phases}, key=PHASES.index),
        **workload,
    )


def main(argv: list[str] | None = None) -> int:
    return GpuCheck(parse_args(argv)).run()


if __name__ == "__main__":
    # `timeout` sends SIGTERM first: unwind, so the checkpoint (maybe in /dev/shm) is removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())
