"""scripts/gpu_check.py, the check prepared for a lent GPU, run on the CPU at `--shape tiny`: the JSON
has its throughput, parity and speculative-decoding sections with sane values, and the verdict
fails for the reasons it should."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
CONCURRENCY = (1, 4)
NEW_TOKENS = 16
SPEC_PROMPTS = 4


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


@pytest.mark.slow  # 7-35 s on 2 busy cores
def test_tiny_run_on_cpu_writes_every_section(tmp_path: Path) -> None:
    out = tmp_path / "report" / "gpu_check.json"
    # The tiny shape with a smaller workload than its defaults, to stay quick on 2 cores.
    command = [
        sys.executable,
        str(SCRIPT),
        "--shape=tiny",
        "--device=cpu",
        f"--out={out}",
        f"--workdir={tmp_path}",
        f"--concurrency={','.join(map(str, CONCURRENCY))}",
        f"--new-tokens={NEW_TOKENS}",
        "--parity-prompts=2",
        "--parity-tokens=16",
        f"--spec-prompts={SPEC_PROMPTS}",
        "--spec-tokens=8",
    ]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "PASS: all checks passed"
    assert not list(tmp_path.glob("gpu_check-*")), "the temporary checkpoint was left behind"
    report = json.loads(out.read_text())
    assert report["passed"] is True
    assert {name: row["status"] for name, row in report["phases"].items()} == dict.fromkeys(
        ("build", "parity_bf16", "spec_exact", "parity_fp32", "throughput", "spec_fast"), "ok"
    )
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
    # Exact numerics on the CPU compute what transformers computes, bit for bit.
    assert fp32["top1_agreement"] == 1.0
    assert fp32["bitwise_equal_logits"] is True and fp32["max_abs_logit_diff"] == 0.0
    assert fp32["greedy_match_rate"] == 1.0
    assert bf16["top1_agreement"] >= 0.99 and bf16["num_positions"] == 2 * (128 + 16)

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


def test_engine_config_holds_the_widest_batch(gpu_check) -> None:
    check = gpu_check.GpuCheck(gpu_check.parse_args(["--shape=llama3-8b", "--device=cpu"]))
    config = check.engine_config("fast")
    settings = check.s
    assert settings.concurrency == [1, 16, 64] and settings.prompt_tokens == 128 and settings.new_tokens == 64
    assert config.max_num_seqs >= 64
    assert config.num_blocks * config.block_size >= 64 * (128 + 64)
    assert config.max_num_batched_tokens >= 64 * 128
    assert config.enable_prefix_caching is False
