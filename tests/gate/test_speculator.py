"""The speculator's acceptance check: not measured over the memory budget until a deployment measures it."""

import json

from onboard.gate import evaluate_gate, exit_code

from .runs import by_name, failed_names, make_run, passing_metrics


def test_an_unmeasured_speculator_is_incomplete_until_a_deployment_measures_it(tmp_path):
    """Trained over the memory budget without a deployment: acceptance null with a note, so the run
    is incomplete; `onboard speculator RUN --endpoint URL` later measures the served artifact."""
    metrics = passing_metrics()
    metrics["speculator"] = {"acceptance_length": None, "acceptance_note": "measure it on a deployment"}
    root = make_run(tmp_path / "run", metrics)
    result = evaluate_gate(root)
    assert result["complete"] is False and exit_code(result) == 2
    assert by_name(result)["acceptance_length"]["note"] == "measure it on a deployment"
    served = root / "endpoints/vllm/speculator/metrics.json"
    served.parent.mkdir(parents=True)
    served.write_text(json.dumps({"acceptance_length": 2.1}))
    result = evaluate_gate(root)
    assert result["complete"] is True and result["passed"] is True
    assert by_name(result)["acceptance_length"]["value"] == 2.1
    served.write_text(json.dumps({"acceptance_length": 1.0}))
    assert failed_names(evaluate_gate(root)) == {"acceptance_length"}
