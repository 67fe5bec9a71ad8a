"""Hand-made run directories (no models) for the gate tests, and what each check is written to read.

Each run directory is what the stages would leave behind: `manifest.json` with the stages marked
`done` and the recipe recorded, plus each stage's metrics file. `passing_metrics` gives values
comfortably inside the default `Gate()`; the tests push one value at a time past (or onto) its
threshold, drop or fail a stage, tighten the recorded recipe, and run the real CLI (test_cli.py).

adapt's parity.json names the rule it judged by (`rule`): `bitwise` and `near_tie` runs are gated on
the token checks, `layerwise_distribution` runs (4-bit activations) on the distribution and layerwise
checks instead; `PASSING_W4A4` is such a run, whose token figures would fail the token checks.
"""

import copy
import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from parity_files import EXACT_DISTRIBUTION, FAST_DISTRIBUTION, layer_entry, layerwise_block

from onboard.gate import CHECKS, exit_code, junit_xml
from onboard.recipes import Gate, Recipe
from onboard.workspace import MANIFEST

STAGE_FILES = {
    "quantize": "quantize/selection.json",
    "eval": "eval/kl.json",
    "speculator": "speculator/metrics.json",
    "adapt": "adapt/parity.json",
    "smoke": "smoke/smoke.json",
}

# Comfortably inside the default Gate(); the eval and adapt top-1 agreements differ so a check
# reading the wrong stage's file shows up as a wrong value.
PASSING: dict[str, dict[str, Any]] = {
    # `tensors` 0: the gate has no artifact files to look for them in (a run with MTP layers is in
    # tests/quantize/test_mtp_carry.py)
    "quantize": {
        "effective_bits": 4.5,
        "mtp": {"layers": 1, "tensors": 0, "kept": True},
        "vision": {"tensors": 0, "kept": True},
    },
    "eval": {"mean_kld": 0.05, "top1_agreement": 0.93, "num_tokens": 4096, "p99_kld": 0.4},
    "speculator": {"acceptance_length": 2.5, "num_draft_tokens": 3},
    "adapt": {
        "rule": "near_tie",
        "max_abs_logit_diff": 0.01,
        "top1_agreement": 0.998,
        "num_positions": 512,
        "fast": {"logprobs_close": True, "top1_agreement": 0.97},
    },
    "smoke": {
        "loop_rate": 0.3,
        "reference_loop_rate": 0.28,
        "run_on_rate": 0.05,
        "reference_run_on_rate": 0.04,
        "near_duplicate_rate": 0.125,
        "reference_near_duplicate_rate": 0.125,
        "entropy_ratio": 0.97,
        "garbage_rate": 0.01,
        "reference_garbage_rate": 0.0,
        "batch_invariant": True,
        "num_prompts": 16,
    },
}


# An NVFP4 W4A4 run comfortably inside the default Gate(). Its token figures would fail the token
# checks (a W4A4 run is not judged by them). Fast numerics have the worse KL ratio and exact the worse
# damage difference, so a worst-of check reading only one side shows up as a wrong value; the
# layerwise block's recorded allowances (`max_layer_ratio`, `max_linear_ratio_allowed`) differ from
# the measured maxima, so a check reading the allowance does too.
PASSING_W4A4: dict[str, dict[str, Any]] = {
    **PASSING,
    "adapt": {
        "rule": "layerwise_distribution",
        "max_abs_logit_diff": 2.4,
        "top1_agreement": 0.91,
        "greedy_match_rate": 0.25,
        "logprobs_close": False,
        "num_positions": 512,
        "distribution": dict(EXACT_DISTRIBUTION),
        "fast": {"logprobs_close": False, "top1_agreement": 0.9, "distribution": dict(FAST_DISTRIBUTION)},
        "layerwise": layerwise_block(
            [layer_entry(0, 1.1, 0.003, "self_attn.o_proj"), layer_entry(1, 1.6, 0.41, "mlp.down_proj")]
        ),
    },
}

