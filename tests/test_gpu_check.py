"""scripts/gpu_check.py, the check prepared for a lent GPU, run on the CPU at `--shape tiny`: the JSON
has its throughput, parity (bf16, fp32, the FP8 and NVFP4 artifacts onboard's quantize stage makes)
and speculative-decoding sections with sane values, and the verdict fails for the reasons it
should, listing a conditional check whose phase was skipped as not checked."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from onboard.recipes import Gate

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
CONCURRENCY = (1, 4)
NEW_TOKENS = 16
SPEC_PROMPTS = 4
PARITY_PROMPTS = 2
PARITY_TOKENS = 16
CALIB_SAMPLES, CALIB_TOKENS = 2, 64
TINY_LAYERS = 2


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


@pytest.mark.slow  # 25-60 s on 2 busy cores
def test_tiny_run_on_cpu_writes_every_section(tmp_path: Path, gpu_check, onboard_process) -> None:
    out = tmp_path / "report" / "gpu_check.json"
    # The tiny shape with a smaller workload than its defaults, to stay quick on 2 cores; as
    # `python scripts/gpu_check.py ...` runs it, in a process forked from a warm interpreter.
    args = [
        "--shape=tiny",
        "--device=cpu",
        f"--out={out}",
        f"--workdir={tmp_path}",
        f"--concurrency={','.join(map(str, CONCURRENCY))}",
        f"--new-tokens={NEW_TOKENS}",
        f"--parity-prompts={PARITY_PROMPTS}",
        f"--parity-tokens={PARITY_TOKENS}",
        f"--spec-prompts={SPEC_PROMPTS}",
        "--spec-tokens=8",
        f"--calib-samples={CALIB_SAMPLES}",
        f"--calib-tokens={CALIB_TOKENS}",
        f"--phases={','.join(gpu_check.PHASES)}",
    ]
    proc = onboard_process.run(args, program=SCRIPT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "PASS: all checks passed"
    assert not list(tmp_path.glob("gpu_check-*")), "the temporary checkpoint was left behind"
    report = json.loads(out.read_text())
    assert report["passed"] is True and report["unchecked"] == []
    assert {name: row["status"] for name, row in report["phases"].items()} == dict.fromkeys(gpu_check.PHASES, "ok")
    assert all(row["elapsed_s"] > 0 for row in report["phases"].values())

    model = report["model"]
    assert model["parameters"] > 0
    assert model["logit_std"] > 0.1 and model["mean_entropy_nats"] < model["uniform_entropy_nats"]

    throughput = report["throughput"]
    assert throughput["numerics"] == "fast"
    assert [row["concurrency"] for row in throughput["results"]] == list(CONCURRENCY)
    for row in throughput["results"]:
        assert row["engine_tokens"] == row["hf_tokens"] == row["concurrency"] * NEW_TOKENS
        assert row["engine_tps"] > 0 and row["hf_tps"] > 0 and row["ratio"] > 0
        assert row["engine_preemptions"] == 0

    fp32, bf16 = report["parity"]["float32"], report["parity"]["bfloat16"]
    positions = PARITY_PROMPTS * (128 + PARITY_TOKENS)
    # Exact numerics on the CPU compute what transformers computes on one copy of the prompt, bit
    # for bit, in both dtypes.
    for row in (fp32, bf16):
        assert row["rule"] == "bitwise" and row["bitwise_equal_logits"] is True
        assert row["max_abs_logit_diff"] == 0.0 and row["mean_kld"] == 0.0
        assert row["top1_agreement"] == 1.0 and row["greedy_match_rate"] == 1.0
        assert row["num_positions"] == positions and len(row["cases"]) == PARITY_PROMPTS

    # The artifacts, made by onboard's quantize stage from the random model; every linear quantized.
    fp8, nvfp4 = report["parity"]["fp8"], report["parity"]["nvfp4"]
    linears = 7 * TINY_LAYERS
    assert fp8["quantize"]["scheme"] == "fp8" and fp8["quantize"]["quantized_layers"] == linears
    assert 8 < fp8["quantize"]["effective_bits"] < 8.5 and fp8["quantize"]["calibration_tokens"] == 0  # data-free
    assert nvfp4["quantize"]["scheme"] == "nvfp4" and nvfp4["quantize"]["quantized_layers"] == linears
    assert 4.4 < nvfp4["quantize"]["effective_bits"] < 4.6
    assert nvfp4["quantize"]["calibration_tokens"] == CALIB_SAMPLES * CALIB_TOKENS
    for row in (fp8, nvfp4):
        assert 0 < row["quantize"]["artifact_bytes"] < row["quantize"]["source_bytes"]
        assert row["load_s"]["transformers"] > 0
        assert row["dtype"] == "bfloat16" and row["num_positions"] == positions
        assert row["passed"] is True and row["failures"] == []

    # FP8: the token rules; on the CPU the exact engine is transformers on the artifact, bit for bit.
    assert fp8["rule"] == "bitwise" and fp8["max_abs_logit_diff"] == 0.0 and fp8["greedy_match_rate"] == 1.0
    assert fp8["thresholds"] == {"max_parity_logit_diff": 0.5, "min_parity_top1_agreement": 0.99}

    # NVFP4 W4A4: judged by the layerwise-distribution rule; the token figures are information.
    assert nvfp4["rule"] == "layerwise_distribution" and nvfp4["token_rule"] == "bitwise"
    exact, fast = nvfp4["distribution"]["exact"], nvfp4["distribution"]["fast"]
    assert exact["num_positions"] == fast["num_positions"] == positions
    assert exact["kl_source_transformers"] == fast["kl_source_transformers"] > 0  # the artifact is quantized
    assert exact["kl_transformers_engine"] == 0.0 and exact["kl_ratio"] == 0.0 and exact["damage_diff"] == 0.0
    gate = Gate()
    assert (
        0.0 <= fast["kl_ratio"] <= gate.max_parity_kl_ratio
        and 0.0 <= fast["damage_diff"] <= gate.max_parity_damage_diff
    )
    assert nvfp4["kl_ratio"] == max(exact["kl_ratio"], fast["kl_ratio"])
    assert nvfp4["damage_diff"] == max(exact["damage_diff"], fast["damage_diff"])
    layerwise = nvfp4["layerwise"]
    assert layerwise["passed"] is True and len(layerwise["layers"]) == TINY_LAYERS and "error" not in layerwise
    assert layerwise["num_tokens"] == PARITY_PROMPTS * 128
    assert layerwise["max_floor_ratio"] <= 4.0 and layerwise["max_linear_ratio"] <= 2.0
    assert all(entry["floor_rms"] > 0 for entry in layerwise["layers"])

    # Distillation on the device: kept scales lower the calibration KL and the artifact is NVFP4.
    distill = report["parity"]["distill"]
    assert distill["passed"] is True and distill["failures"] == []
    record = distill["distill"]
    assert record["tokens"] == 256 and record["steps"] > 0 and record["modules"] == linears
    assert record["calibration_kld_before"] > 0
    assert not record["kept"] or record["calibration_kld_after"] <= record["calibration_kld_before"]

    exact, fast = report["spec"]["exact"], report["spec"]["fast"]
    assert exact["exact"] is True and exact["token_match_rate"] == 1.0
    assert exact["num_drafts"] > 0 and exact["acceptance_length"] >= 1.0
    assert exact["kv_blocks_all_free"] is True and exact["num_prompts"] == SPEC_PROMPTS
    assert 0.0 <= fast["token_match_rate"] <= 1.0 and fast["num_drafts"] > 0


def test_verdict_names_each_failure(gpu_check) -> None:
    check = gpu_check.GpuCheck(gpu_check.parse_args(["--shape=tiny", "--device=cpu"]))
    assert check.verdict() == [
        "fp32 parity did not run (missing)",
        "exact spec decoding did not run (missing)",
    ]
    check.report["parity"]["float32"] = {"top1_agreement": 0.9}
    check.report["spec"]["exact"] = {
        "exact": False,
        "prompt_match_rate": 0.75,
        "num_prompts": 16,
    }
    assert check.verdict() == [
        "fp32 exact parity top-1 agreement 0.9000 < 0.99",
        "spec decoding (exact numerics) differs from plain greedy on 4/16 prompts",
    ]
    assert check.unchecked() == [
        "bf16 exact parity (missing)",
        "fp8 artifact parity (missing)",
        "nvfp4 artifact parity (missing)",
    ]


def test_verdict_of_the_conditional_checks(gpu_check) -> None:
    """bf16 bitwise, FP8's near-tie rule and NVFP4's layerwise-distribution rule fail the run when
    their phase ran; a phase that failed is a failure, one skipped for the deadline is not checked."""
    check = gpu_check.GpuCheck(gpu_check.parse_args(["--shape=tiny", "--device=cpu"]))
    check.report["parity"]["float32"] = {"top1_agreement": 1.0}
    check.report["spec"]["exact"] = {"exact": True, "prompt_match_rate": 1.0, "num_prompts": 16}
    phases = check.report["phases"]
    phases["parity_bf16"] = {"status": "ok"}
    check.report["parity"]["bfloat16"] = {"rule": "bitwise", "max_abs_logit_diff": 0.0, "greedy_match_rate": 1.0}
    phases["parity_fp8"] = {"status": "ok"}
    check.report["parity"]["fp8"] = {"rule": "near_tie", "passed": True, "failures": []}
    phases["parity_nvfp4"] = {"status": "skipped (deadline: 400 s + budget 170 s > 520 s)"}
    assert check.verdict() == []
    assert check.unchecked() == ["nvfp4 artifact parity (skipped (deadline: 400 s + budget 170 s > 520 s))"]

    check.report["parity"]["bfloat16"] = {"rule": "near_tie", "max_abs_logit_diff": 0.125, "greedy_match_rate": 0.5}
    phases["parity_fp8"] = {"status": "error", "error": "RuntimeError: quantize fp8 failed"}
    check.report["parity"]["fp8"] = None
    phases["parity_nvfp4"] = {"status": "ok"}
    check.report["parity"]["nvfp4"] = {
        "rule": "layerwise_distribution",
        "passed": False,
        "failures": ["kl_ratio 0.6000 > 0.5"],
    }
    assert check.verdict() == [
        "bf16 exact parity is not bitwise (max |Δ logit| 0.125, greedy match 0.50)",
        "fp8 artifact parity did not complete (RuntimeError: quantize fp8 failed)",
        "nvfp4 artifact parity fails the layerwise_distribution rule: kl_ratio 0.6000 > 0.5",
    ]
    assert check.unchecked() == []


def test_budgets_fit_the_default_deadline(gpu_check) -> None:
    """Every phase has a budget in both shapes, and at the real size they add up to no more than the
    default deadline, itself well under the 10 minutes a lent device runs a command."""
    for shape in gpu_check.SHAPES.values():
        assert set(shape.budgets) == set(gpu_check.PHASES)
    deadline = gpu_check.Settings().deadline
    budgets = gpu_check.SHAPES["llama3-8b"].budgets
    assert sum(budgets[phase] for phase in gpu_check.DEFAULT_PHASES) <= deadline <= 540
    assert budgets["distill"] <= deadline  # chosen alone (`--phases distill`), it fits too


def test_engine_config_holds_the_widest_batch(gpu_check) -> None:
    check = gpu_check.GpuCheck(gpu_check.parse_args(["--shape=llama3-8b", "--device=cpu"]))
    config = check.engine_config("fast")
    settings = check.s
    assert settings.concurrency == [1, 16, 64] and settings.prompt_tokens == 128 and settings.new_tokens == 64
    assert config.max_num_seqs >= 64
    assert config.num_blocks * config.block_size >= 64 * (128 + 64)
    assert config.max_num_batched_tokens >= 64 * 128
    assert config.enable_prefix_caching is False
