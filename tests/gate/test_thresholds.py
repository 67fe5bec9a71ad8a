"""Every check against its threshold: what it reads, its own threshold, one past it and one on it."""

import json

import pytest

from onboard.gate import CHECKS, evaluate_gate, exit_code
from onboard.recipes import Gate

from .runs import (
    CHECK_NAMES,
    DISTRIBUTION_CHECKS,
    LAYERWISE_CHECKS,
    NUMERIC,
    RULES,
    SPEC,
    TOKEN_CHECKS,
    by_name,
    expected_value,
    failed_names,
    failing_value,
    make_run,
    passing_metrics,
    rule_checks,
    rule_of,
    set_value,
)


def test_spec_covers_every_check():
    assert [check.name for check in CHECKS] == list(SPEC)
    assert {check.name: check.stage for check in CHECKS} == {name: spec[0] for name, spec in SPEC.items()}
    assert set(Gate.model_fields) == {spec[2] for spec in SPEC.values()}
    rules = {check.name: set(check.rules) for check in CHECKS}
    for name in SPEC:
        if name in TOKEN_CHECKS:
            assert rules[name] == {"bitwise", "near_tie"}, name
        elif name in LAYERWISE_CHECKS:
            assert rules[name] == {"layerwise_distribution", "layerwise"}, name
        elif name in DISTRIBUTION_CHECKS:
            assert rules[name] == {"layerwise_distribution"}, name
        else:
            assert rules[name] == set(), name
    assert set(rule_checks("near_tie")) | set(rule_checks("layerwise_distribution")) == set(CHECK_NAMES)


@pytest.mark.parametrize("rule", RULES)
def test_passing_run(tmp_path, rule):
    metrics = passing_metrics(rule)
    result = evaluate_gate(make_run(tmp_path / "run", metrics))
    assert result["passed"] is True
    assert result["complete"] is True
    assert result["missing"] == []
    assert result["parity_rule"] == rule
    assert exit_code(result) == 0
    assert [check["name"] for check in result["checks"]] == rule_checks(rule)
    defaults = Gate().model_dump()
    for check in result["checks"]:
        stage, _, threshold_key, _ = SPEC[check["name"]]
        assert check["passed"] is True, check
        assert check["stage"] == stage
        assert check["value"] == expected_value(check["name"], metrics)
        assert check["threshold"] == defaults[threshold_key]
    # gate.json: exactly this result, JSON-serializable.
    json.dumps(result, allow_nan=False)
    assert set(result) == {"passed", "complete", "missing", "skipped", "parity_rule", "checks"}
    assert all(set(check) == {"name", "stage", "value", "threshold", "passed"} for check in result["checks"])


def test_each_check_reads_its_own_threshold(tmp_path):
    """Every threshold distinct, so a check compared against another's threshold shows up."""
    distinct = Gate(
        require_mtp_kept=True,
        require_vision_kept=True,
        max_mean_kld=0.41,
        min_top1_agreement=0.52,
        min_acceptance_length=1.13,
        max_loop_rate_excess=0.14,
        max_run_on_excess=0.15,
        max_near_duplicate_excess=0.16,
        min_entropy_ratio=0.47,
        max_garbage_excess=0.018,
        max_parity_logit_diff=0.39,
        min_parity_top1_agreement=0.991,
        require_batch_invariance=True,
        require_fast_parity=True,
        max_parity_kl_ratio=0.48,
        max_parity_damage_diff=0.052,
        max_parity_layer_ratio=3.9,
        max_parity_linear_ratio=2.1,
    )
    values = distinct.model_dump()
    assert len({v for v in values.values() if not isinstance(v, bool)}) == len(values) - 4
    seen = set()
    for rule in ("near_tie", "layerwise_distribution"):
        result = evaluate_gate(make_run(tmp_path / rule, passing_metrics(rule)), distinct)
        for check in result["checks"]:
            assert check["threshold"] == values[SPEC[check["name"]][2]], check["name"]
            seen.add(check["name"])
        assert result["passed"] is True, rule
    assert seen == set(SPEC)


@pytest.mark.parametrize("name", NUMERIC)
def test_one_metric_past_its_threshold_fails_only_that_check(tmp_path, name):
    threshold = Gate().model_dump()[SPEC[name][2]]
    metrics = passing_metrics(rule_of(name))
    bad = failing_value(name, threshold)
    set_value(metrics, name, bad, reference=0.2)
    result = evaluate_gate(make_run(tmp_path / "run", metrics))
    assert failed_names(result) == {name}
    check = by_name(result)[name]
    assert check["value"] == pytest.approx(bad)
    assert check["threshold"] == threshold
    assert result["passed"] is False
    assert result["complete"] is True
    assert exit_code(result) == 1


@pytest.mark.parametrize("name", NUMERIC)
def test_value_on_the_threshold_passes(tmp_path, name):
    threshold = Gate().model_dump()[SPEC[name][2]]
    metrics = passing_metrics(rule_of(name))
    set_value(metrics, name, threshold, reference=0.0)  # reference 0: the excess is exact
    result = evaluate_gate(make_run(tmp_path / "run", metrics))
    assert by_name(result)[name]["value"] == threshold
    assert result["passed"] is True, failed_names(result)
