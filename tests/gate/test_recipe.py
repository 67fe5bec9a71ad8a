"""Where the thresholds come from: the recorded recipe, an explicit gate, and `--set` overrides."""

import pytest

from onboard.errors import OnboardError
from onboard.gate import evaluate_gate, exit_code, gate_with_overrides
from onboard.recipes import Gate

from .runs import SPEC, by_name, failed_names, make_run, passing_metrics


def test_recorded_recipe_thresholds_are_used(tmp_path):
    """Tightening a threshold in the manifest's recipe makes that check (and only it) fail."""
    run = make_run(tmp_path / "run", gate=Gate(max_mean_kld=0.01))
    result = evaluate_gate(run)
    assert failed_names(result) == {"mean_kld"}
    assert by_name(result)["mean_kld"]["threshold"] == 0.01
    # The same directory with the default recipe passes: it is the recorded recipe that failed it.
    assert evaluate_gate(make_run(tmp_path / "default"))["passed"] is True


def test_recorded_recipe_loosened_threshold_lets_a_value_pass(tmp_path):
    metrics = passing_metrics()
    metrics["speculator"]["acceptance_length"] = 1.1  # below the default 1.2
    assert failed_names(evaluate_gate(make_run(tmp_path / "default", metrics))) == {"acceptance_length"}
    loose = make_run(tmp_path / "loose", metrics, gate=Gate(min_acceptance_length=1.05))
    assert evaluate_gate(loose)["passed"] is True


def test_explicit_gate_overrides_the_recorded_recipe(tmp_path):
    run = make_run(tmp_path / "run", gate=Gate(max_mean_kld=0.01))
    assert evaluate_gate(run, Gate())["passed"] is True


def test_manifest_without_recipe_uses_default_thresholds(tmp_path):
    result = evaluate_gate(make_run(tmp_path / "run", recipe=False))
    assert result["passed"] is True
    defaults = Gate().model_dump()
    assert all(check["threshold"] == defaults[SPEC[check["name"]][2]] for check in result["checks"])


# --- gate_with_overrides -------------------------------------------------------------------------


def test_set_tightens_a_threshold():
    gate = gate_with_overrides(Gate(), ["max_mean_kld=0.01"])
    assert gate.max_mean_kld == 0.01
    assert gate.model_dump() == {**Gate().model_dump(), "max_mean_kld": 0.01}


def test_set_several_and_bool():
    base = Gate(min_acceptance_length=2.0)
    gate = gate_with_overrides(base, ["min_top1_agreement=0.9", "require_batch_invariance=false"])
    assert gate.min_top1_agreement == 0.9
    assert gate.require_batch_invariance is False
    assert gate.min_acceptance_length == 2.0  # what was not set keeps the recipe's value
    assert base.min_top1_agreement == 0.6  # the recipe's gate itself is untouched


def test_set_nothing_keeps_the_gate():
    base = Gate(max_garbage_excess=0.02)
    assert gate_with_overrides(base, []) == base


def test_set_last_value_wins():
    assert gate_with_overrides(Gate(), ["max_mean_kld=0.2", "max_mean_kld=0.3"]).max_mean_kld == 0.3


def test_set_override_flips_the_verdict(tmp_path):
    run = make_run(tmp_path / "run")
    assert exit_code(evaluate_gate(run, gate_with_overrides(Gate(), []))) == 0
    result = evaluate_gate(run, gate_with_overrides(Gate(), ["max_mean_kld=0.01"]))
    assert failed_names(result) == {"mean_kld"}
    assert exit_code(result) == 1


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ("nosuch=1", "nosuch"),
        ("max_mean_kld", "max_mean_kld"),  # no '='
        ("=0.3", "max_mean_kld"),  # no name: the message lists the known ones
        ("max_mean_kld=-1", "max_mean_kld"),
        ("max_mean_kld=abc", "max_mean_kld"),
        ("max_mean_kld=", "max_mean_kld"),
        ("min_top1_agreement=1.5", "min_top1_agreement"),
        ("min_acceptance_length=0.5", "min_acceptance_length"),
        ("require_batch_invariance=maybe", "require_batch_invariance"),
    ],
)
def test_bad_set_names_the_setting(setting, named):
    with pytest.raises(OnboardError, match=r"--set") as err:
        gate_with_overrides(Gate(), [setting])
    assert named in str(err.value)


def test_bad_set_among_good_ones_still_fails():
    with pytest.raises(OnboardError, match="max_garbage_excess"):
        gate_with_overrides(Gate(), ["max_mean_kld=0.1", "max_garbage_excess=2"])
