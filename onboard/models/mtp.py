"""Multi-token-prediction (MTP) layers in a checkpoint: a release's own speculator.

Two layouts, told apart by the tensor names:
* DeepSeek-V3/V3.2, GLM-4.5 and GLM-5 store them as extra decoder layers after the main ones,
  `model.layers.{N + k}.*` for `N = num_hidden_layers` and `k < num_nextn_predict_layers`
  (transformers calls the count `num_mtp_layers`): the decoder block's tensors plus `enorm`,
  `hnorm`, `eh_proj`, `shared_head.norm` and, in DeepSeek's releases, copies of the embedding and
  the head.
* Qwen3.5 and Qwen3-Next (and DeepSeek-V4, Nemotron-H) store one `mtp` module beside `model`,
  `mtp.*` (its layers under `mtp.layers.k.`), counted by `mtp_num_hidden_layers` (Qwen) or
  `num_nextn_predict_layers`.
transformers drops them on load (`_keys_to_ignore_on_load_unexpected`), so anything that writes
a checkpoint through a transformers model loses them unless it carries them by hand.

Only safetensors headers are read here: listing a 1.5 TB checkpoint's MTP tensors costs no
tensor reads.
"""

import json
from collections.abc import Iterable
from pathlib import Path

from onboard.models.headers import TensorEntry, safetensors_entries
from onboard.models.vlm import checkpoint_name, text_config, wrapper_of

COUNT_KEYS = ("num_nextn_predict_layers", "num_mtp_layers", "mtp_num_hidden_layers")
MODULE_PREFIX = "mtp."  # the separate-module layout


def count_key(config: dict) -> tuple[str, int] | None:
    """(the key, its count) where the config declares MTP layers: at the top level, or in a
    VLM's `text_config` (GLM-5.3-Flash, Qwen3.5's releases)."""
    for where in (config, text_config(config)):
        for key in COUNT_KEYS:
            value = where.get(key)
            if isinstance(value, int) and value > 0:
                return key, value
    return None


def declared_mtp_layers(config: dict) -> int:
    """How many MTP layers the config says the checkpoint has (0 when it says nothing)."""
    found = count_key(config)
    return found[1] if found else 0


def module_layout(config: dict, names: Iterable[str] | None) -> bool:
    """The `mtp.` module layout: its count key says so, or the checkpoint's tensors do."""
    found = count_key(config)
    if found and found[0] == "mtp_num_hidden_layers":
        return True
    return names is not None and any(name.startswith(MODULE_PREFIX) for name in names)


def _first_layer(config: dict) -> int:
    return int(text_config(config)["num_hidden_layers"])


def mtp_prefixes(config: dict, names: Iterable[str] | None = None) -> list[str]:
    """Where the declared MTP layers' tensors start (`names`: the checkpoint's, to tell the layout)."""
    count = declared_mtp_layers(config)
    if not count:
        return []
    if module_layout(config, names):
        return [MODULE_PREFIX]
    first, wrapper = _first_layer(config), wrapper_of(config)
    return [checkpoint_name(f"model.layers.{first + k}.", wrapper) for k in range(count)]


def ignore_pattern(config: dict, names: Iterable[str] | None = None) -> str | None:
    """A compressed-tensors `ignore` entry matching every MTP module (`re:` is matched from the start)."""
    first, count = _first_layer(config), declared_mtp_layers(config)
    if not count:
        return None
    if module_layout(config, names):
        return r"re:mtp\."
    layers = "|".join(str(first + k) for k in range(count))
    model = checkpoint_name("model.", wrapper_of(config)).replace(".", r"\.")
    return rf"re:{model}layers\.({layers})\."


def mtp_entries(directory: Path, config: dict | None = None) -> dict[str, TensorEntry]:
    """The checkpoint's MTP tensors (by the config's count and the layout), from headers."""
    if config is None:
        config = json.loads((Path(directory) / "config.json").read_text())
    if not declared_mtp_layers(config):
        return {}
    entries = safetensors_entries(directory)
    prefixes = tuple(mtp_prefixes(config, entries))
    return {name: entry for name, entry in entries.items() if name.startswith(prefixes)}


def has_mtp_layers(directory: Path, config: dict | None = None) -> bool:
    """The config declares MTP layers and the checkpoint holds their tensors."""
    if config is None:
        path = Path(directory) / "config.json"
        if not path.is_file():
            return False
        config = json.loads(path.read_text())
    return bool(declared_mtp_layers(config)) and bool(mtp_entries(directory, config))
