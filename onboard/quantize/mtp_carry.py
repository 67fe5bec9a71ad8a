"""The source's MTP layers carried into the artifact, byte for byte, in BF16 (or as stored).

llm-compressor saves the artifact through the transformers model, which never loaded the MTP
layers (`onboard/models/mtp.py`), so they are copied from the source's files into `mtp-*.safetensors`
shards of the artifact, the index lists them, the config keeps their count, and the
compressed-tensors `ignore` list names them, so vLLM and SGLang load them unquantized as the
`mtp` speculator.  A source whose config declares MTP layers it does not hold gets an artifact
that declares none, so no server asked for MTP looks for weights that are not there.
"""

import json
from pathlib import Path

from onboard import atomic
from onboard.console import console
from onboard.models.headers import TensorEntry, safetensors_entries
from onboard.models.mtp import count_key, declared_mtp_layers, ignore_pattern, mtp_entries, mtp_prefixes
from onboard.quantize.kept import KeptLost, check_kept

SHARD_BYTES = 2 * 1024**3  # as the artifact's own shards: one shard's tensors are in memory at a time
INDEX = "model.safetensors.index.json"


class MtpLost(KeptLost):
    """An artifact lacks MTP tensors its source has."""


def carry_mtp(source: Path, artifact: Path) -> dict:
    """Copy `source`'s MTP tensors into `artifact`; returns what `check_mtp_kept` records."""
    from safetensors.torch import save_file

    config = json.loads((source / "config.json").read_text())
    declared = declared_mtp_layers(config)
    if not declared:
        return {"layers": 0, "tensors": 0, "bytes": 0, "kept": True}
    entries = mtp_entries(source, config)
    if not entries:
        prefix = mtp_prefixes(config)[0]
        console.print(
            f"[yellow]{source.name} declares {declared} MTP layer(s) but holds no {prefix}* tensors: "
            "the artifact declares none[/]"
        )
        _edit_config(artifact, config, 0, None)
        return {"layers": 0, "declared": declared, "tensors": 0, "bytes": 0, "kept": True}
    # llm-compressor 0.14 copies an `mtp.` module itself when the text config counts it
    # (`mtp_num_hidden_layers`): only what it left out is copied here, and all is checked below.
    present = safetensors_entries(artifact)
    missing = {name: entry for name, entry in entries.items() if name not in present}
    single = artifact / "model.safetensors"
    if missing and single.is_file() and not (artifact / INDEX).is_file():
        # transformers reads a lone model.safetensors before any index, and would never see the MTP shards.
        single.rename(artifact / "model-00001-of-00001.safetensors")
    shards = _shards(missing) if missing else []
    for i, names in enumerate(shards):
        tensors = {name: _tensor(name, entries[name]) for name in names}
        save_file(tensors, str(artifact / f"mtp-{i + 1:05d}-of-{len(shards):05d}.safetensors"), {"format": "pt"})
        del tensors
    if missing:
        _write_index(artifact)
    _edit_config(artifact, config, declared, ignore_pattern(config, entries))
    record = check_mtp_kept(source, artifact)
    console.print(
        f"kept {record['tensors']} MTP tensors ({record['bytes'] / 1e6:.1f} MB) of {declared} layer(s), as stored"
    )
    return record


def check_mtp_kept(source: Path, artifact: Path, byte_equal: bool = True) -> dict:
    """Every MTP tensor of `source` is in `artifact` with its dtype and shape (and its bytes, unless
    `byte_equal` is off: a retrained head); raises `MtpLost` in one line otherwise."""
    config = json.loads((source / "config.json").read_text())
    wanted = mtp_entries(source, config)
    lost = ": served with MTP it would accept nothing"
    try:
        record = check_kept("MTP", wanted, source, artifact, byte_equal, consequence=lost)
    except KeptLost as err:
        raise MtpLost(str(err)) from None
    return {"layers": declared_mtp_layers(config), **record}


def _tensor(name: str, entry: TensorEntry):
    from safetensors import safe_open

    with safe_open(str(entry.file), framework="pt") as handle:
        return handle.get_tensor(name)


def _shards(entries: dict[str, TensorEntry]) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(entries):
        if shards[-1] and size + entries[name].nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += entries[name].nbytes
    return shards


def _write_index(artifact: Path) -> None:
    entries = safetensors_entries(artifact)
    index = {
        "metadata": {"total_size": sum(entry.nbytes for entry in entries.values())},
        "weight_map": {name: entry.file.name for name, entry in sorted(entries.items())},
    }
    atomic.write_json(artifact / INDEX, index)


def _edit_config(artifact: Path, source_config: dict, count: int, ignore: str | None) -> None:
    """The artifact declares `count` MTP layers under the source's key, where the source has it (a
    VLM's `text_config` or the top level), and its `ignore` list names them."""
    path = artifact / "config.json"
    config = json.loads(path.read_text())
    key, _ = count_key(source_config) or ("num_nextn_predict_layers", 0)
    nested = key not in source_config and isinstance(source_config.get("text_config"), dict)
    (config.setdefault("text_config", {}) if nested else config)[key] = count
    quantization = config.get("quantization_config")
    if ignore and quantization is not None:
        entries = quantization.setdefault("ignore", [])
        if ignore not in entries:
            entries.append(ignore)
    atomic.write_text(path, json.dumps(config, indent=2, sort_keys=True) + "\n")
