"""Quantized artifacts: the random model through onboard's own quantize stage (calibration on random
ids of the check's vocabulary), the artifact loaded by transformers and the engine, and the
`distill` phase (NVFP4 scales distilled on the device)."""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from .context import CheckContext
from .model import random_prompts


class QuantizePhases(CheckContext):
    """The quantize stage and an artifact's loads, shared with the artifacts' parity phases, and the
    `distill` phase."""

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
