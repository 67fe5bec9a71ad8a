"""The speculator over the memory budget: teacher-forced data captured by streaming the checkpoint
one decoder layer at a time (the engine's exact capture, bit for bit), the draft from the
checkpoint's tensors, no engine anywhere, and the acceptance measured on a deployment or
recorded as not measured."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from onboard.budget import model_shape
from onboard.engine.config import EngineConfig
from onboard.engine.llm_engine import LLMEngine
from onboard.errors import OnboardError
from onboard.models import inspect_checkpoint, load_tokenizer
from onboard.models.streamed import StreamedModel
from onboard.recipes import Calibration, Quantize, SpeculatorSettings
from onboard.speculator.capture import capture_shards
from onboard.speculator.data import TrainingSequence, iter_sequences
from onboard.speculator.plan import (
    generated_tokens,
    speculator_peaks,
    speculator_plan,
    streamed_tokens_bound,
)
from onboard.speculator.stage import build_draft, run_speculator
from onboard.speculator.streamed import capture_streamed
from onboard.speculator.streamed_stage import streamed_sequences
from onboard.speculator.target import checkpoint_draft, checkpoint_tensors
from onboard.speculator.teacher import traffic_sequences
from onboard.speculator.train import load_examples
from onboard.workspace import RunDir

EXACT = EngineConfig(numerics="exact", block_size=4, num_blocks=512, max_model_len=256)
SETTINGS = SpeculatorSettings(
    traffic="mixed",
    num_prompts=6,
    max_prompt_tokens=64,
    stdlib_files=1,
    teacher_forced_max_sequences=2,
    init_from_last_layer=True,
    draft_vocab_size=96,
    num_speculative_tokens=2,
    epochs=1,
    batch_sequences=2,
    max_seq_len=64,
    eval_prompts=3,
    eval_max_tokens=12,
)


@pytest.fixture(scope="module")
def quantized(tiny_llama: Path, quantized_run) -> Path:
    """A run directory whose quantize stage made an NVFP4 artifact of tiny_llama (do not modify)."""
    return quantized_run(
        tiny_llama, Quantize(scheme="nvfp4", calibration=Calibration(num_samples=2, max_seq_length=64))
    )


@pytest.fixture
def run_dir(quantized: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(quantized, tmp_path / "run"))


def _sequences(path: Path) -> list[TrainingSequence]:
    """The streamed path's own data (traffic prompts, stdlib code), plus random ids."""
    tokenizer = load_tokenizer(inspect_checkpoint(path))
    sources = streamed_sequences(tokenizer, SETTINGS.model_copy(update={"num_prompts": 3}), None, [])
    gen = torch.Generator().manual_seed(0)
    noise = [TrainingSequence(torch.randint(3, 500, (n,), generator=gen).tolist(), 1, "chat") for n in (5, 40)]
    return [seq for part in sources.values() for seq in part] + noise


