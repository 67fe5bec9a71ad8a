"""What every phase shares: the settings, the report and its writing, the phase runner (budgets,
the deadline, errors kept as results), and the models on the device (engines kept one at a time,
the transformers model converted between dtypes)."""

from __future__ import annotations

import contextlib
import gc
import json
import platform
import subprocess
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from .settings import SHAPES, TOP, Settings

ROOT = Path(__file__).resolve().parents[2]


def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:400]


class CheckContext:
    """The shared state of a run; the phase families (mixins) add the phases to it."""

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
                record["error"] = first_line(err)
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

    @torch.inference_mode()
    def _hf_logits(self, token_ids: list[int], model=None) -> torch.Tensor:
        model = self.hf if model is None else model
        return model(torch.tensor([token_ids], device=self.device)).logits[0].float()
