"""Bad input to the real `onboard` CLI: one `onboard: error:` line, no traceback, and
nothing half-written.

Every case runs the CLI's real entry point (`onboard.cli.main`) in its own process with its own
stdout and stderr, forked from one interpreter that has done the heavy imports (the session's
`onboard_process`, tests/cli_process.py), so a dozen cases cost one CLI start-up instead of a
dozen. `test_console_script_matches_batch` checks that the installed `onboard` script gives the
same result as the batch for one case.

The write-error case is a real OS error: the CLI runs under RLIMIT_FSIZE with SIGXFSZ ignored,
so writing the artifact fails with EFBIG (root ignores file modes, so chmod cannot do this).
"""

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import tiny_models

from onboard.errors import OnboardError
from onboard.models.checkpoint import check_safetensors, inspect_checkpoint

QUICK = ["--num-samples", "2", "--max-seq-length", "64"]


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env["ONBOARD_CACHE"] = os.environ["ONBOARD_CACHE"]
    return env


def onboard_script() -> list[str]:
    script = Path(sys.executable).with_name("onboard")
    return [str(script)] if script.exists() else [sys.executable, "-m", "onboard"]


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def error_lines(result: Result) -> list[str]:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    return [line for line in lines if line.startswith("onboard: error:")]


def assert_one_line_error(result: Result, *needles: str) -> str:
    assert result.returncode > 0, result
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    lines = error_lines(result)
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def snapshot(path: Path) -> dict[str, bytes] | None:
    """Every file under `path` with its bytes (None when `path` does not exist)."""
    if path.is_file():
        return {"": path.read_bytes()}
    if not path.exists():
        return None
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def assert_nothing_half_written(run_dir: Path, before: dict[str, bytes] | None) -> None:
    if before is None:
        assert not run_dir.exists(), sorted(p.name for p in run_dir.rglob("*"))
        return
    assert snapshot(run_dir) == before
    if run_dir.is_dir():
        assert not (run_dir / "artifact").exists()
        manifest = run_dir / "manifest.json"
        if manifest.exists():
            stages = json.loads(manifest.read_text())["stages"]
            assert all(entry["status"] != "done" for entry in stages.values()), stages


# ---------------------------------------------------------------------------------------------
# The cheap cases, in one batch
# ---------------------------------------------------------------------------------------------


@dataclass
class Case:
    args: list[str]
    needles: list[str]  # what the one error line must name
    run_dir: Path  # what must not be created or changed


@dataclass
class Inputs:
    base: Path
    model: Path
    missing: Path
    no_config: Path
    truncated: Path
    pickle_only: Path
    unknown_arch: Path
    engine_lacks: Path
    typo_top: Path
    typo_nested: Path
    empty_txt: Path
    textless_dir: Path
    existing_dir: Path
    regular_file: Path


