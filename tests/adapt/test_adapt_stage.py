"""`onboard adapt` end to end: the real CLI in a fresh interpreter on the bf16 tiny llama, then
the cached rerun and the refusals through the same entry point (`onboard.cli.main`) in process,
which saves an interpreter start (torch, transformers) per case."""

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import transformers

import onboard.cli
from onboard.engine.models import supported_architectures
from onboard.models import inspect_checkpoint, load_model
from onboard.workspace import MANIFEST

PARITY_KEYS = {"max_abs_logit_diff", "mean_kld", "top1_agreement", "greedy_match_rate", "logprobs_close"}


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env["ONBOARD_CACHE"] = os.environ["ONBOARD_CACHE"]  # the session's isolated cache (conftest)
    return env


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("onboard: error:")]


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Iterator:
    """Run `onboard ARGS` through `onboard.cli.main` in this process: (exit code, stdout, stderr).

    `main` quiets libraries for good (environment, transformers' logging); that is undone after."""
    verbosity = transformers.logging.get_verbosity()
    progress = transformers.logging.is_progress_bar_enabled()
    for name in ("TOKENIZERS_PARALLELISM", "LLM_COMPRESSOR_LOG_LEVEL"):
        monkeypatch.setenv(name, os.environ.get(name, "false" if name.startswith("TOKENIZERS") else "ERROR"))

    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        monkeypatch.setattr(sys, "argv", ["onboard", *args])
        with pytest.raises(SystemExit) as done:
            onboard.cli.main()
        captured = capsys.readouterr()
        return done.value.code, captured.out, captured.err

    yield run
    transformers.logging.set_verbosity(verbosity)
    if progress:
        transformers.logging.enable_progress_bar()


@pytest.fixture(scope="module")
def adapted(tiny_llama: Path, onboard_process, tmp_path_factory: pytest.TempPathFactory):
    """`onboard adapt TINY_LLAMA --out RUN` once, as a user runs it, in a process of its own."""
    run = tmp_path_factory.mktemp("adapt") / "run"
    return run, onboard_process.run(["adapt", str(tiny_llama), "--out", str(run)], env=cli_env())


