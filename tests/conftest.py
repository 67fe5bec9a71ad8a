"""Shared fixtures: tiny seeded checkpoints built once per session, and an isolated cache."""

import os

# Never reach a model hub from the tests; set before transformers is imported anywhere.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import tiny_models
import torch

torch.set_num_threads(2)


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
    return tiny_models.build_model(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny qwen3 checkpoint (lm_head tied to the embedding). Shared: do not modify."""
    return tiny_models.build_model(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3")


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny qwen3_moe checkpoint (4 experts, 2 per token). Shared: do not modify."""
    return tiny_models.build_model(tmp_path_factory.mktemp("tiny_qwen3_moe"), "qwen3_moe")


@pytest.fixture(scope="session")
def tiny_deepseek_v3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny deepseek_v3: MLA without q_lora_rank, YaRN, DeepSeek MoE. Shared: do not modify."""
    return tiny_models.build_model(tmp_path_factory.mktemp("tiny_deepseek_v3"), "deepseek_v3")


@pytest.fixture(scope="session")
def tiny_deepseek_v32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny deepseek_v32: MLA + DSA indexer (top-16), YaRN, DeepSeek MoE. Shared: do not modify."""
    return tiny_models.build_model(tmp_path_factory.mktemp("tiny_deepseek_v32"), "deepseek_v32")


@pytest.fixture(scope="session")
def tiny_glm_moe_dsa(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny glm_moe_dsa (GLM-5): MLA + DSA with a shared-indexer layer. Shared: do not modify."""
    return tiny_models.build_model(tmp_path_factory.mktemp("tiny_glm_moe_dsa"), "glm_moe_dsa")


@pytest.fixture(scope="session")
def tiny_mtp_deepseek_v3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_deepseek_v3 with an MTP layer (model.layers.3.*). Shared: do not modify."""
    return tiny_models.build_mtp_model(tmp_path_factory.mktemp("tiny_mtp_deepseek_v3"), "deepseek_v3")


@pytest.fixture(scope="session")
def tiny_mtp_deepseek_v32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_deepseek_v32 (DSA) with an MTP layer. Shared: do not modify."""
    return tiny_models.build_mtp_model(tmp_path_factory.mktemp("tiny_mtp_deepseek_v32"), "deepseek_v32")


@pytest.fixture(scope="session")
def tiny_mtp_glm_moe_dsa(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_glm_moe_dsa (GLM-5) with an MTP layer. Shared: do not modify."""
    return tiny_models.build_mtp_model(tmp_path_factory.mktemp("tiny_mtp_glm_moe_dsa"), "glm_moe_dsa")


@pytest.fixture(scope="session")
def tiny_mtp_predictable(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_mtp_deepseek_v3 whose main layers add nothing to the embedding: its greedy text is a
    short cycle an MTP layer can learn. Shared: do not modify."""
    path = tmp_path_factory.mktemp("tiny_mtp_predictable")
    return tiny_models.build_mtp_model(path, "deepseek_v3", residual_scale=0.0)


@pytest.fixture
def tiny_llama_copy(tiny_llama: Path, tmp_path: Path) -> Path:
    """A private copy of `tiny_llama` that a test may corrupt."""
    return Path(shutil.copytree(tiny_llama, tmp_path / "tiny_llama"))
