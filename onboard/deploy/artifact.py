"""What the artifact says about how to serve it: config.json and the speculator export."""

import json
from dataclasses import dataclass
from pathlib import Path

from onboard.errors import OnboardError

MTP = "mtp"  # `--speculator mtp`: the checkpoint's own multi-token-prediction layers


@dataclass(frozen=True)
class Speculator:
    path: Path | None  # the EAGLE-3 export; None for MTP (its layers are in the checkpoint)
    num_tokens: int
    method: str = "eagle3"  # vLLM's speculative `method`: "eagle3" | "mtp"


def is_mtp(given: Path | str | None) -> bool:
    return given is not None and str(given) == MTP


def read_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.is_file():
        raise OnboardError(f"{model_dir} has no config.json: not a checkpoint (or a run without an artifact)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise OnboardError(f"cannot read {path}: {err}") from None
    if not isinstance(config, dict):
        raise OnboardError(f"{path} is not a JSON object")
    return config


def quantization_of(config: dict) -> str | None:
    """`quantization_config` in words: "compressed-tensors (nvfp4-pack-quantized)", or None."""
    quant = config.get("quantization_config")
    if not isinstance(quant, dict):
        return None
    method = str(quant.get("quant_method", "unknown"))
    fmt = quant.get("format")
    if fmt == "mixed-precision":  # each config group names its own format
        groups = quant.get("config_groups") or {}
        parts = sorted({str(g["format"]) for g in groups.values() if isinstance(g, dict) and g.get("format")})
        if parts:
            fmt = f"mixed-precision: {', '.join(parts)}"
    return f"{method} ({fmt})" if fmt else method


def context_length_of(config: dict) -> int | None:
    """The checkpoint's `max_position_embeddings` (a multimodal config keeps it in text_config)."""
    for scope in (config, config.get("text_config") or {}):
        value = scope.get("max_position_embeddings") if isinstance(scope, dict) else None
        if isinstance(value, int) and value > 0:
            return value
    return None


def speculative_tokens(path: Path) -> int:
    """K of a speculators EAGLE-3 export: `speculators_config.proposal_methods[0].speculative_tokens`,
    where `onboard.speculator.export.speculator_config` writes it."""
    config_path = path / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise OnboardError(f"--speculator {path}: not a speculator export ({err})") from None
    if not isinstance(config, dict) or config.get("speculators_model_type") != "eagle3":
        kind = config.get("speculators_model_type") if isinstance(config, dict) else None
        raise OnboardError(f"--speculator {path}: speculators_model_type is {kind!r}, not eagle3")
    try:
        methods = config["speculators_config"]["proposal_methods"]
        return int(methods[0]["speculative_tokens"])
    except (KeyError, IndexError, TypeError, ValueError):
        raise OnboardError(f"{config_path}: no speculators_config.proposal_methods[0].speculative_tokens") from None


def speculator_of(model_dir: Path, given: Path | None, num_tokens: int | None) -> Speculator | None:
    """The given export (or `mtp`), else the artifact's own `speculator/` (what `onboard speculator`
    writes), else its MTP layers when it has them."""
    from onboard.models.mtp import declared_mtp_layers, has_mtp_layers

    config = read_config(model_dir)
    has_mtp = has_mtp_layers(model_dir, config)
    if is_mtp(given) and not has_mtp:
        raise OnboardError(f"--speculator mtp: {model_dir} has no MTP layers (num_nextn_predict_layers and tensors)")
    path = given if given is not None else model_dir / "speculator"
    if is_mtp(given) or (given is None and has_mtp and not (path / "config.json").is_file()):
        return Speculator(None, num_tokens if num_tokens is not None else declared_mtp_layers(config), MTP)
    if given is None and not (path / "config.json").is_file():
        if num_tokens is not None:
            raise OnboardError(f"--num-speculative-tokens: {model_dir} has no speculator/ (give --speculator DIR)")
        return None
    if not (path / "config.json").is_file():
        raise OnboardError(f"--speculator {path}: not a speculator export (no config.json)")
    exported = speculative_tokens(path)
    return Speculator(path.resolve(), num_tokens if num_tokens is not None else exported)
