"""Issue #25's table: the MTP layers of each MTP family on tiny seeded models (no network).

    .venv/bin/python scripts/mtp_table.py [--out runs/mtp-table.json]

Per family (DeepSeek-V3, DeepSeek-V3.2, GLM-5, Qwen3.5 and Qwen3.5-MoE with their `mtp.*` module,
and GLM-5.3-Flash with its residual next-N layer):

* proposal parity: the engine's MTP draft against transformers' `MtpModel` layer on the engine's
  states, on a model of the release's depth (61 or 78 layers), float32: max |delta logit| (Qwen's
  module and GLM-5.3-Flash's layer have no transformers model to compare with);
* lossless greedy: speculative (K = 2) against plain greedy tokens in the engine, float32;
* an MTP layer that knows its model: a tiny model whose main layers' outputs are scaled by
  `--residual-scale` (its greedy text mostly a fixed walk over tokens) gets its MTP layer trained
  on its own BF16 states first, with the stage's training loop, as a release's would be;
* that source quantized to NVFP4 (W4A4) with the family's recipe: the MTP tensors kept (bytes);
* `onboard speculator RUN --draft mtp`: the MTP acceptance on the BF16 source and on the artifact
  (the same held-out prompts), then after fine-tuning on the artifact's states.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import tiny_models
from safetensors.torch import load_file, save_file

from onboard.engine import EngineConfig, LLMEngine, SamplingParams
from onboard.models import inspect_checkpoint
from onboard.models.mtp import mtp_entries
from onboard.quantize.stage import run_quantize
from onboard.recipes import Calibration, Quantize, recipe_for
from onboard.speculator.capture import capture_shards
from onboard.speculator.data import generate_responses, training_prompts
from onboard.speculator.drafts import load_draft
from onboard.speculator.mtp_stage import engine_mtp, trainable
from onboard.speculator.stage import run_speculator
from onboard.speculator.train import TrainSettings, train_draft
from onboard.workspace import SELECTION, SPECULATOR_METRICS, RunDir

ARCHITECTURES = {
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM",
    "glm_moe_dsa": "GlmMoeDsaForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "glm5_next": "Glm5NextForConditionalGeneration",
}
# VLM releases whose MTP layers transformers 5.17 has no model of (Qwen's `mtp.*` module,
# GLM-5.3-Flash's residual next-N layer), so no proposal-parity reference.
VLM_BUILDERS = {
    "qwen3_5": tiny_models.build_qwen3_5,
    "qwen3_5_moe": tiny_models.build_qwen3_5_moe,
    "glm5_next": tiny_models.build_glm5_next,
}
OUTPUTS = ("self_attn.o_proj.weight", "linear_attn.out_proj.weight", "down_proj.weight")
ENGINE = EngineConfig(block_size=4, num_blocks=1024, max_model_len=512, enable_prefix_caching=False)
SETTINGS = tiny_models.mtp_speculator_settings(
    traffic="mixed", num_prompts=24, max_new_tokens=48, max_seq_len=192, eval_prompts=8, eval_max_tokens=48
)


def prompts(lengths: tuple[int, ...], seed: int = 7) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, tiny_models.VOCAB_SIZE, (n,), generator=gen).tolist() for n in lengths]


@torch.inference_mode()
def proposal_parity(arch: str, work: Path) -> dict:
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    from onboard.speculator.mtp_draft import load_mtp_draft, mtp_config

    path = tiny_models.build_mtp_model(work / f"release_{arch}", arch, release_depth=True)
    engine = LLMEngine(path, ENGINE, dtype=torch.float32)
    target = engine.target_tensors()
    draft = load_mtp_draft(path, target["embed_tokens"], target["lm_head"], torch.float32)
    main = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    main.config = mtp_config(main.config)
    reference = MtpModel.from_pretrained(main, device_map={"": "cpu"}).eval()
    (ids,) = prompts((64,))
    _, (states,) = engine.hidden_states(ids, [main.config.num_hidden_layers])
    length = len(ids) - 1
    tokens, positions = torch.tensor([ids[1:]]), torch.arange(1, len(ids))[None]
    embeds = reference.embed_tokens(tokens)
    layer = reference.layers[0]
    parts = [layer.enorm(embeds), layer.hnorm(states[None, :-1])]
    causal = torch.full((length, length), torch.finfo(torch.float32).min).triu(1)[None, None]
    out = layer.mtp_block(
        layer.eh_proj(torch.cat(parts, -1)),
        attention_mask=causal,
        position_embeddings=reference.rotary_emb(embeds, position_ids=positions),
        position_ids=positions,
    )
    out = out[0] if isinstance(out, tuple) else out
    want = reference._project_to_logits(layer.post_norm(out))[0].float()
    mask = torch.ones(length, length, dtype=torch.bool).tril()[None, None]
    got = draft.step(tokens, states[None, :-1], positions, mask, draft.new_cache()).logits[0]
    return {
        "main_layers": main.config.num_hidden_layers,
        "max_abs_logit_diff": float((got - want).abs().max()),
        "same_proposal": float((got.argmax(-1) == want.argmax(-1)).float().mean()),
        "positions": length,
    }


def lossless(path: Path) -> dict:
    engine = LLMEngine(path, ENGINE, dtype=torch.float32)
    work = prompts((30, 9, 17, 41))
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    want = [c.token_ids for c in engine.generate(work, params)]
    draft, _ = load_draft(Path("mtp"), path, engine)
    engine.set_speculator(draft, 2)
    got = [c.token_ids for c in engine.generate(work, params)]
    return {"prompts": len(work), "identical": sum(a == b for a, b in zip(got, want, strict=True))}


def vlm_source(arch: str, out: Path, residual_scale: float) -> Path:
    """A tiny VLM release (`VLM_BUILDERS`) whose main layers' output projections are scaled, as
    `build_mtp_model` scales DeepSeek's (its MTP layer's are not)."""
    path = VLM_BUILDERS[arch](out)
    mtp = set(mtp_entries(path))
    for shard in path.glob("*.safetensors"):
        weights = load_file(str(shard))
        scaled = [
            n for n in weights if n.startswith("model.language_model.layers.") and n.endswith(OUTPUTS) and n not in mtp
        ]
        if scaled:
            for name in scaled:
                weights[name] = (weights[name].float() * residual_scale).to(weights[name].dtype)
            save_file(weights, str(shard), {"format": "pt"})
    return path


def train_source_mtp(path: Path, work: Path) -> dict:
    """The source's MTP layer trained on its own BF16 states (what a release ships)."""
    engine = LLMEngine(path, ENGINE)
    records = None
    chosen = training_prompts(engine.tokenizer, "mixed", records, SETTINGS.num_prompts, SETTINGS.max_prompt_tokens)
    sequences = generate_responses(engine, chosen, SETTINGS.max_new_tokens, 2, 0.8)
    n = engine.hf_config.num_hidden_layers
    capture_shards(engine, sequences, [n], work / "data")
    draft = trainable(engine_mtp(engine, path))
    settings = TrainSettings(epochs=30, learning_rate=3e-3, batch_sequences=4, max_seq_len=192, ttt_steps=2)
    history = train_draft(draft, work / "data", engine.target_tensors()["lm_head"], settings, work / "checkpoint")
    state = draft.checkpoint_state()  # the checkpoint's names, whichever shard holds them
    for shard in path.glob("*.safetensors"):
        weights = load_file(str(shard))
        if any(key in weights for key in state):
            for key, value in state.items():
                if key in weights:
                    weights[key] = value.to(weights[key].dtype).contiguous()
            save_file(weights, str(shard), {"format": "pt"})
    return {"loss_first_epoch": history[0]["loss"], "loss_last_epoch": history[-1]["loss"]}


