"""adapt's parity checks: the rule parity.json names picks the token or the distribution/layerwise checks."""

import copy
import json
from typing import Any

import pytest

from onboard.errors import OnboardError
from onboard.gate import evaluate_gate, exit_code
from onboard.recipes import Gate
from onboard.workspace import MANIFEST

from .runs import (
    DISTRIBUTION_CHECKS,
    LAYERWISE_CHECKS,
    PASSING_W4A4,
    SPEC,
    TOKEN_CHECKS,
    WORST,
    assert_missing,
    by_name,
    failed_names,
    make_run,
    metric_holder,
    passing_metrics,
)


@pytest.mark.parametrize(("required", "passes"), [(True, False), (False, True)])
def test_fast_parity_reads_the_fast_block_and_is_required_by_default(tmp_path, required, passes):
    metrics = passing_metrics()
    metrics["adapt"]["fast"]["logprobs_close"] = False  # exact's own parity still passes
    result = evaluate_gate(make_run(tmp_path / "run", metrics, gate=Gate(require_fast_parity=required)))
    assert result["passed"] is passes
    assert failed_names(result) == (set() if passes else {"fast_parity"})
    assert Gate().require_fast_parity is True


def test_a_parity_file_without_the_fast_block_is_named(tmp_path):
    metrics = passing_metrics()
    del metrics["adapt"]["fast"]  # written before fast numerics existed
    with pytest.raises(OnboardError, match=r"parity\.json has no 'fast', which check fast_parity needs"):
        evaluate_gate(make_run(tmp_path / "run", metrics))


def _adapt_checks(result: dict[str, Any]) -> list[str]:
    return [check["name"] for check in result["checks"] if check["stage"] == "adapt"]


def test_w4a4_run_is_gated_on_the_distribution_checks_only(tmp_path):
    """Its token figures (2.4 max |Δ logit|, 91 % top-1, fast not close) would fail three checks."""
    result = evaluate_gate(make_run(tmp_path / "run", passing_metrics("layerwise_distribution")))
    assert result["parity_rule"] == "layerwise_distribution"
    assert _adapt_checks(result) == list(DISTRIBUTION_CHECKS)
    assert not {check["name"] for check in result["checks"]} & set(TOKEN_CHECKS)
    assert result["passed"] is True
    assert exit_code(result) == 0


@pytest.mark.parametrize(("ratio", "passes"), [(1.5, True), (9.0, False)])
def test_a_run_over_budget_is_gated_on_its_layerwise_parity(tmp_path, ratio, passes):
    """Over the memory budget adapt runs only `--layerwise` (stage adapt_layerwise): its floor ratios
    are the adapt checks, and the run is complete without parity.json."""
    root = make_run(tmp_path / "run", passing_metrics(), skip_files=("adapt",), status={"adapt": None})
    manifest = json.loads((root / MANIFEST).read_text())
    manifest["stages"]["adapt_layerwise"] = {"status": "done", "metrics": {}}
    (root / MANIFEST).write_text(json.dumps(manifest))
    block = copy.deepcopy(PASSING_W4A4["adapt"]["layerwise"])
    block["max_floor_ratio"] = ratio
    (root / "adapt").mkdir(exist_ok=True)
    (root / "adapt/layerwise.json").write_text(json.dumps(block))
    result = evaluate_gate(root)
    assert result["complete"] is True
    assert result["parity_rule"] == "layerwise"
    assert _adapt_checks(result) == list(LAYERWISE_CHECKS)
    assert result["passed"] is passes


@pytest.mark.parametrize("rule", ["bitwise", "near_tie"])
def test_token_rule_run_is_gated_on_the_token_checks_only(tmp_path, rule):
    """Distribution and layerwise blocks that would fail every distribution check are not read."""
    metrics = passing_metrics(rule)
    failing_blocks = copy.deepcopy(PASSING_W4A4["adapt"])
    failing_blocks["distribution"].update(kl_ratio=9.0, damage_diff=0.9)
    failing_blocks["layerwise"].update(max_floor_ratio=40.0, max_linear_ratio=20.0, passed=False)
    metrics["adapt"]["distribution"] = failing_blocks["distribution"]
    metrics["adapt"]["layerwise"] = failing_blocks["layerwise"]
    result = evaluate_gate(make_run(tmp_path / "run", metrics))
    assert result["parity_rule"] == rule
    assert _adapt_checks(result) == list(TOKEN_CHECKS)
    assert not {check["name"] for check in result["checks"]} & set(DISTRIBUTION_CHECKS)
    assert result["passed"] is True
    metrics["adapt"]["top1_agreement"] = 0.9
    assert failed_names(evaluate_gate(make_run(tmp_path / "failing", metrics))) == {"parity_top1_agreement"}


def test_a_parity_file_without_a_rule_gets_the_token_checks(tmp_path):
    """parity.json written before the `rule` key counts as near_tie, failures and all."""
    metrics = passing_metrics()
    del metrics["adapt"]["rule"]
    result = evaluate_gate(make_run(tmp_path / "run", metrics))
    assert result["parity_rule"] == "near_tie"
    assert _adapt_checks(result) == list(TOKEN_CHECKS)
    assert result["passed"] is True
    metrics["adapt"]["max_abs_logit_diff"] = 3.0
    result = evaluate_gate(make_run(tmp_path / "failing", metrics))
    assert failed_names(result) == {"parity_logit_diff"}
    assert result["parity_rule"] == "near_tie"