@pytest.fixture(scope="module")
def gpt2_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint transformers knows (GPT-2) but the serving engine has no adapter for."""
    out = tmp_path_factory.mktemp("tiny_gpt2")
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0
    )
    transformers.GPT2LMHeadModel(config).save_pretrained(out)
    assert (out / "model.safetensors").is_file()
    return out


def test_adapt_cli_writes_parity(adapted) -> None:
    run, result = adapted
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert "LlamaForCausalLM -> engine model LlamaModel" in result.stderr
    parity = json.loads((run / "adapt" / "parity.json").read_text())
    assert set(parity) >= PARITY_KEYS
    print({k: parity[k] for k in sorted(PARITY_KEYS)})
    # Same bf16 weights, one request at a time: the engine is transformers, position for position.
    assert parity["top1_agreement"] == 1.0
    assert parity["greedy_match_rate"] >= 15 / 16
    assert parity["logprobs_close"] is True
    assert parity["max_abs_logit_diff"] <= 1e-2
    assert 0 <= parity["mean_kld"] < 1e-3
    assert parity["num_prompts"] == len(parity["cases"]) == 16
    assert parity["engine_model"] == "LlamaModel"
    assert sum(case["matched"] for case in parity["cases"]) == round(parity["greedy_match_rate"] * 16)

    entry = json.loads((run / MANIFEST).read_text())["stages"]["adapt"]
    assert entry["status"] == "done"
    assert {k: entry["metrics"][k] for k in PARITY_KEYS} == {k: parity[k] for k in PARITY_KEYS}
    assert "cases" not in entry["metrics"]


def test_second_adapt_run_is_cached(adapted, tiny_llama: Path, cli) -> None:
    run, first = adapted
    assert first.returncode == 0, first.stderr
    parity = (run / "adapt" / "parity.json").read_bytes()
    entry = json.loads((run / MANIFEST).read_text())["stages"]["adapt"]

    code, out, err = cli("adapt", str(tiny_llama), "--out", str(run))
    assert code == 0, err
    assert "cached" in out + err
    assert (run / "adapt" / "parity.json").read_bytes() == parity
    assert json.loads((run / MANIFEST).read_text())["stages"]["adapt"]["finished"] == entry["finished"]


def test_plain_checkpoint_without_out_is_one_error_line(tiny_llama: Path, cli) -> None:
    before = sorted(p.name for p in tiny_llama.iterdir())
    code, out, err = cli("adapt", str(tiny_llama))
    assert code == 2
    assert "Traceback" not in out + err
    lines = error_lines(err)
    assert len(lines) == 1, err
    assert str(tiny_llama) in lines[0] and "--out" in lines[0]
    assert sorted(p.name for p in tiny_llama.iterdir()) == before  # no manifest or lock in the checkpoint


def test_unsupported_architecture_is_one_error_line(gpt2_checkpoint: Path, tmp_path: Path, cli) -> None:
    code, out, err = cli("adapt", str(gpt2_checkpoint), "--out", str(tmp_path / "run"))
    assert code == 2
    assert "Traceback" not in out + err
    lines = error_lines(err)
    assert len(lines) == 1, err
    line = lines[0]
    assert "GPT2LMHeadModel" in line
    for arch in supported_architectures():
        assert arch in line
    assert "docs/adding-an-architecture.md" in line  # how to add an adapter
    assert not (tmp_path / "run" / "adapt").exists()


def test_unsupported_architecture_leaves_no_run_directory(gpt2_checkpoint: Path, tmp_path: Path, cli) -> None:
    code, _, _ = cli("adapt", str(gpt2_checkpoint), "--out", str(tmp_path / "run"))
    assert code == 2
    assert not (tmp_path / "run").exists()


def test_layerwise_writes_its_own_report_next_to_parity(tiny_glm_moe_dsa: Path, tmp_path: Path, cli) -> None:
    run = tmp_path / "run"
    code, _, err = cli("adapt", str(tiny_glm_moe_dsa), "--out", str(run), "--layerwise", "--dtype", "fp32")
    assert code == 0, err
    result = json.loads((run / "adapt" / "layerwise.json").read_text())
    assert result["passed"] and [e["layer"] for e in result["layers"]] == [f"model.layers.{i}" for i in range(3)]
    manifest = json.loads((run / MANIFEST).read_text())
    assert manifest["stages"]["adapt_layerwise"]["metrics"]["first_failing_layer"] is None


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [("--dtype", "fp16", "--dtype must be one of"), ("--device", "cuda", "--device cuda"), ("--device", "tpu", "tpu")],
)
def test_bad_dtype_or_device_is_one_error_line(
    tiny_llama: Path, tmp_path: Path, cli, flag: str, value: str, message: str
) -> None:
    code, out, err = cli("adapt", str(tiny_llama), "--out", str(tmp_path / "run"), flag, value)
    assert code == 2 and "Traceback" not in out + err
    (line,) = error_lines(err)
    assert message in line
    assert not (tmp_path / "run").exists()


def test_layerwise_compares_a_quantized_artifact_in_its_run(
    tiny_llama: Path, quantized_run, tmp_path: Path, cli
) -> None:
    """`adapt RUN --layerwise` on a W4A4 artifact: transformers' layers under compressed-tensors,
    one at a time, each against its floor."""
    from build_once import copy_of

    from onboard.recipes import Calibration, Quantize

    settings = Quantize(scheme="nvfp4", calibration=Calibration(num_samples=2, max_seq_length=64))
    run = copy_of(quantized_run(tiny_llama, settings), tmp_path / "run")
    code, out, err = cli("adapt", str(run), "--layerwise")
    assert code == 0, err
    result = json.loads((run / "adapt" / "layerwise.json").read_text())
    assert result["passed"] and result["max_linear_ratio"] == 0.0
    assert all(entry["worst_linear"].startswith(entry["layer"]) for entry in result["layers"])
    assert "÷ floor" in out + err


@torch.inference_mode()
def _decoded_from_scratch(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers decoding `tokens` after `prompt` one at a time from an empty cache: `[n, V]`."""
    ids = torch.tensor([prompt])
    out = model(ids, attention_mask=torch.ones_like(ids), use_cache=True)
    rows, mask = [out.logits[0, -1]], torch.ones_like(ids)
    for token in tokens[:-1]:
        mask = torch.cat([mask, mask[:, :1]], dim=1)
        out = model(torch.tensor([[token]]), attention_mask=mask, past_key_values=out.past_key_values)
        rows.append(out.logits[0, -1])
    return torch.stack(rows).float()


def test_decode_agreement_continues_from_the_reference_cache_where_the_tokens_part(tiny_llama: Path) -> None:
    """A continuation that parts from transformers' greedy one at token 5 is scored, past that
    token, by transformers decoding it: the same log probabilities as decoding it from scratch."""
    from types import SimpleNamespace

    from onboard.adapt.measure import _decode_agreement, _reference_greedy

    checkpoint = inspect_checkpoint(tiny_llama)
    model = load_model(checkpoint, torch.float32)
    prompt = list(range(3, 20))
    reference = _reference_greedy(model, prompt, eos_ids=set(), pad_id=0)
    tokens = reference.tokens[:12]
    tokens[5] = (tokens[5] + 1) % model.config.vocab_size
    logprobs = _decoded_from_scratch(model, prompt, tokens).log_softmax(-1)
    picked = logprobs[torch.arange(len(tokens)), torch.tensor(tokens)]
    completion = SimpleNamespace(token_ids=tokens, logprobs=[{"logprob": float(lp)} for lp in picked])
    result = _decode_agreement(model, reference, completion)
    assert result["positions"] == 12
    assert result["max_abs_logprob_diff"] < 1e-5
    assert result["top1_agree"] == int((logprobs.argmax(-1) == torch.tensor(tokens)).sum())
    assert result["top1_agree"] < 12  # token 5 is not transformers' choice
