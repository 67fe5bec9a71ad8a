"""Export an `Eagle3Draft` as a `speculators` EAGLE-3 checkpoint (config.json + model.safetensors).

The layout is what `speculators` (v0.9.0) `Eagle3DraftModel.save_pretrained` writes and what
vLLM's speculators loader and `Eagle3DraftModel.from_pretrained` read:

* `config.json`: an `Eagle3SpeculatorConfig` (`speculators_model_type: "eagle3"`) whose
  `transformer_layer_config` is the draft layer's `LlamaConfig.to_diff_dict()`, with a
  `speculators_config` naming one greedy proposal method of K speculative tokens and the
  verifier (the artifact the draft was trained against).
* `model.safetensors`: the draft's whole state dict, the (frozen, target-owned) `embed_tokens.weight`
  included as speculators' own `save_pretrained` writes it: speculators 0.9.0 with transformers 5
  only refills a missing embedding from the verifier where it still holds a NaN sentinel, which
  building the model on the meta device loses, so without it the export would not round-trip.

`speculators` is a dev-only dependency (its declared deps clash with our torch pins), so the JSON
is written by hand here; `tests/speculator/test_export.py` checks it field for field against the
config that speculators' own pydantic classes build and loads the export with speculators.
"""

import json
import os
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import transformers

from onboard import atomic
from onboard.errors import OnboardError
from onboard.speculator.draft import Eagle3Draft

SPECULATORS_VERSION = "0.9.0"  # the speculators release whose format this writes
# `Eagle3SpeculatorConfig`'s own default; speculators 0.9.0's `save_pretrained` overwrites it with
# the model class name ("Eagle3DraftModel"), both load the same, and SGLang recognises this one.
ARCHITECTURES = ["Eagle3Speculator"]
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


def _verifier_architectures(verifier_path: Path) -> list[str]:
    config = verifier_path / "config.json"
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise OnboardError(f"cannot read the verifier config {config}: {err}") from err
    return list(data.get("architectures") or [])


def _layer_config_dict(draft: Eagle3Draft) -> dict[str, Any]:
    # As `Eagle3SpeculatorConfig.serialize_transformer_config` does; the nested diff that
    # `PretrainedConfig.to_json_string` writes omits the per-config transformers_version.
    layer = draft.layer_config.to_diff_dict()
    layer.pop("transformers_version", None)
    return layer


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def speculator_config(
    draft: Eagle3Draft, verifier_path: Path, num_speculative_tokens: int, dtype: torch.dtype
) -> dict[str, Any]:
    """The `config.json` of the export: every field `Eagle3SpeculatorConfig.to_json_string()`
    writes for this draft (its pydantic fields, non-default PretrainedConfig fields), plus dtype."""
    return {
        "architectures": ARCHITECTURES,
        "draft_vocab_size": int(draft.draft_vocab_size),
        "dtype": _dtype_name(dtype),
        "eagle_aux_hidden_state_layer_ids": [int(i) for i in draft.aux_layer_ids],
        "embed_requires_grad": False,
        "fc_norm": draft.fc_norm is not None,
        "norm_before_fc": False,
        "norm_before_residual": False,
        "norm_output": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "accept_tolerance": 0.0,
                    "proposal_type": "greedy",
                    "speculative_tokens": int(num_speculative_tokens),
                    "verifier_accept_k": 1,
                }
            ],
            "verifier": {
                "architectures": _verifier_architectures(verifier_path),
                "name_or_path": str(verifier_path),
            },
        },
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "target_hidden_size": None,
        "transformer_layer_config": _layer_config_dict(draft),
        "transformers_version": transformers.__version__,
    }


def speculator_tensors(draft: Eagle3Draft) -> dict[str, torch.Tensor]:
    """The tensors of `model.safetensors`: the draft's state dict as contiguous CPU copies.  The
    vocabulary maps `d2t`/`t2d` are kept when the draft vocabulary is a subset; with the full
    vocabulary speculators has no such buffers (they would be unexpected)."""
    full_vocab = draft.draft_vocab_size == draft.layer_config.vocab_size
    tensors = {}
    for name, tensor in draft.state_dict().items():
        if full_vocab and name in ("d2t", "t2d"):
            continue
        tensors[name] = tensor.detach().to("cpu", copy=True).contiguous()
    return tensors


def export_speculator(draft: Eagle3Draft, out_dir: Path, verifier_path: Path, num_speculative_tokens: int) -> None:
    """Write `out_dir/config.json` and `out_dir/model.safetensors` (speculators EAGLE-3 format).

    The files are built in a staging directory next to `out_dir` and renamed over it, so a crash
    leaves the previous export (or none), never a half-written one.  The same draft gives the same
    bytes."""
    if num_speculative_tokens < 1:
        raise OnboardError(f"num_speculative_tokens must be at least 1, got {num_speculative_tokens}")
    out_dir, verifier_path = Path(out_dir), Path(verifier_path)
    dtype = draft.fc.weight.dtype
    config = speculator_config(draft, verifier_path, num_speculative_tokens, dtype)
    weights = safetensors.torch.save(speculator_tensors(draft), metadata={"format": "pt"})

    staging = out_dir.with_name(f".{out_dir.name}.partial-{os.getpid()}")
    atomic.remove(staging)
    try:
        staging.mkdir(parents=True)
        # Sorted keys and 2-space indent, as `PretrainedConfig.to_json_string` writes.
        atomic.write_text(staging / CONFIG_NAME, json.dumps(config, indent=2, sort_keys=True) + "\n")
        atomic.write_bytes(staging / WEIGHTS_NAME, weights)
        atomic.replace_tree(staging, out_dir)
    finally:
        atomic.remove(staging)


def load_speculator(path: Path) -> Eagle3Draft:
    """An exported EAGLE-3 draft back as an `Eagle3Draft` (the inverse of `export_speculator`)."""
    path = Path(path)
    try:
        config = json.loads((path / CONFIG_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise OnboardError(f"{path} is not a speculator export: {err}") from None
    if config.get("speculators_model_type") != "eagle3":
        raise OnboardError(f"{path}: speculators_model_type is {config.get('speculators_model_type')!r}, not eagle3")
    layer_config = transformers.LlamaConfig(**config["transformer_layer_config"])
    layer_config._attn_implementation = "sdpa"
    draft = Eagle3Draft(
        layer_config,
        int(config["draft_vocab_size"]),
        list(config["eagle_aux_hidden_state_layer_ids"]),
        fc_norm=bool(config.get("fc_norm", False)),
    )
    state = safetensors.torch.load_file(str(path / WEIGHTS_NAME))
    if "d2t" not in state:  # full vocabulary: identity maps
        state["d2t"] = torch.zeros(draft.draft_vocab_size, dtype=torch.long)
        state["t2d"] = torch.ones(layer_config.vocab_size, dtype=torch.bool)
    missing, unexpected = draft.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise OnboardError(f"{path}: weights do not match the config (missing {missing}, unexpected {unexpected})")
    return draft.to(state["fc.weight"].dtype).eval()


def speculative_tokens(path: Path) -> int:
    """K of an export: its greedy proposal method's `speculative_tokens`."""
    config = json.loads((Path(path) / "config.json").read_text())
    methods = config["speculators_config"]["proposal_methods"]
    return int(methods[0]["speculative_tokens"])
