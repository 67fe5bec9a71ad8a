"""`onboard gate`: the run's measurements against the recipe's release thresholds -> a verdict.

Exit codes (what CI acts on): 0 every check passed, 1 a check failed, 2 a stage it needs is
missing (or the input is bad). Every check lands in `gate.json` and, on request, in JUnit XML
with one testcase each, so a CI dashboard shows which threshold a release missed.
"""

import json
import math
import operator
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from operator import itemgetter
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from rich.table import Table

from onboard import atomic
from onboard.errors import OnboardError
from onboard.models.mtp import mtp_entries
from onboard.models.vlm import vision_entries
from onboard.recipes import Gate, describe
from onboard.workspace import (
    ARTIFACT,
    GATE,
    KL,
    LAYERWISE,
    MANIFEST,
    PARITY,
    SELECTION,
    SMOKE,
    SPECULATOR_METRICS,
    at_endpoint,
    read_manifest,
)

PASSED, FAILED, INCOMPLETE = 0, 1, 2

_STAGE_FILES = {"quantize": SELECTION, "eval": KL, "speculator": SPECULATOR_METRICS, "adapt": PARITY, "smoke": SMOKE}


@dataclass(frozen=True)
class Check:
    name: str
    stage: str
    threshold_key: str
    compare: Callable[[Any, Any], bool]
    value: Callable[[dict], Any]
    # adapt's parity rules the check belongs to (parity.json `rule`); empty: every run
    rules: tuple[str, ...] = ()
    # A metrics key whose text says why the value is null: the check is then not measured (the run
    # incomplete), not malformed: the speculator over the memory budget without a deployment,
    # smoke's batch invariance through transformers.
    note_key: str | None = None


# adapt's rule for artifacts without 4-bit activations (bf16, FP8, weight-only) and for parity.json
# files older than the `rule` key; artifacts with 4-bit activations get the layerwise-distribution rule.
TOKEN_RULES = ("bitwise", "near_tie")
DISTRIBUTION_RULES = ("layerwise_distribution",)
# Over the memory budget adapt runs only layer by layer (adapt/layerwise.json): its floors judge.
LAYERWISE_RULES = ("layerwise",)


def _excess(key: str) -> Callable[[dict], float]:
    return lambda m: m[key] - m[f"reference_{key}"]


def _required(value: bool, required: bool) -> bool:
    return value or not required


def _worst(key: str) -> Callable[[dict], float]:
    """The larger of exact's and fast's value of a distribution-rule statistic; a NaN on either
    side is the value (`max` would drop one in second place)."""

    def worst(m: dict) -> float:
        values = (m["distribution"][key], m["fast"]["distribution"][key])
        return next((v for v in values if isinstance(v, float) and math.isnan(v)), max(values))

    return worst


def _mtp_kept(selection: dict) -> bool:
    """The source's MTP layers are in the artifact (`quantize/mtp_carry.py`; checked again on the
    artifact's files by `_stage_results`). A source without them has nothing to lose; a selection
    written before onboard carried them records nothing, and is not judged on them."""
    return bool(selection.get("mtp", {}).get("kept", True))


def _vision_kept(selection: dict) -> bool:
    """A VLM's vision tower is in the artifact byte for byte (`quantize/kept.py`; its tensors counted
    again on the artifact's files by `_stage_results`); a text model has none to lose."""
    return bool(selection.get("vision", {}).get("kept", True))