def family(arch: str, work: Path, residual_scale: float) -> dict:
    started = time.perf_counter()
    if arch in VLM_BUILDERS:
        row: dict = {"arch": arch, "parity": None}
        source = vlm_source(arch, work / f"source_{arch}", residual_scale)
    else:
        row = {"arch": arch, "parity": proposal_parity(arch, work)}
        source = tiny_models.build_mtp_model(work / f"source_{arch}", arch, residual_scale=residual_scale)
    row["lossless"] = lossless(source)
    row["source_training"] = train_source_mtp(source, work / f"train_{arch}")
    recipe, _ = recipe_for([ARCHITECTURES[arch]])
    data = {**recipe.quantize.model_dump(), "scheme": "nvfp4", "calibration": Calibration(num_samples=8).model_dump()}
    root = work / f"run_{arch}"
    with RunDir(root) as run:
        run_quantize(run, inspect_checkpoint(source), Quantize.model_validate(data), None)
        run_speculator(run, SETTINGS, None, numerics="exact")
    row["kept"] = json.loads(run.path(SELECTION).read_text())["mtp"]
    row["mtp"] = json.loads(run.path(SPECULATOR_METRICS).read_text())["mtp"]
    row["seconds"] = round(time.perf_counter() - started, 1)
    return row


def parity(result: dict | None) -> str:
    if result is None:
        return "no reference (transformers has no model of it)"
    return f"{result['max_abs_logit_diff']:.2g} ({result['same_proposal']:.0%} same)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/mtp-table.json"))
    parser.add_argument("--residual-scale", type=float, default=0.3)
    parser.add_argument("--arch", action="append", choices=sorted(ARCHITECTURES))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="mtp-table-") as tmp:
        for arch in args.arch or list(ARCHITECTURES):
            rows.append(family(arch, Path(tmp), args.residual_scale))
            print(json.dumps(rows[-1], indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"residual_scale": args.residual_scale, "rows": rows}, indent=2) + "\n")
    print(
        "| family | MTP tensors kept | proposal parity (max abs logit diff) | lossless greedy | "
        "acceptance BF16 | acceptance NVFP4 | after fine-tuning |"
    )
    for r in rows:
        m = r["mtp"]
        print(
            f"| {r['arch']} | {r['kept']['tensors']} ({r['kept']['bytes']:,} B) | "
            f"{parity(r['parity'])} | "
            f"{r['lossless']['identical']}/{r['lossless']['prompts']} | {m['bf16']['acceptance_length']:.2f} | "
            f"{m['artifact']['acceptance_length']:.2f} | {m['retrained']['acceptance_length']:.2f} |"
        )


if __name__ == "__main__":
    main()
