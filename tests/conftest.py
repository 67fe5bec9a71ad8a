"""Shared fixtures: tiny seeded checkpoints and quantized runs built once per test run (shared by
the xdist workers, `build_once.py`), the CLI forked from a warm interpreter (`cli_process.py`),
and an isolated cache. docs/testing.md says which to reach for."""

import os

# Never reach a model hub from the tests; set before transformers is imported anywhere.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import tiny_models
import torch
from build_once import build_once, settings_key
from cli_process import CliServer

from onboard import cpu_bf16
from onboard.recipes import Quantize


def pytest_configure(config: pytest.Config) -> None:
    """The cores shared out: two torch threads in a single process, one per xdist worker on two
    cores; the processes tests start inherit it through OMP_NUM_THREADS. (Not at import: an
    xdist worker is told it is one only after importing this file.)"""
    workers = config.workerinput["workercount"] if hasattr(config, "workerinput") else 0
    threads = max(1, (os.cpu_count() or 2) // workers) if workers else 2
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    cpu_bf16.install()  # as `onboard.cli.main` does: the tests run what the CLI runs


@pytest.fixture(scope="session", autouse=True)
def onboard_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Point `$ONBOARD_CACHE` at a session tmp dir so no test touches the user's cache."""
    cache = tmp_path_factory.mktemp("onboard_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ONBOARD_CACHE", str(cache))
        yield cache


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny llama checkpoint (untied lm_head). Shared: do not modify; use `tiny_llama_copy`."""
    return build_once(tmp_path_factory, "tiny_llama", lambda out: tiny_models.build_model(out, "llama"))


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny qwen3 checkpoint (lm_head tied to the embedding). Shared: do not modify."""
    return build_once(tmp_path_factory, "tiny_qwen3", lambda out: tiny_models.build_model(out, "qwen3"))


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny qwen3_moe checkpoint (4 experts, 2 per token). Shared: do not modify."""
    return build_once(tmp_path_factory, "tiny_qwen3_moe", lambda out: tiny_models.build_model(out, "qwen3_moe"))


@pytest.fixture(scope="session")
def tiny_deepseek_v3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny deepseek_v3: MLA without q_lora_rank, YaRN, DeepSeek MoE. Shared: do not modify."""
    return build_once(tmp_path_factory, "tiny_deepseek_v3", lambda out: tiny_models.build_model(out, "deepseek_v3"))


@pytest.fixture(scope="session")
def tiny_deepseek_v32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny deepseek_v32: MLA + DSA indexer (top-16), YaRN, DeepSeek MoE. Shared: do not modify."""
    return build_once(tmp_path_factory, "tiny_deepseek_v32", lambda out: tiny_models.build_model(out, "deepseek_v32"))


@pytest.fixture(scope="session")
def tiny_glm_moe_dsa(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny glm_moe_dsa (GLM-5): MLA + DSA with a shared-indexer layer. Shared: do not modify."""
    return build_once(tmp_path_factory, "tiny_glm_moe_dsa", lambda out: tiny_models.build_model(out, "glm_moe_dsa"))


@pytest.fixture(scope="session")
def tiny_qwen3_5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Qwen3.5 release (the VLM): a Gated DeltaNet layer, then an output-gated attention layer,
    a vision tower, and an MTP module under `mtp.*`. Shared: do not modify."""
    return build_once(tmp_path_factory, "tiny_qwen3_5", tiny_models.build_qwen3_5)


@pytest.fixture(scope="session")
def tiny_qwen3_5_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tiny_qwen3_5` with Qwen3.5-MoE's experts and sigmoid-gated shared expert. Shared: do not modify."""
    return build_once(tmp_path_factory, "tiny_qwen3_5_moe", tiny_models.build_qwen3_5_moe)


@pytest.fixture(scope="session")
def tiny_glm4_moe_lite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny GLM-4.7-Flash (DeepSeek-V3's MLA and MoE under its own name). Shared: do not modify."""
    return build_once(tmp_path_factory, "tiny_glm4_moe_lite", tiny_models.build_glm4_moe_lite)


@pytest.fixture(scope="session")
def tiny_minimax_m2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny MiniMax-M2 (whole-projection q/k norms, a sigmoid router). Shared: do not modify."""
    return build_once(tmp_path_factory, "tiny_minimax_m2", tiny_models.build_minimax_m2)


@pytest.fixture(scope="session")
def tiny_gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny gpt-oss (attention sinks, alternating windows, biased clamped experts). Shared: do not modify."""
    return build_once(tmp_path_factory, "tiny_gpt_oss", tiny_models.build_gpt_oss)


@pytest.fixture(scope="session")
def tiny_qwen3_next(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Qwen3-Next: Qwen3.5-MoE's layers with fused Gated DeltaNet projections. Shared: do not modify."""
    return build_once(tmp_path_factory, "tiny_qwen3_next", tiny_models.build_qwen3_next)


@pytest.fixture(scope="session")
def tiny_glm5_next(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny GLM-5.3-Flash release (the VLM): two KDA layers, a NoPE MLA layer with the pooled DSA
    indexer and one sharing its selection, hyper-connections, clamped MoE, a vision tower and an
    MTP layer under `model.language_model.layers.4.*`. Shared: do not modify."""
    return build_once(tmp_path_factory, "tiny_glm5_next", tiny_models.build_glm5_next)


@pytest.fixture(scope="session")
def tiny_mtp_deepseek_v3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_deepseek_v3 with an MTP layer (model.layers.3.*). Shared: do not modify."""
    return build_once(
        tmp_path_factory, "tiny_mtp_deepseek_v3", lambda out: tiny_models.build_mtp_model(out, "deepseek_v3")
    )


@pytest.fixture(scope="session")
def tiny_mtp_deepseek_v32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_deepseek_v32 (DSA) with an MTP layer. Shared: do not modify."""
    return build_once(
        tmp_path_factory, "tiny_mtp_deepseek_v32", lambda out: tiny_models.build_mtp_model(out, "deepseek_v32")
    )


@pytest.fixture(scope="session")
def tiny_mtp_glm_moe_dsa(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_glm_moe_dsa (GLM-5) with an MTP layer. Shared: do not modify."""
    return build_once(
        tmp_path_factory, "tiny_mtp_glm_moe_dsa", lambda out: tiny_models.build_mtp_model(out, "glm_moe_dsa")
    )


@pytest.fixture(scope="session")
def tiny_mtp_predictable(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_mtp_deepseek_v3 whose main layers add nothing to the embedding: its greedy text is a
    short cycle an MTP layer can learn. Shared: do not modify."""

    def build(out: Path) -> None:
        tiny_models.build_mtp_model(out, "deepseek_v3", residual_scale=0.0)

    return build_once(tmp_path_factory, "tiny_mtp_predictable", build)


@pytest.fixture
def tiny_llama_copy(tiny_llama: Path, tmp_path: Path) -> Path:
    """A private copy of `tiny_llama` that a test may corrupt."""
    return Path(shutil.copytree(tiny_llama, tmp_path / "tiny_llama"))


@pytest.fixture(scope="session")
def quantized_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path, Quantize], Path]:
    """`quantized_run(checkpoint, settings)`: the run directory of the real quantize stage on that
    checkpoint with those settings, built once per test run. Shared: do not modify; take
    `build_once.copy_of` it to run further stages."""
    from artifacts import quantize_into

    def run_dir(checkpoint: Path, settings: Quantize) -> Path:
        key = settings_key(f"quantized-{checkpoint.name}", f"{checkpoint.resolve()}|{settings.model_dump_json()}")
        return build_once(tmp_path_factory, key, lambda root: quantize_into(root, checkpoint, settings))

    return run_dir


@pytest.fixture(scope="session")
def onboard_process(onboard_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[CliServer]:
    """`onboard` in real processes forked from one warm interpreter (`cli_process.py`)."""
    server = CliServer(tmp_path_factory.mktemp("cli_runs"), dict(os.environ))
    yield server
    server.close()
