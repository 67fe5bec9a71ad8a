"""The gate's outputs: gate.json and JUnit XML, one testcase per check (`write_gate`, `junit_xml`)."""

import json
import xml.etree.ElementTree as ET

from onboard.gate import evaluate_gate, write_gate

from .runs import DISTRIBUTION_CHECKS, SPEC, TOKEN_CHECKS, junit_suite, make_run, passing_metrics


def test_write_gate_writes_the_result_and_junit(tmp_path):
    run = make_run(tmp_path / "run")
    result = evaluate_gate(run)
    junit = tmp_path / "reports" / "gate.xml"
    write_gate(run, result, junit)
    assert json.loads((run / "gate.json").read_text()) == result
    assert ET.fromstring(junit.read_text()).tag == "testsuites"


def _cases_with(suite: ET.Element, tag: str) -> set[str]:
    return {case.get("name") for case in suite.findall("testcase") if case.find(tag) is not None}


def test_junit_passing(tmp_path):
    suite = junit_suite(evaluate_gate(make_run(tmp_path / "run")))
    assert suite.get("failures") == "0"
    assert suite.get("errors") == "0"
    assert _cases_with(suite, "failure") == _cases_with(suite, "error") == set()


def test_junit_failing_checks_have_failures(tmp_path):
    metrics = passing_metrics()
    metrics["eval"]["mean_kld"] = 0.9
    metrics["smoke"]["garbage_rate"] = 0.25
    suite = junit_suite(evaluate_gate(make_run(tmp_path / "run", metrics)))
    assert _cases_with(suite, "failure") == {"mean_kld", "garbage_excess"}
    assert _cases_with(suite, "error") == set()
    assert suite.get("failures") == "2"
    failure = next(c for c in suite.findall("testcase") if c.get("name") == "mean_kld").find("failure")
    assert "mean_kld" in failure.get("message")
    assert "0.9" in failure.get("message") and "0.5" in failure.get("message")


def test_junit_missing_stage_gives_errors(tmp_path):
    metrics = passing_metrics()
    metrics["eval"]["top1_agreement"] = 0.1
    suite = junit_suite(evaluate_gate(make_run(tmp_path / "run", metrics, skip_files=("smoke",))))
    smoke_checks = {name for name, spec in SPEC.items() if spec[0] == "smoke"}
    assert _cases_with(suite, "error") == smoke_checks
    assert _cases_with(suite, "failure") == {"top1_agreement"}
    assert suite.get("errors") == str(len(smoke_checks))
    assert suite.get("failures") == "1"
    error = next(c for c in suite.findall("testcase") if c.get("name") == "garbage_excess").find("error")
    assert "smoke" in error.get("message")


def test_junit_w4a4_run_has_the_distribution_testcases(tmp_path):
    metrics = passing_metrics("layerwise_distribution")
    metrics["adapt"]["layerwise"]["max_floor_ratio"] = 6.5
    suite = junit_suite(evaluate_gate(make_run(tmp_path / "run", metrics)))
    names = {case.get("name") for case in suite.findall("testcase")}
    assert set(DISTRIBUTION_CHECKS) <= names and not names & set(TOKEN_CHECKS)
    assert _cases_with(suite, "failure") == {"parity_layer_ratio"}
    failure = next(c for c in suite.findall("testcase") if c.get("name") == "parity_layer_ratio").find("failure")
    assert "6.5" in failure.get("message") and "4.0" in failure.get("message")


def test_junit_is_escaped(tmp_path):
    """Values land in attributes; the XML must stay well-formed whatever they are."""
    result = evaluate_gate(make_run(tmp_path / "run"))
    result["checks"][0].update(value='<&"weird">', passed=False)
    result["passed"] = False
    suite = junit_suite(result)
    assert '<&"weird">' in suite.find("testcase").find("failure").get("message")
