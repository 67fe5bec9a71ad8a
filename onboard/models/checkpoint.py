"""Checking a local checkpoint before anything loads it: layout, integrity, safety.

Every check here turns a deep library traceback (a truncated file, a pickle, an unknown
architecture) into one line that says which file is wrong and what to do.
"""

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from onboard.errors import OnboardError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


@dataclass(frozen=True)
class Checkpoint:
    """A validated Hugging Face checkpoint directory."""

    path: Path
    config: dict
    allow_pickle: bool = False
    trust_remote_code: bool = False

    @property
    def architectures(self) -> list[str]:
        return list(self.config.get("architectures") or [])

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type", ""))


def check_safetensors(path: Path) -> None:
    """The header parses and the file is as long as the header says (catches truncation)."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as handle:
            (header_len,) = struct.unpack("<Q", handle.read(8))
            if header_len > size - 8:
                raise ValueError("header longer than the file")
            header = json.loads(handle.read(header_len))
        data_end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (struct.error, ValueError, UnicodeDecodeError, AttributeError, KeyError, TypeError, IndexError) as err:
        raise OnboardError(f"{path} is not a valid safetensors file ({err!r}); re-download it") from err
    if 8 + header_len + data_end > size:
        raise OnboardError(
            f"{path} is truncated: {size} bytes on disk, {8 + header_len + data_end} expected; re-download it"
        )


def _read_config(directory: Path) -> dict:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise OnboardError(f"{directory} has no config.json: not a Hugging Face checkpoint directory")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as err:
        raise OnboardError(f"{config_path} is unreadable: {err}") from err
    if not isinstance(config, dict):
        raise OnboardError(f"{config_path} is not a JSON object")
    return config


def inspect_checkpoint(path: Path, *, allow_pickle: bool = False, trust_remote_code: bool = False) -> Checkpoint:
    path = Path(path).expanduser()
    if not path.exists():
        raise OnboardError(f"model path {path} does not exist")
    if not path.is_dir():
        raise OnboardError(f"model path {path} is neither a checkpoint directory nor a .gguf file")
    config = _read_config(path)

    weights = sorted(path.glob("*.safetensors"))
    pickles = sorted(p for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if not weights and pickles and not allow_pickle:
        raise OnboardError(
            f"{path} has only pickle weights ({pickles[0].name}), which can run arbitrary code when "
            "loaded; convert it to safetensors or pass --allow-pickle if you trust its source"
        )
    if not weights and not pickles:
        raise OnboardError(f"{path} has no weight files (*.safetensors)")
    for file in weights:
        check_safetensors(file)

    model_type = config.get("model_type")
    if not trust_remote_code and model_type not in CONFIG_MAPPING_NAMES:
        import transformers

        arch = ", ".join(config.get("architectures") or []) or "unknown architecture"
        raise OnboardError(
            f"{path}: {arch} (model_type {model_type!r}) is not known to transformers "
            f"{transformers.__version__}; upgrade transformers, or pass --trust-remote-code "
            "if you trust the checkpoint's own code"
        )
    return Checkpoint(path=path, config=config, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)
