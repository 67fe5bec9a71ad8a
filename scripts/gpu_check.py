"""A GPU check for a lent device: the reference engine on a random-weight model of a real size.

No network and no weights travel: a Llama-3-8B-shaped model (hidden 4096, 32 layers, GQA 32/8,
vocabulary 128256, rope theta 500000, bf16) is built with random weights directly on the device,
saved as a checkpoint the engine loads, and then measured against transformers on the same weights:

* throughput: the engine (fast numerics) against `transformers.generate` (greedy, 64 new tokens,
  EOS never stops either side) at concurrency 1, 16 and 64 on random prompts of 128 tokens;
* parity in float32 and bfloat16: the engine in exact numerics against transformers on ONE copy
  of each prompt (batch 1, as `onboard adapt` compares: exact numerics call transformers' own ops
  with the same shapes for a request alone): teacher-forced logits (max |Δ logit|, top-1
  agreement) and greedy continuations, one prompt at a time; `rule` per dtype is `bitwise` (every
  logit and greedy token identical) or else `near_tie`;
* quantized artifacts: the random model through onboard's own quantize stage (`run_quantize`, a
  run directory under the temporary directory; calibration on random ids of the check's own
  vocabulary, 4 samples x 128 tokens), then, on the same prompts, in bf16:
  - FP8 W8A8: the exact engine against transformers on the artifact, rule `bitwise` or
    `near_tie`, passing under the Gate's token thresholds (max |Δ logit|, top-1 agreement,
    divergences only at near-ties);
  - NVFP4 W4A4: the same figures for information, judged by the `layerwise_distribution` rule:
    KL(transformers‖engine) / KL(source‖transformers) and the damage difference, the worse of
    exact and fast numerics (the source: the bf16 random model), and every layer and linear
    against its floor (`measure_layerwise`), under the Gate's defaults;
* speculative decoding's exactness: a random-weight EAGLE-3 draft (`engine.set_speculator(draft, 3)`)
  must leave greedy outputs exactly as plain greedy decoding gives them (exact numerics: token for
  token; fast numerics: the match rate is reported); the acceptance length is reported too (about
  1 with a random draft: this is an exactness check, not a speed one).

* NVFP4 scale distillation (`quantize --distill-tokens`, `--distill-tokens` calibration tokens):
  it runs on the device, kept scales do not raise the calibration KL and change some scales, and
  the artifact stays NVFP4 (chosen with `--phases`, not run by default).

Phases run in the order that puts the pass criteria first (the build, bf16 parity, exact spec
decoding, fp32 parity, the FP8 and NVFP4 artifacts, then throughput, fast spec decoding and
distillation); each
has a time budget, prints its elapsed time, and a phase that would end past `--deadline` is
skipped.  The JSON report (`--out`) is rewritten after every phase, so a run cut short still
leaves what it measured.  Each artifact, its models and engines are freed after its phase.

Exit status 0 when fp32 exact parity has top-1 agreement >= 0.99 and speculative decoding in
exact numerics reproduces plain greedy decoding token for token, and, for those of these phases
that ran, bf16 exact parity is `bitwise`, the FP8 artifact passes the near-tie rule and the NVFP4
artifact the layerwise-distribution rule; 1 otherwise (one-line reason).  A conditional phase
skipped (deadline, --phases) is listed as not checked, not failed; one that failed is a failure.

    scripts/gpu_check.sh                                   # llama3-8b shape on cuda (< 9 min on one H200)
    scripts/gpu_check.sh --shape tiny --device cpu         # the same code on the CPU (< 1 min)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
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
# Checks of the verdict that hold when their phase ran: (phase, report["parity"] key, label).
CONDITIONAL = (
    ("parity_bf16", "bfloat16", "bf16 exact parity"),
    ("parity_fp8", "fp8", "fp8 artifact parity"),
    ("parity_nvfp4", "nvfp4", "nvfp4 artifact parity"),
    ("distill", "distill", "nvfp4 scale distillation"),
)


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


PHASES = (
    "build",
    "parity_bf16",
    "spec_exact",
    "parity_fp32",
    "parity_fp8",
    "parity_nvfp4",
    "throughput",
    "spec_fast",
    "distill",
)
# Distillation trains on the device for minutes at the real size: run when chosen (--phases).
DEFAULT_PHASES = tuple(phase for phase in PHASES if phase != "distill")

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
        # Estimates for one H200 (model init + a 16 GB save; engine loads of 16 and 32 GB; the
        # artifacts: quantize fp8 ~60 s, nvfp4 oneshot on 4 x 128 tokens ~120 s, then transformers
        # loads and decompresses each on the CPU): 520 s in all, the default deadline, so that the
        # run ends well inside the 10 minutes a lent device runs one command.  Not yet measured.
        budgets={
            "build": 60,
            "parity_bf16": 35,
            "spec_exact": 40,
            "parity_fp32": 55,
            "parity_fp8": 90,
            "parity_nvfp4": 170,
            "throughput": 50,
            "spec_fast": 20,
            # NVFP4 oneshot as parity_nvfp4's, then 4 epochs of forward and backward passes over the
            # distillation tokens beside a bf16 teacher. Not yet measured; not a default phase, it
            # runs when chosen (`--phases distill`).
            "distill": 240,
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
        # On 2 busy CPU cores; the speculative runs and the quantize stage (llmcompressor's import
        # and oneshot) cost most.
        budgets={
            "build": 10,
            "parity_bf16": 10,
            "spec_exact": 15,
            "parity_fp32": 10,
            "parity_fp8": 30,
            "parity_nvfp4": 40,
            "throughput": 15,
            "spec_fast": 15,
            "distill": 40,
        },
        workload={"spec_tokens": 16, "distill_tokens": 256},
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
    calib_samples: int = 4  # the artifacts' calibration (NVFP4's activation scales): samples x tokens
    calib_tokens: int = 128
    distill_tokens: int = 4096  # the distill phase's calibration tokens, all distilled on
    deadline: float = 520.0  # seconds: a phase that would end later (at its budget) is skipped
    phases: list[str] = field(default_factory=lambda: list(DEFAULT_PHASES))


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


def _worst(values) -> float:
    """The largest value, or a NaN where one is (`max` would drop a NaN in second place)."""
    values = list(values)
    return next((v for v in values if math.isnan(v)), max(values))


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
            self.release()  # what the phase dropped (an artifact's models and engines), errors included
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
        self.release()

    def release(self) -> None:
        """Return what dropped references held (models, engines, KV caches) to the device."""
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def hf_as(self, dtype: torch.dtype):
        """The transformers model in `dtype`, converted in place (bf16 -> fp32 -> bf16 is lossless)."""
        if self.hf.dtype != dtype:
            self.hf.to(dtype)
            self.release()
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

    @torch.inference_mode()
    def _hf_logits(self, token_ids: list[int], model=None) -> torch.Tensor:
        model = self.hf if model is None else model
        return model(torch.tensor([token_ids], device=self.device)).logits[0].float()

    @torch.inference_mode()
    def _hf_greedy(self, prompt: list[int], max_new_tokens: int, model=None) -> tuple[list[int], list[list[int]]]:
        """transformers' greedy continuation of ONE copy of the prompt (batch 1), as a user runs it and
        as `onboard adapt` compares (`_reference_greedy`): exact numerics run transformers' own ops on
        the same rows, so a request alone computes what this computes; and the top-5 ids at each step."""
        model = self.hf if model is None else model
        out = model.generate(
            torch.tensor([prompt], device=self.device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=self.device),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=PAD_ID,
            output_logits=True,
            return_dict_in_generate=True,
        )
        tokens = out.sequences[0, len(prompt) :].tolist()
        return tokens, [step[0].float().topk(TOP).indices.tolist() for step in out.logits]

    def parity_prompts(self) -> list[list[int]]:
        """The random prompts every parity section uses (bf16, fp32 and both artifacts)."""
        return random_prompts(self.s.parity_prompts, self.s.prompt_tokens, self.shape.vocab_size, self.s.seed + 1)

    def token_parity(
        self,
        engine,
        model,
        prompts: list[list[int]],
        dtype: torch.dtype,
        on_forced: Callable[[list[int], torch.Tensor, torch.Tensor], None] | None = None,
    ) -> dict[str, Any]:
        """The engine (exact numerics) against transformers' `model` on the same weights, one prompt
        at a time: greedy continuations (near-tie rule at a divergence) and teacher-forced logits on
        prompt + transformers' continuation.  `on_forced(forced, reference, engine)` sees each
        prompt's teacher-forced logits (the distribution rule's statistics)."""
        from onboard.adapt.parity import compare_greedy

        params = greedy(self.s.parity_tokens, logprobs=TOP)
        max_diff, agree, positions, kl_sum, bitwise, cases = 0.0, 0, 0, 0.0, True, []
        for prompt in prompts:
            (mine,) = engine.generate([prompt], params)
            theirs, their_top = self._hf_greedy(prompt, self.s.parity_tokens, model)
            mine_top = [[token for token, _ in entry["top"]] for entry in mine.logprobs]
            verdict = compare_greedy(mine.token_ids, theirs, mine_top, their_top)
            forced = prompt + theirs
            ref = self._hf_logits(forced, model)
            got = engine.score(forced).float().to(ref.device)
            bitwise = bitwise and torch.equal(got, ref)
            max_diff = max(max_diff, float((got - ref).abs().max()))
            agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
            positions += ref.shape[0]
            ref_lp, got_lp = ref.log_softmax(-1), got.log_softmax(-1)
            kl_sum += float((ref_lp.exp() * (ref_lp - got_lp)).sum(-1).clamp_min(0).sum())
            if on_forced is not None:
                on_forced(forced, ref, got)
            cases.append(
                {
                    "matched": verdict.matched,
                    "first_divergence": verdict.first_divergence,
                    "near_tie": verdict.near_tie,
                }
            )
            del ref, got, ref_lp, got_lp
        greedy_match_rate = sum(c["matched"] for c in cases) / len(cases)
        # Every logit and every greedy token transformers' own; else judged by the near-tie rule.
        identical = bitwise and greedy_match_rate == 1.0
        return {
            "numerics": "exact",
            "dtype": str(dtype).removeprefix("torch."),
            "num_prompts": len(prompts),
            "prompt_tokens": self.s.prompt_tokens,
            "greedy_tokens": self.s.parity_tokens,
            "max_abs_logit_diff": max_diff,
            "bitwise_equal_logits": bitwise,
            "top1_agreement": agree / positions,
            "mean_kld": kl_sum / positions,
            "num_positions": positions,
            "greedy_match_rate": greedy_match_rate,
            "mean_matched_tokens": sum(
                self.s.parity_tokens if c["first_divergence"] is None else c["first_divergence"] for c in cases
            )
            / len(cases),
            "divergences_all_near_ties": all(c["near_tie"] for c in cases),
            "rule": "bitwise" if identical else "near_tie",
            "cases": cases,
        }

    def parity(self, dtype: torch.dtype) -> None:
        name = str(dtype).removeprefix("torch.")
        self.report["parity"][name] = None
        engine = self.engine("exact", dtype)  # frees the other engine first
        self.hf_as(dtype)
        self.report["parity"][name] = self.token_parity(engine, self.hf, self.parity_prompts(), dtype)

    # -- quantized artifacts -------------------------------------------------------------------------

    def calibration_file(self, samples: int) -> Path:
        """Calibration DATA for the quantize stage: `samples` records of `calib_tokens` random
        words of the check's own vocabulary ("t17 t4021 ..."), which its word-level tokenizer reads
        back as those ids.  The built-in calibration text would tokenize to "<unk>" (97 % of its tokens:
        the toy vocabulary has no English), one activation pattern to calibrate NVFP4's scales on;
        random ids are what every prompt of this check is made of."""
        path = self.tmp / f"calibration-{samples}.jsonl"
        if not path.exists():
            rows = random_prompts(samples, self.s.calib_tokens, self.shape.vocab_size, self.s.seed + 3)
            path.write_text("".join(json.dumps({"text": " ".join(f"t{i}" for i in row)}) + "\n" for row in rows))
        return path

    def quantize(self, scheme: str, distill_tokens: int = 0) -> tuple[Path, dict[str, Any]]:
        """The random model through onboard's own quantize stage (llmcompressor oneshot, the run
        directory and manifest as `onboard quantize` writes them) under the temporary directory,
        its NVFP4 scales distilled on `distill_tokens` calibration tokens when set.  Its time
        includes the first import of llmcompressor."""
        began = time.monotonic()
        from onboard.models import inspect_checkpoint
        from onboard.quantize.stage import run_quantize
        from onboard.recipes import Calibration, Quantize
        from onboard.workspace import SELECTION, RunDir

        root = self.tmp / f"run-{scheme}{'-distilled' if distill_tokens else ''}"
        # enough sequences for the distillation tokens beside the eighth distillation holds back
        trained = -(-distill_tokens // self.s.calib_tokens)
        samples = max(self.s.calib_samples, trained + -(-trained // 7) if distill_tokens else 0)
        settings = Quantize(
            scheme=scheme,
            calibration=Calibration(num_samples=samples, max_seq_length=self.s.calib_tokens),
            distill_tokens=distill_tokens,
        )
        try:
            with RunDir(root) as run:
                entry = run_quantize(run, inspect_checkpoint(self.path), settings, self.calibration_file(samples))
        except BaseException:
            if not self.s.keep:  # what a failed stage left (staging) would crowd the next artifact
                shutil.rmtree(root, ignore_errors=True)
            raise
        finally:
            with contextlib.suppress(ImportError):  # llmcompressor's session holds the model it quantized
                from llmcompressor.core import reset_session

                reset_session()
            self.release()
        if entry.get("status") != "done":
            raise RuntimeError(f"quantize {scheme}: stage status {entry.get('status')!r}")
        artifact = run.artifact
        metrics = entry.get("metrics", {})
        selection = json.loads(run.path(SELECTION).read_text())
        return artifact, {
            "scheme": scheme,
            **({"distill": selection["distill"]} if "distill" in selection else {}),
            "quantize_s": round(time.monotonic() - began, 2),
            "calibration_samples": samples,
            "calibration_max_seq_length": self.s.calib_tokens,
            "calibration_tokens": metrics.get("calibration_tokens"),
            "effective_bits": metrics.get("effective_bits"),
            "quantized_layers": metrics.get("quantized_layers"),
            "artifact_bytes": metrics.get("bytes_artifact"),
            "source_bytes": metrics.get("bytes_reference"),
        }

    def load_artifact(self, artifact: Path, loads: dict[str, float]) -> Any:
        """transformers on the artifact as `onboard adapt` loads it (compressed-tensors, decompressed
        in bf16, its offloading removed), on the device."""
        from onboard.models import inspect_checkpoint, load_model

        began = time.monotonic()
        model = load_model(inspect_checkpoint(artifact), torch.bfloat16).to(self.device)
        self.sync()
        loads["transformers"] = round(time.monotonic() - began, 2)
        return model

    def artifact_engine(self, artifact: Path, numerics: str, loads: dict[str, float]):
        from onboard.engine import LLMEngine

        began = time.monotonic()
        engine = LLMEngine(artifact, self.engine_config(numerics), dtype=torch.bfloat16)
        self.sync()
        loads[f"engine_{numerics}"] = round(time.monotonic() - began, 2)
        return engine

    def drop_artifact(self, artifact: Path) -> None:
        if not self.s.keep:
            shutil.rmtree(artifact.parent, ignore_errors=True)

    def parity_fp8(self) -> None:
        """FP8 W8A8 (FP8_DYNAMIC): the exact engine against transformers on the artifact, judged by
        the token rules (`bitwise`, else `near_tie`) under the Gate's thresholds."""
        from onboard.recipes import Gate

        self.report["parity"]["fp8"] = None
        self.free_engines()
        self.hf_as(torch.bfloat16)
        artifact, quantized = self.quantize("fp8")
        try:
            loads: dict[str, float] = {}
            model = self.load_artifact(artifact, loads)
            engine = self.artifact_engine(artifact, "exact", loads)
            result = self.token_parity(engine, model, self.parity_prompts(), torch.bfloat16)
            del engine, model
        finally:
            self.drop_artifact(artifact)
        gate = Gate()
        failures = []
        if not result["max_abs_logit_diff"] <= gate.max_parity_logit_diff:  # a NaN fails too
            failures.append(f"max |Δ logit| {result['max_abs_logit_diff']:.4f} > {gate.max_parity_logit_diff}")
        if not result["top1_agreement"] >= gate.min_parity_top1_agreement:
            failures.append(f"top-1 agreement {result['top1_agreement']:.4f} < {gate.min_parity_top1_agreement}")
        if not result["divergences_all_near_ties"]:
            failures.append("a greedy divergence that is not a near-tie")
        self.report["parity"]["fp8"] = {
            **result,
            "checkpoint": "fp8 artifact",
            "quantize": quantized,
            "load_s": loads,
            "thresholds": {
                "max_parity_logit_diff": gate.max_parity_logit_diff,
                "min_parity_top1_agreement": gate.min_parity_top1_agreement,
            },
            "passed": not failures,
            "failures": failures,
        }

    def parity_nvfp4(self) -> None:
        """NVFP4 W4A4: the token figures for information, judged by the layerwise-distribution rule:
        KL(transformers‖engine) / KL(source‖transformers) and the damage difference for exact and fast
        numerics (`onboard.adapt.distribution`, the source the bf16 random model), and every layer
        and linear against its floor (`measure_layerwise`), under the Gate's thresholds."""
        from onboard.adapt.distribution import DistributionParity, moved_input_logits
        from onboard.adapt.layerwise import measure_layerwise
        from onboard.recipes import Gate

        self.report["parity"]["nvfp4"] = None
        self.free_engines()
        source = self.hf_as(torch.bfloat16)
        artifact, quantized = self.quantize("nvfp4")
        prompts = self.parity_prompts()
        try:
            loads: dict[str, float] = {}
            model = self.load_artifact(artifact, loads)
            engine = self.artifact_engine(artifact, "exact", loads)
            fast = self.artifact_engine(artifact, "fast", loads)
            distribution, last_bits = DistributionParity(), torch.Generator().manual_seed(0)

            def on_forced(
                forced: list[int], reference: torch.Tensor, exact: torch.Tensor, fast=fast, model=model
            ) -> None:
                mine = fast.score(forced).float().to(reference.device)
                ids = torch.tensor([forced], device=self.device)
                moved = moved_input_logits(model, ids, last_bits).to(reference.device)
                distribution.update(self._hf_logits(forced, source), reference, moved, {"exact": exact, "fast": mine})

            result = self.token_parity(engine, model, prompts, torch.bfloat16, on_forced)
            del engine, fast, model, on_forced
            self.release()
            began = time.monotonic()
            try:  # an error here still leaves the distribution figures in the report
                layerwise = measure_layerwise(artifact, prompts, torch.bfloat16, str(self.device))
                layerwise = {k: v for k, v in layerwise.items() if k not in ("dtype", "num_prompts")}
            except Exception as err:
                layerwise = {"error": _first_line(err), "traceback": traceback.format_exc()[-4000:]}
            layerwise.update(elapsed_s=round(time.monotonic() - began, 2))
        finally:
            self.drop_artifact(artifact)
        gate = Gate()
        sides = {side: distribution.summary(side) for side in ("exact", "fast")}
        worst = {key: _worst(sides[side][key] for side in sides) for key in ("kl_ratio", "damage_diff")}
        checks = {
            "kl_ratio": (worst["kl_ratio"], gate.max_parity_kl_ratio),
            "damage_diff": (worst["damage_diff"], gate.max_parity_damage_diff),
        }
        if "error" not in layerwise:
            checks["layer_ratio"] = (layerwise["max_floor_ratio"], gate.max_parity_layer_ratio)
            checks["linear_ratio"] = (layerwise["max_linear_ratio"], gate.max_parity_linear_ratio)
        failures = [f"{key} {value:.4f} > {limit}" for key, (value, limit) in checks.items() if not value <= limit]
        if "error" in layerwise:
            failures.append(f"layerwise parity did not complete ({layerwise['error']})")
        elif layerwise["first_failing_layer"]:
            failures.append(
                f"first failing layer {layerwise['first_failing_layer']}"
                + (f" ({layerwise['first_failing_module']})" if layerwise["first_failing_module"] else "")
            )
        self.report["parity"]["nvfp4"] = {
            **result,
            "checkpoint": "nvfp4 artifact",
            # The token figures above are for information: 4-bit activations turn a last-bit kernel
            # difference into other tokens, so the rule is the layerwise-distribution one.
            "token_rule": result["rule"],
            "rule": "layerwise_distribution",
            "quantize": quantized,
            "load_s": loads,
            "distribution": sides,
            "kl_ratio": worst["kl_ratio"],
            "damage_diff": worst["damage_diff"],
            "layerwise": layerwise,
            "thresholds": {
                "max_parity_kl_ratio": gate.max_parity_kl_ratio,
                "max_parity_damage_diff": gate.max_parity_damage_diff,
                "max_parity_layer_ratio": gate.max_parity_layer_ratio,
                "max_parity_linear_ratio": gate.max_parity_linear_ratio,
            },
            "passed": not failures,
            "failures": failures,
        }

    def distill(self) -> None:
        """NVFP4 W4A4 with its block scales distilled on KL to the bf16 model (`quantize
        --distill-tokens`), on the device: it must run there, not raise the calibration KL, change
        scales when it keeps them, and leave an artifact the engine serves in the same format."""
        from onboard.engine import CheckpointWeights

        self.report["parity"]["distill"] = None
        self.free_engines()
        self.hf = None
        self.release()
        artifact, quantized = self.quantize("nvfp4", self.s.distill_tokens)
        try:
            with CheckpointWeights(artifact) as weights:
                packed = [
                    name.removesuffix(".weight_packed") for name in weights.names() if name.endswith(".weight_packed")
                ]
                formats = {weights.effective_format(prefix) for prefix in packed}
        finally:
            self.drop_artifact(artifact)
        record = quantized.get("distill") or {}
        failures = []
        if not record:
            failures.append("the quantize stage recorded no distillation")
        elif record["kept"]:
            if record["calibration_kld_after"] > record["calibration_kld_before"]:
                before, after = record["calibration_kld_before"], record["calibration_kld_after"]
                failures.append(f"kept scales raised the calibration KL: {before:.4f} -> {after:.4f}")
            if not record["scales_changed"]:
                failures.append("distillation kept its scales but changed none")
        if formats != {"nvfp4"}:
            failures.append(f"the distilled artifact's packed linears are {sorted(formats)}, not all NVFP4")
        self.report["parity"]["distill"] = {
            "rule": "distillation",
            "quantize": quantized,
            "distill": record,
            "passed": not failures,
            "failures": failures,
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
                "kv_blocks_all_free": engine.stats()["num_free_blocks"] == engine.config.num_blocks,
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
            self.phase("parity_fp8", self.parity_fp8)
            self.phase("parity_nvfp4", self.parity_nvfp4)
            self.phase("throughput", self.throughput)
            self.phase("spec_fast", lambda: self.spec("fast"))
            self.phase("distill", self.distill)
        finally:
            self.free_engines()
            self.hf = None
            if self.tmp is not None and not self.s.keep:
                shutil.rmtree(self.tmp, ignore_errors=True)
        self.report["total_s"] = round(self.elapsed(), 2)
        reasons = self.verdict()
        self.report["passed"] = not reasons
        self.report["reason"] = "; ".join(reasons) if reasons else "all checks passed"
        self.report["unchecked"] = self.unchecked()
        self.write()
        print_tables(self.report)
        if self.report["unchecked"]:
            print("not checked: " + "; ".join(self.report["unchecked"]), flush=True)
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
        # The checks that hold when their phase ran: a phase that failed is a failure, one skipped
        # (the deadline, --phases) is reported (`unchecked`).
        for phase, key, label in CONDITIONAL:
            row = self.report["parity"].get(key)
            status = phases.get(phase, {}).get("status", "missing")
            if not row:
                if status in ("ok", "error"):
                    error = phases[phase].get("error", "no result")
                    reasons.append(f"{label} did not complete ({error})")
            elif key == "bfloat16":
                if row["rule"] != "bitwise":
                    reasons.append(
                        f"{label} is not bitwise (max |Δ logit| {row['max_abs_logit_diff']:.4g}, "
                        f"greedy match {row['greedy_match_rate']:.2f})"
                    )
            elif not row["passed"]:
                reasons.append(f"{label} fails the {row['rule']} rule: {'; '.join(row['failures'])}")
        return reasons

    def unchecked(self) -> list[str]:
        """The conditional checks whose phase did not run, and why."""
        notes = []
        for phase, key, label in CONDITIONAL:
            if phase not in DEFAULT_PHASES and phase not in self.s.phases:
                continue  # an opt-in phase nobody asked for is not a check left undone
            status = self.report["phases"].get(phase, {}).get("status", "missing")
            if not self.report["parity"].get(key) and status not in ("ok", "error"):
                notes.append(f"{label} ({status})")
        return notes


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

    table = Table(title="parity (engine exact numerics vs transformers, one prompt at a time; artifacts in bf16)")
    for col in ("weights", "rule", "max |Δ logit|", "bitwise", "top-1", "mean KL", "greedy", "ties only", "matched"):
        table.add_column(col, justify="right", no_wrap=True)
    for row in report["parity"].values():
        if row and "max_abs_logit_diff" in row:  # distillation has its line in the artifacts' table
            dtype = {"bfloat16": "bf16", "float32": "fp32"}.get(row["dtype"], row["dtype"])
            table.add_row(
                row["checkpoint"].removesuffix(" artifact") if "checkpoint" in row else f"model {dtype}",
                row["rule"],
                _num(row["max_abs_logit_diff"]),
                _num(row["bitwise_equal_logits"]),
                _num(row["top1_agreement"]),
                _num(row["mean_kld"]),
                _num(row["greedy_match_rate"]),
                _num(row["divergences_all_near_ties"]),
                f"{row['mean_matched_tokens']:.1f}/{row['greedy_tokens']}",
            )
    console.print(table)

    artifacts = {k: row for k, row in report["parity"].items() if row and "quantize" in row}
    if artifacts:
        table = Table(title="artifacts (the random model through onboard's quantize stage) and their rules")
        for col in ("scheme", "quantize s", "bits/weight", "GiB", "calib tokens", "rule", "passed", "failures"):
            table.add_column(col, justify="right")
        for name, row in artifacts.items():
            q = row["quantize"]
            table.add_row(
                name,
                _num(q["quantize_s"], 1),
                _num(q["effective_bits"], 2),
                _num(q["artifact_bytes"] / 2**30, 3),
                _num(q["calibration_tokens"]),
                row["rule"],
                _num(row["passed"]),
                "; ".join(row["failures"]) or "-",
            )
        console.print(table)
    distill = (report["parity"].get("distill") or {}).get("distill")
    if distill:
        console.print(
            f"distill: {distill['tokens']} tokens, {distill['steps']} steps in {distill['seconds']} s; held-back KL "
            f"{distill['held_back_kld_before']:.4f} -> {distill['held_back_kld_after']:.4f}, "
            + (f"epoch {distill['best_epoch']} kept" if distill["kept"] else "not kept")
        )

    nvfp4 = report["parity"].get("nvfp4")
    if nvfp4:
        limits, sides, layerwise = nvfp4["thresholds"], nvfp4["distribution"], nvfp4["layerwise"]
        table = Table(title="nvfp4 W4A4: the layerwise-distribution rule (source: the bf16 model)")
        for col in ("check", "exact", "fast", "limit"):
            table.add_column(col, justify="right")
        table.add_row(
            "KL(transformers‖engine)",
            _num(sides["exact"]["kl_transformers_engine"]),
            _num(sides["fast"]["kl_transformers_engine"]),
            "",
        )
        table.add_row("KL(source‖transformers)", _num(sides["exact"]["kl_source_transformers"]), "", "")
        table.add_row(
            "kl_ratio",
            _num(sides["exact"]["kl_ratio"]),
            _num(sides["fast"]["kl_ratio"]),
            _num(limits["max_parity_kl_ratio"]),
        )
        table.add_row(
            "damage_diff (± s.e.)",
            f"{_num(sides['exact']['damage_diff'])} ± {_num(sides['exact']['damage_diff_se'])}",
            f"{_num(sides['fast']['damage_diff'])} ± {_num(sides['fast']['damage_diff_se'])}",
            _num(limits["max_parity_damage_diff"]),
        )
        table.add_row(
            "layerwise: worst layer ÷ its floor",
            _num(layerwise.get("max_floor_ratio")),
            "",
            _num(limits["max_parity_layer_ratio"]),
        )
        table.add_row(
            "layerwise: worst linear ÷ its rounding step",
            _num(layerwise.get("max_linear_ratio")),
            "",
            _num(limits["max_parity_linear_ratio"]),
        )
        if "error" in layerwise:
            table.add_row("layerwise: error", layerwise["error"][:60], "", "")
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
    "calib_samples",
    "distill_tokens",
    "calib_tokens",
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
        default=list(DEFAULT_PHASES),
        help=f"comma-separated subset of {','.join(PHASES)} (build always runs; default: all but distill)",
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
