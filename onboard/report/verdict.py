"""The verdict card: PASS / FAIL / INCOMPLETE from the release gate, and the headline numbers."""

from typing import Any

from onboard.errors import OnboardError
from onboard.report.fmt import MISSING, is_num, mb, num, pct, ratio
from onboard.report.load import Run, as_dict, as_list
from onboard.workspace import GATE, KL, MANIFEST, SELECTION, SMOKE, SPECULATOR_METRICS


def gate_result(run: Run) -> tuple[dict[str, Any] | None, str]:
    """The gate's verdict and where it came from: `gate.json` when the run has one written after
    its last stage finished (it may carry `--set` overrides), else the gate evaluated now."""
    gate = run.json(GATE)
    written, manifest = run.dir / GATE, run.dir / MANIFEST
    if gate is not None and (not manifest.exists() or written.stat().st_mtime >= manifest.stat().st_mtime):
        return gate, GATE
    from onboard.gate import evaluate_gate

    try:
        result = evaluate_gate(run.dir)
    except (OnboardError, OSError, ValueError, KeyError, TypeError) as exc:
        # A run too broken to gate (bad manifest, invalid thresholds) still gets its report.
        return None, f"gate not evaluated: {exc}"
    return (result, "evaluated at report time") if isinstance(result, dict) else (None, "gate not evaluated")


def decide(gate: dict[str, Any] | None) -> str:
    """The same verdict `onboard gate` prints: a missing stage makes the run INCOMPLETE (even when
    a measured check already fails; those are listed anyway), else PASS only when the gate passed."""
    if gate is None:
        return "NOT EVALUATED"
    if gate.get("complete") is False:
        return "INCOMPLETE"
    checks = [as_dict(c) for c in as_list(gate.get("checks"))]
    if gate.get("passed") is True and not any(c.get("passed") is False for c in checks):
        return "PASS"
    return "FAIL"


def headlines(run: Run) -> list[dict[str, Any]]:
    """The numbers a reviewer reads first: (key, label, value, detail, stage, words naming its checks)."""
    kl = run.json(KL) or run.metrics("eval")
    sel = run.json(SELECTION) or {}
    quant = run.metrics("quantize")
    spec = run.json(SPECULATOR_METRICS) or run.metrics("speculator")
    smoke = run.json(SMOKE) or {}
    before, after = quant.get("bytes_reference"), quant.get("bytes_artifact")
    ref_loop, invariant, speedup = smoke.get("reference_loop_rate"), smoke.get("batch_invariant"), spec.get("speedup")
    draft, shrink = spec.get("num_speculative_tokens"), ratio(before, after)
    accept_detail = f"{num(draft)} draft tokens" if draft is not None else ""
    if spec.get("acceptance_length") is None and spec.get("acceptance_note"):  # over the memory budget
        accept_detail = "not measured (see the speculator card)"
    rows = [
        ("mean_kld", "Mean KLD", num(kl.get("mean_kld")),
         f"p99 {num(kl.get('p99_kld'))}" if "p99_kld" in kl else "", "eval", ("kld",)),
        ("top1", "Top-1 agreement", pct(kl.get("top1_agreement")), "vs reference", "eval", ("top1", "agreement")),
        ("bits", "Effective bits", num(sel.get("effective_bits", quant.get("effective_bits"))),
         str(sel.get("scheme", quant.get("scheme", ""))), "quantize", ("bits",)),
        ("size", "Size on disk", mb(after), f"from {mb(before)}, {shrink} smaller" if is_num(before) else "",
         "quantize", ("size", "bytes")),
        ("acceptance", "Acceptance length", num(spec.get("acceptance_length")),
         accept_detail, "speculator", ("acceptance",)),
        ("speedup", "Speculator speed-up", f"{num(speedup)}×" if is_num(speedup) else MISSING,
         "decode, vs no speculator", "speculator", ("speed",)),
        ("loop", "Loop rate", pct(smoke.get("loop_rate")), f"reference {pct(ref_loop)}" if ref_loop is not None else "",
         "smoke", ("loop",)),
        ("invariant", "Batch invariant", num(invariant) if isinstance(invariant, bool) else MISSING,
         "same output in any batch", "smoke", ("invarian",)),
    ]  # fmt: skip
    keys = ("key", "label", "value", "detail", "stage", "words")
    tiles = [dict(zip(keys, row, strict=True)) for row in rows]
    for tile in tiles:
        status = run.status(tile["stage"], has_output=tile["value"] != MISSING)
        if tile["value"] == MISSING and status != "done":
            tile["detail"] = f"{tile['stage']}: {status}"
    return tiles


def tone(tile: dict[str, Any], failed: list[dict[str, Any]]) -> str:
    """ "bad" when a failed gate check of the tile's stage names what the tile shows."""
    if tile["key"] == "invariant" and tile["value"] in ("yes", "no"):
        return "good" if tile["value"] == "yes" else "bad"
    for check in failed:
        name = str(check.get("name", "")).lower()
        stage = check.get("stage")
        if (stage in (None, tile["stage"])) and any(w in name for w in tile["words"]):
            return "bad"
    return ""


def build(run: Run) -> dict[str, Any]:
    gate, source = gate_result(run)
    checks = [as_dict(c) for c in as_list((gate or {}).get("checks"))]
    # A check without a value was not measured (its stage has not run): missing, not failed.
    failed = [c for c in checks if c.get("passed") is False and c.get("value") is not None]
    unmeasured = [c for c in checks if c.get("passed") is False and c.get("value") is None]
    tiles = headlines(run)
    for tile in tiles:
        tile["tone"] = tone(tile, failed)
    return {
        "state": decide(gate),
        "source": source,
        "checks": checks,
        "failed": failed,
        "unmeasured": unmeasured,
        "missing": [str(m) for m in as_list((gate or {}).get("missing"))],
        "skipped": {str(k): str(v) for k, v in as_dict((gate or {}).get("skipped")).items()},
        "tiles": tiles,
    }
