"""Multi-token-prediction (MTP) layers in a checkpoint: DeepSeek-V3/V3.2's and GLM-5's own speculator.

They are stored as extra decoder layers after the main ones, `model.layers.{N + k}.*` for
`N = num_hidden_layers` and `k < num_nextn_predict_layers` (transformers calls the count
`num_mtp_layers`): the decoder block's tensors plus `enorm`, `hnorm`, `eh_proj`,
`shared_head.norm` and, in DeepSeek's releases, copies of the embedding and the head.
transformers drops them on load (`_keys_to_ignore_on_load_unexpected`), so anything that writes
a checkpoint through a transformers model loses them unless it carries them by hand.

Only safetensors headers are read here: listing a 1.5 TB checkpoint's MTP tensors costs no
tensor reads.
"""

import json
from pathlib import Path

from onboard.models.headers import TensorEntry, safetensors_entries

COUNT_KEYS = ("num_nextn_predict_layers", "num_mtp_layers")


def declared_mtp_layers(config: dict) -> int:
    """How many MTP layers the config says the checkpoint has (0 when it says nothing)."""
    for key in COUNT_KEYS:
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def mtp_prefixes(config: dict) -> list[str]:
    first = int(config["num_hidden_layers"])
    return [f"model.layers.{first + k}." for k in range(declared_mtp_layers(config))]


def ignore_pattern(config: dict) -> str | None:
    """A compressed-tensors `ignore` entry matching every MTP module (`re:` is matched from the start)."""
    first, count = int(config["num_hidden_layers"]), declared_mtp_layers(config)
    if not count:
        return None
    layers = "|".join(str(first + k) for k in range(count))
    return rf"re:model\.layers\.({layers})\."


def mtp_entries(directory: Path, config: dict | None = None) -> dict[str, TensorEntry]:
    """The checkpoint's MTP tensors (by the config's count and layer numbers), from headers."""
    if config is None:
        config = json.loads((Path(directory) / "config.json").read_text())
    prefixes = tuple(mtp_prefixes(config))
    if not prefixes:
        return {}
    return {name: entry for name, entry in safetensors_entries(directory).items() if name.startswith(prefixes)}


def has_mtp_layers(directory: Path, config: dict | None = None) -> bool:
    """The config declares MTP layers and the checkpoint holds their tensors."""
    if config is None:
        path = Path(directory) / "config.json"
        if not path.is_file():
            return False
        config = json.loads(path.read_text())
    return bool(declared_mtp_layers(config)) and bool(mtp_entries(directory, config))
