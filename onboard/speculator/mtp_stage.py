"""The speculator stage for artifacts that keep their MTP layers (DeepSeek-V3/V3.2, GLM-5).

What quantization does to the model's own speculator, measured on the same held-out prompts
(greedy, in the engine): the source's MTP layers on the BF16 source, and the artifact's on the
artifact: the MTP layers are the same bytes (`quantize/mtp_carry.py`); the states they read are
not.  No anchor reports this; users see it only as lost throughput.

`--draft mtp` then fine-tunes the MTP layers on the artifact's own states (the EAGLE-3 data path
and training loop: `train.py`, data parallel under torchrun), and writes them back into the
artifact's `mtp-*.safetensors` when they accept more on the held-out prompts than the shipped
ones.  speculators' MTP training covers Qwen3-Next and Qwen3.5 only (its `mtp_model_classes`),
so onboard trains transformers' own DeepSeek and GLM layers itself.
"""

from pathlib import Path
from typing import Any

from rich.table import Table

from onboard.console import console
from onboard.models.mtp import has_mtp_layers
from onboard.speculator.measure import measure_acceptance
from onboard.speculator.mtp_base import MtpDraftBase
from onboard.speculator.mtp_draft import load_mtp_draft
from onboard.workspace import ARTIFACT, RunDir, Stage

SUMMARY_KEYS = ("acceptance_length", "per_position_acceptance", "speedup", "spec_lossless_greedy", "num_drafts")


def mtp_outputs(artifact: Path) -> list[str]:
    """The artifact's MTP shards, as run-directory paths (`--draft mtp` rewrites them)."""
    return [f"{ARTIFACT}/{path.name}" for path in sorted(Path(artifact).glob("mtp-*.safetensors"))]


def engine_mtp(engine, path: Path) -> MtpDraftBase:
    target = engine.target_tensors()
    return load_mtp_draft(path, target["embed_tokens"], target["lm_head"], engine.dtype)


def summary(metrics: dict[str, Any]) -> dict[str, Any]:
    return {key: metrics[key] for key in SUMMARY_KEYS}


def measure_mtp(
    engine, run: RunDir, config, held_out: list, k: int, max_tokens: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The MTP layers' acceptance on the artifact, and the source's on the BF16 source (a second
    engine, built after the first measurement and dropped after its own), on the same prompts:
    metrics.json's `mtp` entry and the artifact's whole measurement."""
    from onboard.engine import LLMEngine

    console.print(f"speculator: MTP acceptance on the artifact ({len(held_out)} prompts, K = {k}) ...")
    result: dict[str, Any] = {"num_speculative_tokens": k, "num_prompts": len(held_out)}
    measured = measure_acceptance(engine, engine_mtp(engine, run.artifact), k, held_out, max_tokens)
    result["artifact"] = summary(measured)
    source = run.source if run.source is not None and run.source.is_dir() else None
    if source is None or not has_mtp_layers(source):
        result["bf16"] = None
        result["bf16_note"] = "the quantized source is not on this machine" if source is None else "no MTP layers"
        return result, measured
    console.print(f"speculator: MTP acceptance on the BF16 source {source} ...")
    reference = LLMEngine(source, config)
    result["bf16"] = summary(measure_acceptance(reference, engine_mtp(reference, source), k, held_out, max_tokens))
    del reference
    result["acceptance_ratio"] = result["artifact"]["acceptance_length"] / result["bf16"]["acceptance_length"]
    return result, measured


def write_mtp_layers(draft: MtpDraftBase, artifact: Path, stage: Stage, retrained: bool) -> None:
    """The artifact's MTP shards into the stage: with the draft's layers (in the checkpoint's names
    and dtypes, transformers' conversions reverted) when `retrained`, else as they are."""
    from safetensors.torch import load_file, save_file

    layers = draft.checkpoint_state() if retrained else {}
    for relative in mtp_outputs(artifact):
        name = relative.removeprefix(f"{ARTIFACT}/")
        tensors = load_file(str(artifact / name))
        for key, value in layers.items():
            if key in tensors:
                tensors[key] = value.to(tensors[key].dtype).contiguous()
        save_file(tensors, str(stage.path(relative)), {"format": "pt"})


def trainable(draft: MtpDraftBase) -> MtpDraftBase:
    """A float32 copy whose MTP layers train (the shared embedding and head stay frozen)."""
    draft = draft.float()
    for name, param in draft.named_parameters():
        param.requires_grad_(name.startswith("mtp.layers."))
    return draft


def after_training(before: dict[str, Any], after: dict[str, Any]) -> bool:
    """Keep the retrained layers only when they accept more on the held-out prompts."""
    return after["acceptance_length"] > before["acceptance_length"]


def mtp_table(mtp: dict[str, Any]) -> Table:
    k = mtp["num_speculative_tokens"]
    table = Table(
        title=f"MTP layers in the engine (K = {k}, greedy, {mtp['num_prompts']} prompts)", title_justify="left"
    )
    for column in ("target", "acceptance length", *(f"pos {i + 1}" for i in range(k)), "speed-up"):
        table.add_column(column, justify="left" if column == "target" else "right")
    rows = [
        ("BF16 source", mtp.get("bf16")),
        ("quantized artifact", mtp["artifact"]),
        ("artifact, MTP fine-tuned", mtp.get("retrained")),
    ]
    for name, row in rows:
        if row is not None:
            positions = (f"{p:.0%}" for p in row["per_position_acceptance"])
            table.add_row(name, f"{row['acceptance_length']:.2f}", *positions, f"{row['speedup']:.2f}x")
    if mtp.get("bf16") is None:
        table.caption = f"BF16 source not measured: {mtp.get('bf16_note')}"
    return table
