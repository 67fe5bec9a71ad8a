"""`onboard speculator` end to end on a tiny NVFP4 artifact: data, training, export, engine metrics."""

import itertools
import json
from pathlib import Path

import pytest
from build_once import copy_of

from onboard.errors import OnboardError
from onboard.recipes import Calibration, Quantize, SpeculatorSettings
from onboard.speculator.data import iter_sequences
from onboard.speculator.plan import capture_key, engine_config
from onboard.speculator.stage import run_speculator
from onboard.speculator.teacher import resolve_data_files
from onboard.workspace import RunDir

TINY = SpeculatorSettings(
    num_prompts=6,
    max_new_tokens=12,
    max_prompt_tokens=64,  # longer prompts are skipped: enough of the tiny tokenizer's fit
    generation_concurrency=5,
    stdlib_files=1,
    teacher_forced_max_sequences=2,
    init_from_last_layer=True,
    draft_vocab_size=96,
    num_speculative_tokens=2,
    epochs=2,
    batch_sequences=2,
    max_seq_len=64,
    eval_prompts=3,
    eval_max_tokens=12,
)


ANSWERS = ["Add them: 2 + 3 = 5.", "Reversed: cba.", "never read: over the cap"]


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory) -> SpeculatorSettings:
    """TINY, teacher-forcing answers of a gsm8k-style and an alpaca-style file (cap: 2 in all)."""
    root = tmp_path_factory.mktemp("answers")
    (root / "gsm.jsonl").write_text(
        "".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in [("2 + 3?", ANSWERS[0]), ("?", ANSWERS[2])])
    )
    (root / "alpaca.json").write_text(json.dumps([{"instruction": "Reverse abc.", "input": "", "output": ANSWERS[1]}]))
    return TINY.model_copy(update={"teacher_forced_data": [str(root / "gsm.jsonl"), str(root / "alpaca.json")]})


@pytest.fixture(scope="module")
def run_dir(
    tiny_llama: Path, quantized_run, settings: SpeculatorSettings, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    quantized = quantized_run(
        tiny_llama, Quantize(scheme="nvfp4", calibration=Calibration(num_samples=2, max_seq_length=64))
    )
    root = copy_of(quantized, tmp_path_factory.mktemp("spec_run") / "run")
    with RunDir(root) as run:
        entry = run_speculator(run, settings, None)
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
    assert metrics["numerics"] == "fast"  # run_speculator's default: the serving numerics


def test_captured_data_holds_the_teacher_forced_answers(run_dir: Path, tiny_llama: Path) -> None:
    from onboard.models import inspect_checkpoint, load_tokenizer

    tokenizer = load_tokenizer(inspect_checkpoint(tiny_llama))
    answered = []
    for seq in iter_sequences(run_dir / "speculator" / "data"):
        answer = tokenizer.decode(seq["input_ids"][seq["num_prompt_tokens"] :].tolist())
        if answer.removesuffix("<|im_end|>") in ANSWERS:
            answered.append(answer)
    # One of each file in turn, up to teacher_forced_max_sequences = 2.
    assert answered == [ANSWERS[0] + "<|im_end|>", ANSWERS[1] + "<|im_end|>"]
    metrics = json.loads((run_dir / "speculator" / "metrics.json").read_text())
    generated = TINY.num_prompts * TINY.responses_per_prompt
    assert metrics["train_sequences"] == generated + 1 + 2  # responses, one stdlib file, two answers


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


def test_rerun_is_cached(run_dir: Path, settings: SpeculatorSettings) -> None:
    with RunDir(run_dir) as run:
        before = run.stage_entry("speculator")
        again = run_speculator(run, settings, None)
    assert again["finished"] == before["finished"]


def test_missing_teacher_forced_data_is_a_one_line_error(
    run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "here.jsonl").write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    assert resolve_data_files(["here.jsonl"]) == [tmp_path / "here.jsonl"]  # relative: the current directory
    with RunDir(run_dir) as run, pytest.raises(OnboardError) as info:
        run_speculator(run, TINY.model_copy(update={"teacher_forced_data": ["absent.jsonl"]}), None)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("speculator.teacher_forced_data: absent.jsonl: no such file")


def test_engine_holds_the_generation_concurrency() -> None:
    for concurrency in (5, 64, 300):
        settings = TINY.model_copy(update={"generation_concurrency": concurrency, "max_seq_len": 1000})
        config = engine_config(settings, "cpu", "exact")
        assert config.max_num_seqs == concurrency and config.numerics == "exact"
        assert not config.enable_prefix_caching
        need = concurrency * (settings.max_prompt_tokens + settings.max_new_tokens)
        assert config.num_blocks * config.block_size >= max(need, config.max_model_len)
        assert config.max_model_len >= settings.max_seq_len + 1


def test_numerics_enter_the_data_key() -> None:
    keys = {capture_key("artifact", TINY, None, None, numerics, []) for numerics in ("exact", "fast")}
    assert len(keys) == 2
    assert capture_key("artifact", TINY, None, None, "fast", []) == capture_key(
        "artifact", TINY, None, None, "fast", []
    )
    other = TINY.model_copy(update={"init_from_last_layer": False})  # training only: the same data
    assert capture_key("artifact", other, None, None, "fast", []) == capture_key(
        "artifact", TINY, None, None, "fast", []
    )


def test_bench_measures_the_exported_speculator_and_others(run_dir: Path) -> None:
    from onboard.speculator.measure import run_spec_bench

    draft = run_dir / "artifact" / "speculator"
    result = run_spec_bench(run_dir / "artifact", draft, [draft], None, num_prompts=2, max_tokens=8)
    for key in ("spec_acceptance_length", "spec_per_position_acceptance", "spec_speedup", "spec_lossless_greedy"):
        assert key in result
    assert 1.0 <= result["spec_acceptance_length"] <= TINY.num_speculative_tokens + 1
    assert list(result["speculators"]) == [str(draft)]  # the same export twice is one entry