CHECKS = (
    Check("mtp_kept", "quantize", "require_mtp_kept", _required, _mtp_kept),
    Check("vision_kept", "quantize", "require_vision_kept", _required, _vision_kept),
    Check("mean_kld", "eval", "max_mean_kld", operator.le, itemgetter("mean_kld")),
    Check("top1_agreement", "eval", "min_top1_agreement", operator.ge, itemgetter("top1_agreement")),
    Check(
        "acceptance_length",
        "speculator",
        "min_acceptance_length",
        operator.ge,
        itemgetter("acceptance_length"),
        note_key="acceptance_note",
    ),
    Check(
        "parity_logit_diff",
        "adapt",
        "max_parity_logit_diff",
        operator.le,
        itemgetter("max_abs_logit_diff"),
        TOKEN_RULES,
    ),
    Check(
        "parity_top1_agreement",
        "adapt",
        "min_parity_top1_agreement",
        operator.ge,
        itemgetter("top1_agreement"),
        TOKEN_RULES,
    ),
    Check("loop_rate_excess", "smoke", "max_loop_rate_excess", operator.le, _excess("loop_rate")),
    Check("run_on_excess", "smoke", "max_run_on_excess", operator.le, _excess("run_on_rate")),
    Check("near_duplicate_excess", "smoke", "max_near_duplicate_excess", operator.le, _excess("near_duplicate_rate")),
    Check("entropy_ratio", "smoke", "min_entropy_ratio", operator.ge, itemgetter("entropy_ratio")),
    Check("garbage_excess", "smoke", "max_garbage_excess", operator.le, _excess("garbage_rate")),
    Check(
        "batch_invariant",
        "smoke",
        "require_batch_invariance",
        _required,
        itemgetter("batch_invariant"),
        note_key="invariance_note",  # smoke through transformers (--skip-adapt): no serving engine
    ),
    # The numerics that serve, against the same reference: every divergence a near-tie.
    Check("fast_parity", "adapt", "require_fast_parity", _required, lambda m: m["fast"]["logprobs_close"], TOKEN_RULES),
    # 4-bit activations: both numerics' distributions against transformers' and the source's, and
    # every layer and linear against its floor (adapt/distribution.py, adapt/layerwise.py).
    Check("parity_kl_ratio", "adapt", "max_parity_kl_ratio", operator.le, _worst("kl_ratio"), DISTRIBUTION_RULES),
    Check(
        "parity_damage_diff", "adapt", "max_parity_damage_diff", operator.le, _worst("damage_diff"), DISTRIBUTION_RULES
    ),
    Check(
        "parity_layer_ratio",
        "adapt",
        "max_parity_layer_ratio",
        operator.le,
        lambda m: m["layerwise"]["max_floor_ratio"],
        DISTRIBUTION_RULES + LAYERWISE_RULES,
    ),
    Check(
        "parity_linear_ratio",
        "adapt",
        "max_parity_linear_ratio",
        operator.le,
        lambda m: m["layerwise"]["max_linear_ratio"],
        DISTRIBUTION_RULES + LAYERWISE_RULES,
    ),
)


def gate_with_overrides(gate: Gate, settings: list[str]) -> Gate:
    """`--set max_mean_kld=0.3`: each NAME=VALUE validated by the recipe schema."""
    values = gate.model_dump()
    for setting in settings:
        name, sep, value = setting.partition("=")
        if not sep or name not in values:
            known = ", ".join(values)
            raise OnboardError(f"--set {setting!r}: expected NAME=VALUE with NAME one of {known}")
        values[name] = value
    try:
        return Gate.model_validate(values)
    except ValidationError as err:
        problem = err.errors()[0]
        raise OnboardError(f"--set {problem['loc'][0]}={problem.get('input')!r}: {problem['msg']}") from err


def _load_metrics(path: Path) -> dict:
    try:
        metrics = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise OnboardError(f"{path} is unreadable: {err}") from err
    if not isinstance(metrics, dict):
        raise OnboardError(f"{path} is not a JSON object")
    return metrics


def _stage_results(run_dir: Path) -> dict[str, dict | None]:
    stages = read_manifest(run_dir)["stages"]
    found: dict[str, dict | None] = {}
    for stage, relative in _STAGE_FILES.items():
        path = run_dir / relative
        done = stages.get(stage, {}).get("status") == "done"
        found[stage] = _load_metrics(path) if done and path.is_file() else None
    layerwise = run_dir / LAYERWISE
    if found["adapt"] is None and stages.get("adapt_layerwise", {}).get("status") == "done" and layerwise.is_file():
        found["adapt"] = {"rule": "layerwise", "layerwise": _load_metrics(layerwise)}
    selection = found["quantize"]
    if selection is not None and (selection.get("mtp") or {}).get("tensors"):
        # Still there: a later rewrite of the artifact (a re-save, another tool) may have dropped them.
        present = len(mtp_entries(run_dir / ARTIFACT))
        selection["mtp"] = {
            **selection["mtp"],
            "kept": selection["mtp"]["kept"] and present == selection["mtp"]["tensors"],
        }
    if selection is not None and (selection.get("vision") or {}).get("tensors"):
        present = len(vision_entries(run_dir / ARTIFACT))
        selection["vision"] = {
            **selection["vision"],
            "kept": selection["vision"]["kept"] and present == selection["vision"]["tensors"],
        }
    speculator = found["speculator"]
    if speculator is not None and speculator.get("acceptance_length") is None:
        found["speculator"] = _served_acceptance(run_dir) or speculator
    return found


def _served_acceptance(run_dir: Path) -> dict | None:
    """A speculator trained over the memory budget without a deployment has no acceptance; once the
    artifact is served with it, `onboard speculator RUN_DIR --endpoint URL` measures it into
    endpoints/NAME/speculator/metrics.json: the latest such measurement stands in."""
    measured = sorted(run_dir.glob(at_endpoint("*", SPECULATOR_METRICS)), key=lambda p: p.stat().st_mtime)
    for path in reversed(measured):
        metrics = _load_metrics(path)
        if _finite(metrics.get("acceptance_length")):
            return metrics
    return None


