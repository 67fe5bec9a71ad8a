"""`onboard speculator` end to end on a tiny NVFP4 artifact: data, training, export, engine metrics."""

import itertools
import json
from pathlib import Path

import pytest
from artifacts import quantize_into

from onboard.recipes import Calibration, Quantize, SpeculatorSettings
from onboard.speculator.data import iter_sequences
from onboard.speculator.stage import run_speculator
from onboard.workspace import RunDir

TINY = SpeculatorSettings(
    num_prompts=6,
    max_new_tokens=12,
    max_prompt_tokens=64,  # longer prompts are skipped: enough of the tiny tokenizer's fit
    stdlib_files=1,
    draft_vocab_size=96,
    num_speculative_tokens=2,
    epochs=2,
    batch_sequences=2,
    max_seq_len=64,
    eval_prompts=3,
    eval_max_tokens=12,
)


@pytest.fixture(scope="module")
def run_dir(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("spec_run")
    quantize_into(root, tiny_llama, Quantize(scheme="nvfp4", calibration=Calibration(num_samples=2, max_seq_length=64)))
    with RunDir(root) as run:
        entry = run_speculator(run, TINY, None)
    assert entry["status"] == "done"
    return root


def test_outputs_and_contract_keys(run_dir: Path) -> None:
    metrics = json.loads((run_dir / "speculator" / "metrics.json").read_text())
    for key in ("acceptance_length", "per_position_acceptance", "num_speculative_tokens", "speedup"):
        assert key in metrics
    k = TINY.num_speculative_tokens
    assert metrics["num_speculative_tokens"] == k
    assert 1.0 <= metrics["acceptance_length"] <= k + 1
    positions = metrics["per_position_acceptance"]
    assert len(positions) == k and all(a >= b for a, b in itertools.pairwise(positions))
    # Greedy speculation gives plain decoding's tokens bit for bit, W4A4 in bf16 included.
    assert metrics["spec_greedy_exact_rate"] == 1.0
    config = json.loads((run_dir / "artifact" / "speculator" / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["draft_vocab_size"] == metrics["draft_vocab_size"] <= TINY.draft_vocab_size
    history = json.loads((run_dir / "speculator" / "train.json").read_text())["history"]
    assert [h["epoch"] for h in history] == [1, 2]


def test_captured_data_pairs_prompts_with_target_responses(run_dir: Path) -> None:
    sequences = list(iter_sequences(run_dir / "speculator" / "data"))
    aux_layers = json.loads((run_dir / "speculator" / "metrics.json").read_text())["aux_layers"]
    assert aux_layers == [0, 1]  # low/mid/high of a 2-layer model, deduplicated
    assert len(sequences) >= TINY.num_prompts  # responses, plus teacher-forced stdlib code
    hidden = None
    for seq in sequences:
        n = len(seq["input_ids"])
        assert seq["aux"].shape[0] == seq["final"].shape[0] == n
        hidden = seq["final"].shape[1]
        assert seq["aux"].shape[1] == len(aux_layers) * hidden
        assert 1 <= seq["num_prompt_tokens"] <= n


def test_rerun_is_cached(run_dir: Path) -> None:
    with RunDir(run_dir) as run:
        before = run.stage_entry("speculator")
        again = run_speculator(run, TINY, None)
    assert again["finished"] == before["finished"]


def test_bench_measures_the_exported_speculator_and_others(run_dir: Path) -> None:
    from onboard.speculator.measure import run_spec_bench

    draft = run_dir / "artifact" / "speculator"
    result = run_spec_bench(run_dir / "artifact", draft, [draft], None, num_prompts=2, max_tokens=8)
    for key in ("spec_acceptance_length", "spec_per_position_acceptance", "spec_speedup", "spec_lossless_greedy"):
        assert key in result
    assert 1.0 <= result["spec_acceptance_length"] <= TINY.num_speculative_tokens + 1
    assert list(result["speculators"]) == [str(draft)]  # the same export twice is one entry
