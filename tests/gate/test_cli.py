"""`onboard gate` in processes of its own: gate.json, --junit, --set and the exit codes (0/1/2)."""

import json
import os
import xml.etree.ElementTree as ET

import pytest

from onboard.gate import evaluate_gate
from onboard.workspace import MANIFEST

from .runs import by_name, failed_names, junit_suite, make_run, passing_metrics


@pytest.fixture
def run_cli(onboard_process):
    """`onboard gate ARGS` in a process of its own (forked from a warm interpreter)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "COLUMNS": "120"}
    return lambda *args: onboard_process.run(["gate", *args], env=env)


def _assert_one_error_line(proc, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("onboard: error:")
    for needle in needles:
        assert needle in lines[0]


def test_cli_pass_writes_gate_json_and_junit(tmp_path, run_cli):
    run = make_run(tmp_path / "run")
    junit = tmp_path / "out.xml"
    proc = run_cli(run, "--junit", junit)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    written = json.loads((run / "gate.json").read_text())
    assert written["passed"] is True and written["complete"] is True
    assert written == evaluate_gate(run)
    suite = junit_suite(json.loads((run / "gate.json").read_text()))
    assert ET.fromstring(junit.read_text()).find("testsuite").get("tests") == suite.get("tests")
    assert ET.fromstring(junit.read_text()).find("testsuite").get("failures") == "0"


def test_cli_failing_run_exits_1(tmp_path, run_cli):
    metrics = passing_metrics()
    metrics["adapt"]["max_abs_logit_diff"] = 3.0
    run = make_run(tmp_path / "run", metrics)
    proc = run_cli(run)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    written = json.loads((run / "gate.json").read_text())
    assert written["passed"] is False and written["complete"] is True
    assert failed_names(written) == {"parity_logit_diff"}


def test_cli_failing_w4a4_run_exits_1(tmp_path, run_cli):
    metrics = passing_metrics("layerwise_distribution")
    metrics["adapt"]["fast"]["distribution"]["damage_diff"] = 0.12
    run = make_run(tmp_path / "run", metrics)
    proc = run_cli(run)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    written = json.loads((run / "gate.json").read_text())
    assert written["parity_rule"] == "layerwise_distribution"
    assert failed_names(written) == {"parity_damage_diff"}
    assert by_name(written)["parity_damage_diff"]["value"] == 0.12


def test_cli_incomplete_run_exits_2(tmp_path, run_cli):
    run = make_run(tmp_path / "run", status={"speculator": "failed"})
    proc = run_cli(run)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "speculator" in proc.stderr
    written = json.loads((run / "gate.json").read_text())
    assert written["complete"] is False and written["missing"] == ["speculator"]


def test_cli_not_a_run_dir(tmp_path, run_cli):
    plain = tmp_path / "plain"
    plain.mkdir()
    _assert_one_error_line(run_cli(plain), str(plain), MANIFEST)
    assert not (plain / "gate.json").exists()


def test_cli_unknown_set(tmp_path, run_cli):
    run = make_run(tmp_path / "run")
    _assert_one_error_line(run_cli(run, "--set", "nosuch=1"), "nosuch")
    assert not (run / "gate.json").exists()


def test_cli_set_flips_pass_to_fail(tmp_path, run_cli):
    """The passing run exits 0 (test_cli_pass_...); one tightened threshold makes it exit 1."""
    run = make_run(tmp_path / "run")
    proc = run_cli(run, "--set", "max_mean_kld=0.01")
    assert proc.returncode == 1, proc.stderr
    written = json.loads((run / "gate.json").read_text())
    assert failed_names(written) == {"mean_kld"}
    assert by_name(written)["mean_kld"]["threshold"] == 0.01