@pytest.mark.parametrize("rule", ["w4a4", "NEAR_TIE", "layer_wise", "", None, 4])
def test_an_unknown_parity_rule_is_an_onboard_error(tmp_path, rule):
    metrics = passing_metrics()
    metrics["adapt"]["rule"] = rule
    with pytest.raises(OnboardError, match=r"parity\.json: unknown parity rule") as err:
        evaluate_gate(make_run(tmp_path / "run", metrics))
    assert repr(rule) in str(err.value)


@pytest.mark.parametrize("rule", ["layerwise_distribution", "w4a4"])
def test_adapt_not_run_is_the_near_tie_rule(tmp_path, rule):
    """A stale parity.json of a failed adapt stage (W4A4, or with a rule nobody knows) is not read:
    the token checks are listed as missing."""
    metrics = passing_metrics("layerwise_distribution")
    metrics["adapt"]["rule"] = rule
    result = evaluate_gate(make_run(tmp_path / "run", metrics, status={"adapt": "failed"}))
    assert result["parity_rule"] == "near_tie"
    assert _adapt_checks(result) == list(TOKEN_CHECKS)
    assert_missing(result, "adapt")


@pytest.mark.parametrize("side", ["distribution", "fast.distribution"])
@pytest.mark.parametrize("name", sorted(WORST))
def test_distribution_checks_read_the_worse_numerics(tmp_path, name, side):
    """Either numerics past the threshold fails the check, the other one passing."""
    threshold = Gate().model_dump()[SPEC[name][2]]
    metrics = passing_metrics("layerwise_distribution")
    holder, last = metric_holder(metrics, "adapt", f"{side}.{SPEC[name][1].split('.')[-1]}")
    bad = threshold + 0.05
    holder[last] = bad
    result = evaluate_gate(make_run(tmp_path / "run", metrics))
    assert failed_names(result) == {name}
    assert by_name(result)[name]["value"] == pytest.approx(bad)
    assert exit_code(result) == 1


def test_distribution_checks_value_is_the_larger_of_exact_and_fast(tmp_path):
    result = by_name(evaluate_gate(make_run(tmp_path / "run", passing_metrics("layerwise_distribution"))))
    assert result["parity_kl_ratio"]["value"] == 0.3  # fast's (exact: 0.002)
    assert result["parity_damage_diff"]["value"] == 0.021  # exact's (fast: 0.008)
    assert result["parity_layer_ratio"]["value"] == 1.6  # the worst layer's, not the recorded allowance 4.0
    assert result["parity_linear_ratio"]["value"] == 0.41  # not the recorded allowance 2.0


def test_a_broken_linear_fails_the_linear_check_only(tmp_path):
    """A 5 % scaled o_proj: its layer still within its floor ratio, the linear 8.7 times its step."""
    metrics = passing_metrics("layerwise_distribution")
    layerwise = metrics["adapt"]["layerwise"]
    layerwise["layers"][1].update(linear_ratio=8.7, worst_linear="model.layers.1.self_attn.o_proj", passed=False)
    layerwise.update(
        max_linear_ratio=8.7,
        passed=False,
        first_failing_layer="model.layers.1",
        first_failing_module="model.layers.1.self_attn.o_proj",
    )
    result = evaluate_gate(make_run(tmp_path / "run", metrics))
    assert failed_names(result) == {"parity_linear_ratio"}
    assert by_name(result)["parity_linear_ratio"]["value"] == 8.7
    # A looser recipe lets it through: the gate judges by the recipe, not by the file's `passed`.
    assert evaluate_gate(make_run(tmp_path / "loose", metrics, gate=Gate(max_parity_linear_ratio=10)))["passed"]


@pytest.mark.parametrize(
    ("key", "check"),
    [
        ("distribution", "parity_kl_ratio"),
        ("fast.distribution", "parity_kl_ratio"),
        ("distribution.damage_diff", "parity_damage_diff"),
        ("layerwise", "parity_layer_ratio"),
        ("layerwise.max_linear_ratio", "parity_linear_ratio"),
    ],
)
def test_a_w4a4_parity_file_without_a_figure_is_named(tmp_path, key, check):
    metrics = passing_metrics("layerwise_distribution")
    holder, last = metric_holder(metrics, "adapt", key)
    del holder[last]
    with pytest.raises(OnboardError, match=rf"parity\.json has no '{last}', which check {check} needs"):
        evaluate_gate(make_run(tmp_path / "run", metrics))


# The worst-of checks keep a NaN in second place (Python's max(exact, nan) would drop it, and
# fast numerics whose logits went NaN would pass on exact's figure).
W4A4_NOT_NUMBERS = [
    pytest.param(key, value)
    for key in (
        "distribution.kl_ratio",
        "fast.distribution.kl_ratio",
        "fast.distribution.damage_diff",
        "layerwise.max_floor_ratio",
        "layerwise.max_linear_ratio",
    )
    for value in (None, "0.1", float("nan"), float("inf"))
]


@pytest.mark.parametrize(("key", "value"), W4A4_NOT_NUMBERS)
def test_a_w4a4_figure_that_is_not_a_number_is_an_onboard_error(tmp_path, key, value):
    metrics = passing_metrics("layerwise_distribution")
    holder, last = metric_holder(metrics, "adapt", key)
    holder[last] = value
    with pytest.raises(OnboardError, match=r"parity\.json"):
        evaluate_gate(make_run(tmp_path / "run", metrics))
