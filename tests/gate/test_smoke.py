"""smoke's checks: rates in excess of the reference's, and batch invariance when the recipe requires it."""

import pytest

from onboard.gate import evaluate_gate, exit_code
from onboard.recipes import Gate

from .runs import by_name, failed_names, make_run, passing_metrics


def test_batch_invariance_failure_fails_only_that_check(tmp_path):
    metrics = passing_metrics()
    metrics["smoke"]["batch_invariant"] = False
    result = evaluate_gate(make_run(tmp_path / "run", metrics))
    assert failed_names(result) == {"batch_invariant"}
    assert by_name(result)["batch_invariant"]["value"] is False
    assert exit_code(result) == 1


def test_excess_is_measured_against_the_reference(tmp_path):
    """A high loop rate the reference shares passes; the same rate over a clean reference fails."""
    metrics = passing_metrics()
    metrics["smoke"].update(loop_rate=0.6, reference_loop_rate=0.55)
    assert evaluate_gate(make_run(tmp_path / "shared", metrics))["passed"] is True
    metrics["smoke"].update(reference_loop_rate=0.0)
    result = evaluate_gate(make_run(tmp_path / "own", metrics))
    assert failed_names(result) == {"loop_rate_excess"}
    assert by_name(result)["loop_rate_excess"]["value"] == pytest.approx(0.6)


def test_artifact_better_than_reference_passes(tmp_path):
    metrics = passing_metrics()
    metrics["smoke"].update(run_on_rate=0.0, reference_run_on_rate=0.5)
    result = evaluate_gate(make_run(tmp_path / "run", metrics))
    assert by_name(result)["run_on_excess"]["value"] == pytest.approx(-0.5)
    assert result["passed"] is True


@pytest.mark.parametrize(("required", "passes"), [(True, False), (False, True)])
def test_batch_invariance_only_required_when_the_recipe_says_so(tmp_path, required, passes):
    metrics = passing_metrics()
    metrics["smoke"]["batch_invariant"] = False
    gate = Gate(require_batch_invariance=required)
    result = evaluate_gate(make_run(tmp_path / "run", metrics, gate=gate))
    assert result["passed"] is passes
    assert failed_names(result) == (set() if passes else {"batch_invariant"})
    assert by_name(result)["batch_invariant"]["threshold"] is required


def test_batch_invariant_run_passes_whether_or_not_required(tmp_path):
    run = make_run(tmp_path / "run")
    for required in (True, False):
        assert evaluate_gate(run, Gate(require_batch_invariance=required))["passed"] is True
