"""The whole run: every phase in the order that puts the pass criteria first, then the verdict (the
checks that failed) and the conditional checks left undone, written and printed."""

from __future__ import annotations

import shutil

import torch

from .artifact_parity import ArtifactParityPhases
from .model import BuildPhase
from .report import print_tables
from .settings import CONDITIONAL, DEFAULT_PHASES, FP32_TOP1_MIN
from .spec import SpecPhases
from .throughput import ThroughputPhase


class GpuCheck(BuildPhase, ArtifactParityPhases, SpecPhases, ThroughputPhase):
    """The check: the shared context (`CheckContext`) and each phase family's phases."""

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
