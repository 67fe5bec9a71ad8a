"""Parity of the quantized artifacts: FP8 W8A8 under the token rules, NVFP4 W4A4 under the
layerwise-distribution rule, each against transformers on the same artifact."""

from __future__ import annotations

import math
import time
import traceback

import torch

from .context import first_line
from .parity import ParityPhases
from .quantize import QuantizePhases


def _worst(values) -> float:
    """The largest value, or a NaN where one is (`max` would drop a NaN in second place)."""
    values = list(values)
    return next((v for v in values if math.isnan(v)), max(values))


class ArtifactParityPhases(QuantizePhases, ParityPhases):
    """The `parity_fp8` and `parity_nvfp4` phases."""

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
                layerwise = {"error": first_line(err), "traceback": traceback.format_exc()[-4000:]}
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