def _value(check: Check, metrics: dict, path: Path) -> float | bool | None:
    """The check's value; None when its stage recorded it as not measured (`Check.note_key`)."""
    try:
        value = check.value(metrics)
    except KeyError as err:
        raise OnboardError(f"{path} has no {err.args[0]!r}, which check {check.name} needs") from err
    except TypeError as err:  # a string or null where a number belongs
        raise OnboardError(f"{path}: check {check.name} needs numbers, found {err}") from err
    if value is None and check.note_key and isinstance(metrics.get(check.note_key), str):
        return None
    required = check.threshold_key.startswith("require_")
    if not (isinstance(value, bool) if required else _finite(value)):
        raise OnboardError(f"{path}: check {check.name} needs a finite number, found {value!r}")
    return value


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def evaluate_gate(run_dir: Path, gate: Gate | None = None) -> dict[str, Any]:
    """Every check with its value, threshold and result; `gate` None: the run's recipe."""
    run_dir = Path(run_dir)
    if gate is None:
        recorded = read_manifest(run_dir).get("recipe", {}).get("gate")
        try:
            gate = Gate.model_validate(recorded) if recorded else Gate()
        except ValidationError as err:
            raise OnboardError(f"{run_dir / MANIFEST}: the recorded gate is invalid: {describe(err)}") from err
    results = _stage_results(run_dir)
    thresholds = gate.model_dump()
    rule = parity_rule(results["adapt"], run_dir)
    checks = []
    for check in CHECKS:
        if check.rules and rule not in check.rules:
            continue
        threshold = thresholds[check.threshold_key]
        metrics = results[check.stage]
        value = _value(check, metrics, run_dir / _STAGE_FILES[check.stage]) if metrics is not None else None
        passed = value is not None and bool(check.compare(value, threshold))
        entry = {"name": check.name, "stage": check.stage, "value": value, "threshold": threshold, "passed": passed}
        if metrics is not None and value is None:  # its stage ran and said why it has no value
            entry["note"] = metrics[check.note_key]
        checks.append(entry)
    missing = [stage for stage, metrics in results.items() if metrics is None]
    stages = read_manifest(run_dir)["stages"]
    return {
        "passed": not missing and all(c["passed"] for c in checks),
        "complete": not missing and not any("note" in c for c in checks),
        "missing": missing,
        # missing stages the run chose not to run (`onboard run --skip-adapt`), with why
        "skipped": {s: stages[s].get("reason", "") for s in missing if stages.get(s, {}).get("status") == "skipped"},
        "parity_rule": rule,
        "checks": checks,
    }


def parity_rule(parity: dict | None, run_dir: Path) -> str:
    """The rule adapt judged by (`near_tie` when adapt has not run or predates the key)."""
    rule = "near_tie" if parity is None else parity.get("rule", "near_tie")
    if rule not in TOKEN_RULES + DISTRIBUTION_RULES + LAYERWISE_RULES:
        raise OnboardError(f"{run_dir / _STAGE_FILES['adapt']}: unknown parity rule {rule!r}")
    return rule


def exit_code(result: dict[str, Any]) -> int:
    if not result["complete"]:
        return INCOMPLETE
    return PASSED if result["passed"] else FAILED


def junit_xml(result: dict[str, Any]) -> str:
    """One testcase per check; a missing stage is an error, a missed threshold a failure."""
    checks = result["checks"]
    suite = ET.Element(
        "testsuite",
        name="onboard.gate",
        tests=str(len(checks)),
        failures=str(sum(c["value"] is not None and not c["passed"] for c in checks)),
        errors=str(sum(c["value"] is None for c in checks)),
        skipped="0",
        time="0",
    )
    for check in checks:
        classname = f"onboard.gate.{check['stage']}"
        case = ET.SubElement(suite, "testcase", classname=classname, name=check["name"], time="0")
        if "note" in check:
            ET.SubElement(case, "error", message=f"{check['name']} {check['note']}", type="not_measured")
        elif check["value"] is None:
            ET.SubElement(case, "error", message=f"stage '{check['stage']}' has not run", type="missing")
        elif not check["passed"]:
            message = f"{check['name']} = {check['value']!r} misses threshold {check['threshold']!r}"
            ET.SubElement(case, "failure", message=message, type="threshold")
    root = ET.Element("testsuites")
    root.append(suite)
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def write_gate(run_dir: Path, result: dict[str, Any], junit: Path | None) -> None:
    atomic.write_json(Path(run_dir) / GATE, result)
    if junit is not None:
        atomic.write_text(junit, junit_xml(result))


def gate_table(result: dict[str, Any]) -> Table:
    verdict = "PASS" if result["passed"] else ("INCOMPLETE" if not result["complete"] else "FAIL")
    table = Table(title=f"gate: {verdict}", title_justify="left")
    for column in ("check", "stage", "value", "threshold", "result"):
        table.add_column(column, justify="left" if column in ("check", "stage") else "right")
    for check in result["checks"]:
        value = "not measured" if "note" in check else "missing" if check["value"] is None else _shown(check["value"])
        mark = "[green]pass[/]" if check["passed"] else "[red]fail[/]"
        table.add_row(check["name"], check["stage"], value, _shown(check["threshold"]), mark)
    return table


def _shown(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
