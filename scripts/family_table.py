"""Issue #38's per-family table: this year's families the engine serves with the mechanisms it has.

    .venv/bin/python scripts/family_table.py [--out runs/family-table.json]

Each family's tiny seeded checkpoint (`tests/tiny_models.py`, hidden 64, 2 layers, 8 experts,
top-2) is proven in the engine in bf16 (exact and fast numerics, 4 prompts), quantized to NVFP4
W4A4 with its shipped recipe (16 calibration samples of 128 tokens), its artifact proven by the
W4A4 rule, and its KL against the source measured on 2,048 held-out tokens. The KV cache per token
is the engine's layout (`kv_layout_for`) at the tiny shape and at the release's (transformers'
config defaults, which are the release's shapes), against plain multi-head attention of the same
heads and widths (K and V for every query head in every layer, bf16).
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import tiny_models

from onboard.adapt.measure import measure_parity
from onboard.engine import kv_layout_for
from onboard.evaluate.stage import eval_windows, measure_kl
from onboard.models import inspect_checkpoint, load_model, load_tokenizer
from onboard.quantize.stage import run_quantize
from onboard.recipes import Calibration, Eval, Quantize, recipe_for
from onboard.workspace import RunDir

# family -> (architecture, tiny builder, the release's config)
FAMILIES = {
    "glm4_moe_lite": (
        "Glm4MoeLiteForCausalLM",
        tiny_models.build_glm4_moe_lite,
        transformers.Glm4MoeLiteConfig,
    ),
    "minimax_m2": ("MiniMaxM2ForCausalLM", tiny_models.build_minimax_m2, transformers.MiniMaxM2Config),
    "gpt_oss": ("GptOssForCausalLM", tiny_models.build_gpt_oss, transformers.GptOssConfig),
}


def mha_bytes_per_token(config) -> int:
    """K and V of every query head in every layer, bf16: what plain MHA of the same widths caches."""
    heads = config.num_attention_heads
    if getattr(config, "kv_lora_rank", None):  # MLA: the expanded per-head keys and values
        width = heads * (config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim)
    else:
        width = 2 * heads * (getattr(config, "head_dim", None) or config.hidden_size // heads)
    return 2 * width * config.num_hidden_layers


def kv_row(config) -> dict:
    engine = kv_layout_for(config).bytes_per_token()
    mha = mha_bytes_per_token(config)
    return {"engine": engine, "mha": mha, "ratio": engine / mha}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("runs/family-table.json"))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family, (arch, build, release_config) in FAMILIES.items():
            source = build(Path(tmp) / family)
            plain = measure_parity(inspect_checkpoint(source), torch.bfloat16, num_prompts=4)
            recipe, _ = recipe_for([arch])
            calibration = Calibration(num_samples=16, max_seq_length=128).model_dump()
            settings = Quantize.model_validate({**recipe.quantize.model_dump(), "calibration": calibration})
            with RunDir(Path(tmp) / f"{family}-run") as run:
                run_quantize(run, inspect_checkpoint(source), settings, None)
                artifact = run.artifact
            proven = measure_parity(
                inspect_checkpoint(artifact), torch.bfloat16, num_prompts=4, source=inspect_checkpoint(source)
            )
            windows = eval_windows(load_tokenizer(inspect_checkpoint(source)), Eval(max_tokens=2048, window=256), None)
            kl = measure_kl(load_model(inspect_checkpoint(source)), load_model(inspect_checkpoint(artifact)), windows)
            stats = kl["all"].summary()
            config = transformers.AutoConfig.from_pretrained(source)
            release = release_config(architectures=[arch])
            rows.append(
                {
                    "family": family,
                    "architecture": arch,
                    "exact_max_abs_logit_diff": plain["max_abs_logit_diff"],
                    "exact_greedy_match_rate": plain["greedy_match_rate"],
                    "fast_logprobs_close": plain["fast"]["logprobs_close"],
                    "fast_greedy_match_rate": plain["fast"]["greedy_match_rate"],
                    "artifact_rule": proven["rule"],
                    "artifact_kl_ratio": proven["distribution"]["kl_ratio"],
                    "artifact_damage_diff": proven["distribution"]["damage_diff"],
                    "artifact_layerwise_passed": proven["layerwise"]["passed"],
                    "nvfp4_mean_kld": stats["mean_kld"],
                    "nvfp4_top1_agreement": stats["top1_agreement"],
                    "kv_tiny": kv_row(config),
                    "kv_release": kv_row(release),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2) + "\n")
    print("| family | exact: max \\|Δ logit\\|, greedy | fast: close, greedy | NVFP4 artifact: rule, KL ratio,"
          " damage, layerwise | NVFP4 mean KL, same top | KV per token, tiny: engine / MHA | release shape |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        tiny, rel = r["kv_tiny"], r["kv_release"]
        print(
            f"| {r['family']} | {r['exact_max_abs_logit_diff']:.4g}, {r['exact_greedy_match_rate']:.0%}"
            f" | {r['fast_logprobs_close']}, {r['fast_greedy_match_rate']:.0%}"
            f" | {r['artifact_rule']}, {r['artifact_kl_ratio']:.3g}, {r['artifact_damage_diff']:.3g},"
            f" {r['artifact_layerwise_passed']} | {r['nvfp4_mean_kld']:.3f}, {r['nvfp4_top1_agreement']:.1%}"
            f" | {tiny['engine']:,} / {tiny['mha']:,} B ({tiny['ratio']:.2f}x)"
            f" | {rel['engine']:,} / {rel['mha']:,} B ({rel['ratio']:.3f}x) |"
        )


if __name__ == "__main__":
    main()