@pytest.fixture(scope="module")
def inputs(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Inputs:
    base = tmp_path_factory.mktemp("bad_inputs")
    no_config = Path(shutil.copytree(tiny_llama, base / "no_config"))
    (no_config / "config.json").unlink()
    truncated = Path(shutil.copytree(tiny_llama, base / "truncated"))
    weights = truncated / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    typo_top = base / "typo_top.yaml"
    typo_top.write_text("name: typo\nquantise:\n  scheme: fp8\n")
    typo_nested = base / "typo_nested.yaml"
    typo_nested.write_text("name: typo\nquantize:\n  calibration:\n    num_sample: 3\n")
    empty_txt = base / "empty.txt"
    empty_txt.write_bytes(b"")
    textless = base / "textless"
    (textless / "src").mkdir(parents=True)
    (textless / "blank.md").write_text("  \n\n\t\n")
    (textless / "binary.txt").write_bytes(b"abc\x00def")
    (textless / "src" / "latin1.py").write_bytes(b"x = '\xe9\xff'\n")
    (textless / "weights.bin").write_bytes(b"not text at all")
    existing = base / "existing_run"
    existing.mkdir()
    regular = base / "out_is_a_file"
    regular.write_text("keep me\n")
    return Inputs(
        base=base,
        model=tiny_llama,
        missing=base / "no_such_model",
        no_config=no_config,
        truncated=truncated,
        pickle_only=tiny_models.build_pickle_only(base / "pickle_only"),
        unknown_arch=tiny_models.build_unknown_arch(base / "unknown_arch"),
        engine_lacks=tiny_models.build_engine_lacks(base / "engine_lacks"),
        typo_top=typo_top,
        typo_nested=typo_nested,
        empty_txt=empty_txt,
        textless_dir=textless,
        existing_dir=existing,
        regular_file=regular,
    )


def make_cases(i: Inputs) -> dict[str, Case]:
    runs = i.base / "runs"

    def quantize(name: str, model: Path, *extra: str) -> list[str]:
        return ["quantize", str(model), "--out", str(runs / name), *QUICK, *extra]

    m = str(i.model)
    return {
        "missing_model": Case(
            quantize("missing_model", i.missing),
            [str(i.missing), "does not exist"],
            runs / "missing_model",
        ),
        "no_config": Case(
            quantize("no_config", i.no_config),
            [str(i.no_config), "config.json"],
            runs / "no_config",
        ),
        "truncated_safetensors": Case(
            quantize("truncated_safetensors", i.truncated),
            [str(i.truncated / "model.safetensors"), "truncated"],
            runs / "truncated_safetensors",
        ),
        "pickle_only": Case(
            quantize("pickle_only", i.pickle_only),
            [str(i.pickle_only), "pytorch_model.bin", "--allow-pickle"],
            runs / "pickle_only",
        ),
        "unknown_arch": Case(
            quantize("unknown_arch", i.unknown_arch),
            [str(i.unknown_arch), "notamodel", "NotAModelForCausalLM"],
            runs / "unknown_arch",
        ),
        # `onboard run` on a family transformers knows and the engine does not: refused before any
        # stage (quantize would have run first), naming what the engine lacks.
        "run_engine_lacks": Case(
            ["run", str(i.engine_lacks), "--out", str(runs / "run_engine_lacks")],
            ["speculator:", "Llama4ForConditionalGeneration", "chunked attention", "--skip-adapt"],
            runs / "run_engine_lacks",
        ),
        "recipe_typo_top": Case(
            quantize("recipe_typo_top", i.model, "--recipe", str(i.typo_top)),
            [str(i.typo_top), "quantise"],
            runs / "recipe_typo_top",
        ),
        "recipe_typo_nested": Case(
            quantize("recipe_typo_nested", i.model, "--recipe", str(i.typo_nested)),
            [str(i.typo_nested), "num_sample"],
            runs / "recipe_typo_nested",
        ),
        "calib_empty_file": Case(
            quantize("calib_empty_file", i.model, "--calib", str(i.empty_txt)),
            [str(i.empty_txt)],
            runs / "calib_empty_file",
        ),
        "calib_textless_dir": Case(
            quantize("calib_textless_dir", i.model, "--calib", str(i.textless_dir)),
            [str(i.textless_dir)],
            runs / "calib_textless_dir",
        ),
        "eval_max_tokens_0": Case(
            ["eval", str(i.existing_dir), "--max-tokens", "0"],
            ["--max-tokens", "0"],
            i.existing_dir,
        ),
        "eval_window_1": Case(
            ["eval", str(i.existing_dir), "--window", "1"],
            ["--window", "1"],
            i.existing_dir,
        ),
        "speculator_not_a_run_dir": Case(
            ["speculator", str(i.existing_dir)],
            ["not a run directory"],
            i.existing_dir,
        ),
        "smoke_not_a_run_dir": Case(
            ["smoke", str(i.existing_dir)],
            ["not a run directory"],
            i.existing_dir,
        ),
        "report_not_a_run_dir": Case(
            ["report", str(i.existing_dir)],
            ["not a run directory"],
            i.existing_dir,
        ),
        "gate_not_a_run_dir": Case(
            ["gate", str(i.existing_dir)],
            ["not a run directory"],
            i.existing_dir,
        ),
        "run_unknown_stage": Case(
            ["run", m, "--out", str(runs / "run_unknown_stage"), "--stages", "quantize,smok"],
            ["'smok'"],
            runs / "run_unknown_stage",
        ),
        "demo_unknown_profile": Case(
            ["demo", "--profile", "huge"],
            ["'huge'", "quick"],
            i.existing_dir,
        ),
        "demo_unknown_numerics": Case(
            ["demo", "--numerics", "turbo"],
            ["--numerics", "'turbo'", "fast"],
            i.existing_dir,
        ),
        "bench_speculator_missing": Case(
            ["bench", m, "--speculator"],
            ["has neither a speculator/ nor MTP layers"],
            i.existing_dir,
        ),
        "serve_exact_not_invariant": Case(
            ["serve", m, "--numerics", "exact", "--no-batch-invariant"],
            ["--no-batch-invariant", "exact numerics is always batch invariant"],
            i.existing_dir,
        ),
        "serve_speculator_missing": Case(
            ["serve", m, "--speculator", str(i.existing_dir)],
            ["not a speculator export"],
            i.existing_dir,
        ),
        "serve_speculator_mtp_missing": Case(
            ["serve", m, "--speculator", "mtp"],
            ["--speculator mtp", "has no MTP layers"],
            i.existing_dir,
        ),
        "run_max_tokens_0": Case(
            ["run", m, "--out", str(runs / "run_max_tokens_0"), "--max-tokens", "0"],
            ["--max-tokens", "0"],
            runs / "run_max_tokens_0",
        ),
        "out_is_a_file": Case(
            ["quantize", m, "--out", str(i.regular_file), *QUICK],
            [str(i.regular_file)],
            i.regular_file,
        ),
        "unknown_scheme": Case(
            quantize("unknown_scheme", i.model, "--scheme", "int4"),
            ["'int4'", "--scheme"],
            runs / "unknown_scheme",
        ),
        "auto_without_budget": Case(
            quantize("auto_without_budget", i.model, "--scheme", "auto"),
            ["scheme auto", "--bits-budget"],
            runs / "auto_without_budget",
        ),
        "budget_without_auto": Case(
            quantize("budget_without_auto", i.model, "--bits-budget", "5.5"),
            ["bits budget", "auto"],
            runs / "budget_without_auto",
        ),
        "method_bad_option": Case(
            quantize("method_bad_option", i.model, "--method", "gptq+gptq_dampening=x"),
            ["--method", "gptq_dampening='x'"],
            runs / "method_bad_option",
        ),
        "bench_quant_bad_method_option": Case(
            ["bench-quant", m, "--methods", "rtn,gptq+damp=0.1", "--out", str(runs / "bench-quant-method.json")],
            ["--methods", "unknown method option 'damp'"],
            runs / "bench-quant-method.json",
        ),
        "bench_quant_bad_budgets": Case(
            ["bench-quant", m, "--budgets", "4.5,x", "--out", str(runs / "bench-quant.json")],
            ["--budgets", "4.5,x"],
            runs / "bench-quant.json",
        ),
        "bench_kv_bad_contexts": Case(
            ["bench-kv", "--contexts", "1024,abc", "--out", str(runs / "bench-kv.json")],
            ["--contexts", "1024,abc"],
            runs / "bench-kv.json",
        ),
        "unknown_option": Case(
            quantize("unknown_option", i.model, "--num-sample", "3"),
            ["--num-sample"],
            runs / "unknown_option",
        ),
        # pydantic requires max_seq_length > 1, but the CLI's override skips validation.
        "max_seq_length_1": Case(
            [
                "quantize",
                m,
                "--out",
                str(runs / "max_seq_length_1"),
                "--num-samples",
                "2",
                "--max-seq-length",
                "1",
            ],
            ["--max-seq-length", "1"],
            runs / "max_seq_length_1",
        ),
    }


@dataclass
class Batch:
    cases: dict[str, Case]
    before: dict[str, dict[str, bytes] | None]
    results: dict[str, Result]


@pytest.fixture(scope="module")
def batch(inputs: Inputs, onboard_process) -> Batch:
    cases = make_cases(inputs)
    before = {name: snapshot(case.run_dir) for name, case in cases.items()}
    results = {}
    for name, case in cases.items():
        done = onboard_process.run(case.args, env=cli_env(), cwd=inputs.base)
        results[name] = Result(done.returncode, done.stdout, done.stderr)
    return Batch(cases, before, results)


CASES = [
    "missing_model",
    "no_config",
    "truncated_safetensors",
    "pickle_only",
    "unknown_arch",
    "run_engine_lacks",
    "recipe_typo_top",
    "recipe_typo_nested",
    "calib_empty_file",
    "calib_textless_dir",
    "eval_max_tokens_0",
    "eval_window_1",
    "speculator_not_a_run_dir",
    "smoke_not_a_run_dir",
    "report_not_a_run_dir",
    "gate_not_a_run_dir",
    "run_unknown_stage",
    "demo_unknown_profile",
    "demo_unknown_numerics",
    "bench_speculator_missing",
    "serve_exact_not_invariant",
    "serve_speculator_missing",
    "serve_speculator_mtp_missing",
    "run_max_tokens_0",
    "out_is_a_file",
    "unknown_scheme",
    "auto_without_budget",
    "budget_without_auto",
    "method_bad_option",
    "bench_quant_bad_method_option",
    "bench_quant_bad_budgets",
    "bench_kv_bad_contexts",
    "unknown_option",
    "max_seq_length_1",
]


@pytest.mark.parametrize("name", CASES)
def test_bad_input_is_one_error_line_and_writes_nothing(batch: Batch, name: str) -> None:
    case, result = batch.cases[name], batch.results[name]
    assert_one_line_error(result, *case.needles)
    assert_nothing_half_written(case.run_dir, batch.before[name])


def test_every_case_is_checked(batch: Batch) -> None:
    """Guards CASES against a case added to make_cases but never checked."""
    names = {case if isinstance(case, str) else case.values[0] for case in CASES}
    assert names == set(batch.cases) == set(batch.results)


def test_console_script_matches_batch(batch: Batch) -> None:
    """The installed `onboard` script, in a fresh interpreter, says what the batch child said."""
    case = batch.cases["missing_model"]
    real = subprocess.run([*onboard_script(), *case.args], capture_output=True, text=True, env=cli_env(), timeout=300)
    forked = batch.results["missing_model"]
    assert (real.returncode, error_lines(Result(real.returncode, real.stdout, real.stderr))) == (
        forked.returncode,
        error_lines(forked),
    )
    assert "Traceback" not in real.stdout + real.stderr


# ---------------------------------------------------------------------------------------------
# In-process checks of the checkpoint inspection behind some of the cases
# ---------------------------------------------------------------------------------------------


def test_check_safetensors_catches_one_missing_byte(tiny_llama: Path, tmp_path: Path) -> None:
    weights = tmp_path / "model.safetensors"
    shutil.copyfile(tiny_llama / "model.safetensors", weights)
    check_safetensors(weights)  # intact: no complaint
    size = weights.stat().st_size
    with open(weights, "r+b") as handle:
        handle.truncate(size - 1)
    with pytest.raises(OnboardError) as err:
        check_safetensors(weights)
    message = str(err.value)
    assert str(weights) in message
    assert "truncated" in message
    assert f"{size - 1} bytes on disk, {size} expected" in message
    assert "\n" not in message


def test_check_safetensors_rejects_garbage_header(tmp_path: Path) -> None:
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\x01\x02\x03")  # not even the 8-byte header length
    with pytest.raises(OnboardError, match="not a valid safetensors file"):
        check_safetensors(short)
    huge = tmp_path / "huge.safetensors"
    huge.write_bytes((10**9).to_bytes(8, "little") + b"{}")  # header longer than the file
    with pytest.raises(OnboardError, match="not a valid safetensors file"):
        check_safetensors(huge)


def test_allow_pickle_gets_past_the_pickle_check(inputs: Inputs) -> None:
    with pytest.raises(OnboardError, match="--allow-pickle"):
        inspect_checkpoint(inputs.pickle_only)
    checkpoint = inspect_checkpoint(inputs.pickle_only, allow_pickle=True)
    assert checkpoint.allow_pickle
    assert checkpoint.model_type == "llama"


# ---------------------------------------------------------------------------------------------
# A write that fails with a real OS error (EFBIG) in the middle of the quantize stage
# ---------------------------------------------------------------------------------------------

# Bigger than every small file the stage writes (manifest ~2.5 KB, tokenizer.json ~21 KB),
# smaller than the tiny llama's quantized model.safetensors (~180 KB).
FILE_SIZE_LIMIT = 100_000


def run_cli(onboard_process, args: list[str], file_size_limit: int | None = None) -> Result:
    done = onboard_process.run(args, env=cli_env(), file_size_limit=file_size_limit)
    return Result(done.returncode, done.stdout, done.stderr)


@pytest.fixture(scope="module")
def write_failure(tiny_llama: Path, onboard_process, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Result]:
    run_dir = tmp_path_factory.mktemp("efbig") / "run"
    result = run_cli(onboard_process, ["quantize", str(tiny_llama), "--out", str(run_dir), *QUICK], FILE_SIZE_LIMIT)
    return run_dir, result


def leftovers(run_dir: Path) -> list[str]:
    """Staging directories, temporary files and set-aside trees a stage may leave behind."""
    found = [str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if ".tmp-" in p.name or ".old-" in p.name]
    staging = run_dir / ".staging"
    if staging.exists():
        found += [str(p.relative_to(run_dir)) for p in staging.iterdir()]
    return found


def test_write_error_leaves_nothing_half_written_and_rerun_succeeds(
    write_failure: tuple[Path, Result], tiny_llama: Path, onboard_process
) -> None:
    run_dir, failed = write_failure
    assert failed.returncode > 0, failed.stderr
    assert not (run_dir / "artifact").exists()
    assert not (run_dir / "quantize").exists()
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["stages"]["quantize"]["status"] != "done"
    assert leftovers(run_dir) == []

    rerun = run_cli(onboard_process, ["quantize", str(tiny_llama), "--out", str(run_dir), *QUICK])
    assert rerun.returncode == 0, rerun.stderr
    assert "Traceback" not in rerun.stderr
    check_safetensors(run_dir / "artifact" / "model.safetensors")
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["stages"]["quantize"]["status"] == "done"
    assert leftovers(run_dir) == []
    # The premise of the limit: the artifact is over it, the manifest under it.
    assert (run_dir / "artifact" / "model.safetensors").stat().st_size > FILE_SIZE_LIMIT
    assert (run_dir / "manifest.json").stat().st_size < FILE_SIZE_LIMIT


def test_write_error_is_one_error_line(write_failure: tuple[Path, Result]) -> None:
    run_dir, failed = write_failure
    line = assert_one_line_error(failed, str(run_dir))
    assert "File too large" in line or "too large" in line.lower()