# What each check is written to read: (stage, metric key, threshold key, direction). Spelled out
# here rather than taken from CHECKS, so a check wired to the wrong file, key or threshold fails.
# "excess" checks read `key - reference_key`, "worst" checks `max(key, fast.key)` (exact's and fast
# numerics' value); "max" passes at value <= threshold, "min" at >=.
SPEC: dict[str, tuple[str, str, str, str]] = {
    "mtp_kept": ("quantize", "mtp.kept", "require_mtp_kept", "bool"),
    "vision_kept": ("quantize", "vision.kept", "require_vision_kept", "bool"),
    "mean_kld": ("eval", "mean_kld", "max_mean_kld", "max"),
    "top1_agreement": ("eval", "top1_agreement", "min_top1_agreement", "min"),
    "acceptance_length": ("speculator", "acceptance_length", "min_acceptance_length", "min"),
    "parity_logit_diff": ("adapt", "max_abs_logit_diff", "max_parity_logit_diff", "max"),
    "parity_top1_agreement": ("adapt", "top1_agreement", "min_parity_top1_agreement", "min"),
    "loop_rate_excess": ("smoke", "loop_rate", "max_loop_rate_excess", "max"),
    "run_on_excess": ("smoke", "run_on_rate", "max_run_on_excess", "max"),
    "near_duplicate_excess": ("smoke", "near_duplicate_rate", "max_near_duplicate_excess", "max"),
    "entropy_ratio": ("smoke", "entropy_ratio", "min_entropy_ratio", "min"),
    "garbage_excess": ("smoke", "garbage_rate", "max_garbage_excess", "max"),
    "batch_invariant": ("smoke", "batch_invariant", "require_batch_invariance", "bool"),
    "fast_parity": ("adapt", "fast.logprobs_close", "require_fast_parity", "bool"),
    "parity_kl_ratio": ("adapt", "distribution.kl_ratio", "max_parity_kl_ratio", "max"),
    "parity_damage_diff": ("adapt", "distribution.damage_diff", "max_parity_damage_diff", "max"),
    "parity_layer_ratio": ("adapt", "layerwise.max_floor_ratio", "max_parity_layer_ratio", "max"),
    "parity_linear_ratio": ("adapt", "layerwise.max_linear_ratio", "max_parity_linear_ratio", "max"),
}
EXCESS = {"loop_rate_excess", "run_on_excess", "near_duplicate_excess", "garbage_excess"}
WORST = {"parity_kl_ratio", "parity_damage_diff"}
NUMERIC = [name for name, spec in SPEC.items() if spec[3] != "bool"]
CHECK_NAMES = [check.name for check in CHECKS]

# Which parity rules gate on which adapt checks; every other check applies to every run.
RULES = ("bitwise", "near_tie", "layerwise_distribution")
TOKEN_CHECKS = ("parity_logit_diff", "parity_top1_agreement", "fast_parity")
DISTRIBUTION_CHECKS = ("parity_kl_ratio", "parity_damage_diff", "parity_layer_ratio", "parity_linear_ratio")
# Of those, the ones a run over the memory budget is gated on (adapt's `layerwise` rule).
LAYERWISE_CHECKS = ("parity_layer_ratio", "parity_linear_ratio")


def rule_checks(rule: str) -> list[str]:
    """The checks a run judged by `rule` lists, in CHECKS order."""
    left_out = TOKEN_CHECKS if rule == "layerwise_distribution" else DISTRIBUTION_CHECKS
    return [name for name in SPEC if name not in left_out]


def rule_of(name: str) -> str:
    """A rule whose runs have check `name` (the token rule for checks every run has)."""
    return "layerwise_distribution" if name in DISTRIBUTION_CHECKS else "near_tie"


def metric_holder(metrics: dict[str, dict[str, Any]], stage: str, key: str) -> tuple[dict[str, Any], str]:
    """The dict holding a (dotted: `fast.logprobs_close`) metric key of `stage`, and its last part."""
    *path, last = key.split(".")
    holder = metrics[stage]
    for part in path:
        holder = holder[part]
    return holder, last


def _lookup(metrics: dict[str, dict[str, Any]], stage: str, key: str) -> Any:
    holder, last = metric_holder(metrics, stage, key)
    return holder[last]


def expected_value(name: str, metrics: dict[str, dict[str, Any]]) -> Any:
    stage, key, _, _ = SPEC[name]
    if name in EXCESS:
        return pytest.approx(metrics[stage][key] - metrics[stage][f"reference_{key}"])
    if name in WORST:
        return max(_lookup(metrics, stage, key), _lookup(metrics, stage, f"fast.{key}"))
    return _lookup(metrics, stage, key)