def _files(directory: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {path.name: load_file(str(path)) for path in sorted(directory.glob("*.safetensors"))}


@pytest.mark.parametrize("which", ["tiny_llama", "tiny_deepseek_v3", "nvfp4"])
def test_streamed_capture_is_the_engines_exact_capture_bit_for_bit(
    which: str, quantized: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    path = quantized / "artifact" if which == "nvfp4" else request.getfixturevalue(which)
    sequences = _sequences(path)
    aux = [0, 1]  # the embeddings (layer 0's input) and layer 0's output
    sizes = {"shard_tokens": 80, "pack_tokens": 60}  # several shards, cut where packs end
    engine_index = capture_shards(LLMEngine(path, EXACT), sequences, aux, tmp_path / "engine", **sizes)
    model = StreamedModel(path)
    streamed_index = capture_streamed(model, sequences, aux, tmp_path / "streamed", **sizes)
    assert streamed_index == engine_index and len(engine_index["shards"]) > 1
    assert json.loads((tmp_path / "streamed" / "index.json").read_text()) == engine_index
    engine_files, streamed_files = _files(tmp_path / "engine"), _files(tmp_path / "streamed")
    assert engine_files.keys() == streamed_files.keys()
    for name, tensors in engine_files.items():
        assert tensors.keys() == streamed_files[name].keys()
        for key, tensor in tensors.items():
            assert tensor.dtype == streamed_files[name][key].dtype
            assert torch.equal(tensor, streamed_files[name][key]), (name, key)
    assert model.parts.peak_layers == 1  # one decoder layer at a time
    # Training reads it unchanged.
    examples = load_examples(tmp_path / "streamed", SETTINGS.max_seq_len)
    assert len(examples) == len([s for s in sequences if len(s.token_ids) >= 3])


def test_capture_and_warm_start_hold_one_decoder_layer(quantized: Path, tmp_path: Path) -> None:
    path = quantized / "artifact"
    model = StreamedModel(path)
    assert model.num_layers >= 2
    capture_streamed(model, _sequences(path), [0, 1], tmp_path / "data")
    assert model.parts.peak_layers == 1 and model.parts.live_layers == 0
    checkpoint_draft(model, checkpoint_tensors(model), torch.arange(0, 512, 4), [0, 1], from_last_layer=True)
    assert model.parts.peak_layers == 1 and model.parts.live_layers == 0


@pytest.mark.parametrize("which", ["tiny_llama", "nvfp4"])
def test_draft_from_the_checkpoint_is_the_draft_from_the_engine(
    which: str, quantized: Path, request: pytest.FixtureRequest
) -> None:
    path = quantized / "artifact" if which == "nvfp4" else request.getfixturevalue(which)
    vocab = torch.arange(0, 512, 4)
    engine = LLMEngine(path, EXACT)
    model = StreamedModel(path)
    tensors = checkpoint_tensors(model)
    assert torch.equal(tensors["lm_head"].float(), engine.target_tensors()["lm_head"])
    for warm in (False, True):
        ours = checkpoint_draft(model, tensors, vocab, [0, 1], from_last_layer=warm)
        theirs = build_draft(engine, vocab, [0, 1], from_last_layer=warm)
        for (name, mine), other in zip(ours.state_dict().items(), theirs.state_dict().values(), strict=True):
            assert torch.equal(mine, other), (warm, name)


def test_traffic_sequences_train_on_responses_where_records_have_them(tiny_llama: Path) -> None:
    from onboard.data.record import Message, Record

    tokenizer = load_tokenizer(inspect_checkpoint(tiny_llama))
    turns = (Message("user", "hi"), Message("assistant", "Hello there."), Message("user", "and now?"))
    answered, prompt = traffic_sequences(
        [Record("chat", "a", messages=turns), Record("math", "b", text="What is 2 + 2?")], tokenizer, 5, 64, 128
    )
    assert tokenizer.decode(answered.token_ids[answered.num_prompt_tokens :]) == "Hello there.<|im_end|>"
    assert "and now?" not in tokenizer.decode(answered.token_ids)  # the conversation through its response
    assert prompt.num_prompt_tokens == 1 and prompt.traffic == "math"  # the prompt itself, every position
    assert tokenizer.decode(prompt.token_ids).endswith("<|im_start|>assistant\n")
    assert len(traffic_sequences([Record("math", "b", text="x " * 100)], tokenizer, 5, 64, 128)) == 0  # too long


def _forbid_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs) -> None:
        raise AssertionError("an LLMEngine was built on the streamed path")

    monkeypatch.setattr(LLMEngine, "__init__", refuse)


def _streamed_tokens(run_dir: Path, settings: SpeculatorSettings = SETTINGS) -> int:
    """What the streamed path's data holds: its teacher-forced sequences' tokens."""
    tokenizer = load_tokenizer(inspect_checkpoint(run_dir / "artifact"))
    answers = [Path(path) for path in settings.teacher_forced_data]
    sources = streamed_sequences(tokenizer, settings, None, answers)
    return sum(len(seq.token_ids) for part in sources.values() for seq in part)


def _peaks(run_dir: Path, settings: SpeculatorSettings = SETTINGS) -> tuple[int, int]:
    """`budget.estimate`'s in-memory peak (over the generated data's bound) and streamed peak
    (over the streamed data's tokens)."""
    shape = model_shape(run_dir / "artifact")
    in_memory = speculator_peaks(shape, settings, generated_tokens(settings))[0]
    streamed = speculator_peaks(shape, settings, _streamed_tokens(run_dir, settings))[1]
    assert streamed < in_memory
    return in_memory, streamed


def _between(run_dir: Path, settings: SpeculatorSettings = SETTINGS) -> int:
    """A budget over the streamed estimate and under the in-memory one."""
    return sum(_peaks(run_dir, settings)) // 2


def test_plan_estimates_each_path_on_its_own_data(quantized: Path) -> None:
    artifact = quantized / "artifact"
    shape = model_shape(artifact)
    in_memory, streamed = _peaks(quantized)
    tokens = _streamed_tokens(quantized)
    calls = []

    def counted() -> int:
        calls.append(1)
        return tokens

    plan = speculator_plan(shape, SETTINGS, in_memory, endpoint=False, streamed_tokens=counted)
    assert plan.path == "in-memory" and plan.in_memory == in_memory and not calls  # not tokenized: not needed
    plan = speculator_plan(shape, SETTINGS, in_memory - 1, endpoint=False, streamed_tokens=counted)
    assert (plan.path, plan.in_memory, plan.streamed) == ("streamed", in_memory, streamed) and calls == [1]
    assert speculator_plan(shape, SETTINGS, streamed, endpoint=False, streamed_tokens=counted).path == "streamed"
    with pytest.raises(OnboardError, match=r"^speculator needs about .* streamed, over the .*--endpoint URL$"):
        speculator_plan(shape, SETTINGS, streamed - 1, endpoint=False, streamed_tokens=counted)
    assert speculator_plan(shape, SETTINGS, streamed - 1, endpoint=True, streamed_tokens=counted).path == "endpoint"
    # Without the data: each sequence at its longest.
    bound = speculator_peaks(model_shape(artifact), SETTINGS, streamed_tokens_bound(SETTINGS))[1]
    assert speculator_plan(shape, SETTINGS, in_memory - 1, endpoint=False).streamed == bound > streamed
    # The draft's training is planned too: longer batches, a larger peak on the same data.
    longer = SETTINGS.model_copy(update={"batch_sequences": 4 * SETTINGS.batch_sequences})
    assert speculator_plan(shape, longer, 0, endpoint=True, streamed_tokens=counted).streamed > streamed


def test_over_budget_trains_streamed_and_leaves_acceptance_unmeasured(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from onboard.gate import evaluate_gate, junit_xml
    from onboard.report import write_report

    answers = run_dir / "gsm.jsonl"
    answers.write_text(json.dumps({"question": "What is 2 + 3?", "answer": "2 + 3 = 5."}) + "\n")
    settings = SETTINGS.model_copy(update={"teacher_forced_data": [str(answers)]})
    budget = _between(run_dir, settings)
    _forbid_engines(monkeypatch)
    with RunDir(run_dir) as run:
        entry = run_speculator(run, settings, None, max_memory=budget)
    assert entry["status"] == "done" and entry["metrics"]["memory_path"] == "streamed"
    assert (run_dir / "artifact" / "speculator" / "config.json").is_file()
    metrics = json.loads((run_dir / "speculator" / "metrics.json").read_text())
    assert metrics["acceptance_length"] is None and metrics["speedup"] is None and metrics["measured_on"] is None
    assert f"onboard speculator {run_dir} --endpoint URL" in metrics["acceptance_note"]
    assert metrics["numerics"] == "exact" and metrics["peak_decoder_layers"] == 1
    assert set(metrics["data_sources"]) == {"traffic", "stdlib_code", "answers"}
    assert metrics["data_sources"]["answers"]["sequences"] == 1
    assert metrics["train_sequences"] == sum(s["sequences"] for s in metrics["data_sources"].values())
    assert metrics["train_tokens"] == sum(s["tokens"] for s in metrics["data_sources"].values())
    sequences = list(iter_sequences(run_dir / "speculator" / "data"))
    assert len(sequences) == metrics["train_sequences"]
    assert not (run_dir / "speculator-work").exists()

    # The gate says "not measured" (the run incomplete), it does not fail on the null.
    result = evaluate_gate(run_dir)
    (check,) = [c for c in result["checks"] if c["name"] == "acceptance_length"]
    assert check["value"] is None and check["passed"] is False and check["note"] == metrics["acceptance_note"]
    assert result["complete"] is False
    assert 'type="not_measured"' in junit_xml(result)
    html = write_report(run_dir).read_text()
    assert "not measured (see the speculator card)" in html and "onboard speculator" in html


def test_under_even_the_streamed_estimate_refuses_before_writing(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, streamed = _peaks(run_dir)
    _forbid_engines(monkeypatch)
    with RunDir(run_dir) as run, pytest.raises(OnboardError) as info:
        run_speculator(run, SETTINGS, None, max_memory=streamed - 1)
    message = str(info.value)
    assert "\n" not in message and message.startswith("speculator needs about") and "--endpoint URL" in message
    assert "speculator" not in json.loads((run_dir / "manifest.json").read_text())["stages"]
    assert not (run_dir / "speculator").exists() and not (run_dir / "artifact" / "speculator").exists()
    assert not (run_dir / "speculator-work").exists()
    with RunDir(run_dir) as run:  # a byte more and it runs
        assert run_speculator(run, SETTINGS, None, max_memory=streamed)["metrics"]["memory_path"] == "streamed"


def test_over_budget_with_a_deployment_measures_it(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from server_thread import ServerThread

    from onboard.endpoint import EndpointSpec
    from onboard.server import build_app
    from onboard.speculator.target import new_draft

    artifact = run_dir / "artifact"
    engine = LLMEngine(artifact, EngineConfig(max_model_len=256, num_blocks=256, enable_prefix_caching=False))
    vocab = torch.arange(engine.vocab_size)
    engine.set_speculator(new_draft(engine.hf_config, engine.target_tensors(), vocab, [0, 1]), 2)
    budget = _between(run_dir)
    _forbid_engines(monkeypatch)  # the served one exists already; the stage builds none
    with ServerThread(build_app(engine, "served")) as url, RunDir(run_dir) as run:
        run_speculator(run, SETTINGS, None, max_memory=budget, endpoint=EndpointSpec(url))
    metrics = json.loads((run_dir / "speculator" / "metrics.json").read_text())
    assert metrics["measured_on"] == "endpoint" and metrics["endpoint"] == url and metrics["served_model"] == "served"
    assert metrics["acceptance_length"] >= 1 and metrics["num_drafts"] > 0 and metrics["speedup"] is None
    assert len(metrics["per_position_acceptance"]) == 2 and metrics["memory_path"] == "streamed"
    assert "measured on the endpoint" in metrics["acceptance_note"]