def set_value(metrics: dict[str, dict[str, Any]], name: str, value: Any, reference: float = 0.0) -> None:
    """Make check `name` see `value` (an excess check: `reference + value` over `reference`; a worst
    check: exact's value, fast's staying below it)."""
    stage, key, _, _ = SPEC[name]
    if name in WORST:
        assert _lookup(metrics, stage, f"fast.{key}") <= value
    if name in EXCESS:
        metrics[stage][f"reference_{key}"] = reference
        metrics[stage][key] = reference + value
    else:
        holder, last = metric_holder(metrics, stage, key)
        holder[last] = value


def make_run(
    root: Path,
    metrics: dict[str, dict[str, Any]] | None = None,
    *,
    gate: Gate | None = None,
    status: dict[str, str] | None = None,
    skip_files: tuple[str, ...] = (),
    recipe: bool = True,
) -> Path:
    """A run directory as the stages leave it; `status` overrides a stage's manifest status
    (None: absent from the manifest), `skip_files` leaves a stage's metrics file out."""
    metrics = copy.deepcopy(PASSING) if metrics is None else metrics
    root.mkdir(parents=True, exist_ok=True)
    stages: dict[str, Any] = {}
    for stage in ("quantize", *STAGE_FILES):
        state = (status or {}).get(stage, "done")
        if state is not None:
            stages[stage] = {"status": state, "metrics": {}}
    manifest: dict[str, Any] = {"run_dir": str(root), "created": "2026-01-01T00:00:00+00:00", "stages": stages}
    if recipe:
        manifest["recipe"] = Recipe(gate=gate or Gate()).model_dump()
    (root / MANIFEST).write_text(json.dumps(manifest, indent=2))
    for stage, relative in STAGE_FILES.items():
        if stage not in skip_files:
            path = root / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(metrics[stage]))
    return root


def passing_metrics(rule: str = "near_tie") -> dict[str, dict[str, Any]]:
    """PASSING (PASSING_W4A4 for the layerwise-distribution rule) with adapt's `rule` set."""
    metrics = copy.deepcopy(PASSING_W4A4 if rule == "layerwise_distribution" else PASSING)
    metrics["adapt"]["rule"] = rule
    return metrics


def failing_value(name: str, threshold: Any) -> Any:
    kind = SPEC[name][3]
    if kind == "bool":
        return False
    return threshold + 0.05 if kind == "max" else threshold - 0.05


def by_name(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {check["name"]: check for check in result["checks"]}


def failed_names(result: dict[str, Any]) -> set[str]:
    return {check["name"] for check in result["checks"] if not check["passed"]}


def assert_missing(result: dict[str, Any], stage: str) -> None:
    assert result["complete"] is False
    assert result["passed"] is False
    assert result["missing"] == [stage]
    assert exit_code(result) == 2
    for check in result["checks"]:
        if check["stage"] == stage:
            assert check["value"] is None, check
            assert check["passed"] is False, check
        else:  # the stages that did run are still measured
            assert check["passed"] is True, check
            assert check["value"] is not None, check
    assert [c["name"] for c in result["checks"]] == rule_checks(result["parity_rule"])
    assert {c["name"] for c in result["checks"] if c["stage"] == stage} == {
        name for name in rule_checks(result["parity_rule"]) if SPEC[name][0] == stage
    }


def junit_suite(result: dict[str, Any]) -> ET.Element:
    text = junit_xml(result)
    assert text.startswith("<?xml")
    root = ET.fromstring(text)
    assert root.tag == "testsuites"
    suites = root.findall("testsuite")
    assert len(suites) == 1
    suite = suites[0]
    cases = suite.findall("testcase")
    assert int(suite.get("tests")) == len(cases) == len(rule_checks(result["parity_rule"]))
    assert [case.get("name") for case in cases] == rule_checks(result["parity_rule"])
    for case in cases:
        assert case.get("classname", "").endswith(SPEC[case.get("name")][0])
    assert int(suite.get("failures")) == sum(len(case.findall("failure")) for case in cases)
    assert int(suite.get("errors")) == sum(len(case.findall("error")) for case in cases)
    return suite
