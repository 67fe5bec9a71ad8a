"""The adapt parity table of issue #13: every DeepSeek-style family x format on tiny seeded models.

    .venv/bin/python scripts/parity_table.py [--out runs/parity-table.json]

Builds the tiny checkpoints of `tests/tiny_models.py`, quantizes each with its shipped recipe
(NVFP4, NVFP4A16, FP8, and a mixed artifact: attention FP8, MLPs and experts NVFP4) through the
quantize stage, and runs `onboard adapt`'s whole-model parity (16 prompts, 64-token greedy
continuations, teacher-forced logits, DSA index sets) on each; plain checkpoints in fp32 and bf16.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import tiny_models

from onboard.adapt.measure import measure_parity
from onboard.models import inspect_checkpoint
from onboard.quantize.stage import run_quantize
from onboard.recipes import Calibration, Quantize, recipe_for
from onboard.workspace import RunDir

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM",
    "glm_moe_dsa": "GlmMoeDsaForCausalLM",
}
FORMATS = ("nvfp4", "nvfp4a16", "fp8", "mixed")
MIXED = {"fp8": ["re:.*self_attn\\..*"]}


def settings(arch: str, fmt: str) -> Quantize:
    recipe, _ = recipe_for([ARCHITECTURES[arch]])
    data = {**recipe.quantize.model_dump(), "calibration": Calibration(num_samples=4, max_seq_length=128).model_dump()}
    data.update(scheme="nvfp4", formats=MIXED) if fmt == "mixed" else data.update(scheme=fmt)
    return Quantize.model_validate(data)


def row(arch: str, fmt: str, dtype: str, result: dict) -> dict:
    sets = result.get("index_sets")
    fast = result.get("fast")
    return {
        "family": arch,
        "format": fmt,
        "dtype": dtype,
        "max_abs_logit_diff": result["max_abs_logit_diff"],
        "top1_agreement": result["top1_agreement"],
        "greedy_match_rate": result["greedy_match_rate"],
        "logprobs_close": result["logprobs_close"],
        "index_sets_equal": None if sets is None else sets["equal_rate"],
        "fast_greedy_match_rate": None if fast is None else fast["greedy_match_rate"],
        "fast_logprobs_close": None if fast is None else fast["logprobs_close"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("runs/parity-table.json"))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ARCHITECTURES:
            source = tiny_models.build_model(Path(tmp) / arch, arch)
            for dtype in (torch.float32, torch.bfloat16):
                name = str(dtype).removeprefix("torch.")
                rows.append(row(arch, "plain", name, measure_parity(inspect_checkpoint(source), dtype)))
            for fmt in FORMATS:
                with RunDir(Path(tmp) / f"{arch}-{fmt}") as run:
                    run_quantize(run, inspect_checkpoint(source), settings(arch, fmt), None)
                    result = measure_parity(inspect_checkpoint(run.artifact), torch.bfloat16)
                rows.append(row(arch, fmt, "bfloat16", result))
                print(json.dumps(rows[-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2) + "\n")
    columns = ["family", "format", "dtype", "max abs dlogit", "top-1", "greedy identical", "logprobs_close"]
    columns += ["DSA index sets", "fast greedy", "fast close"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for r in rows:
        fmt = lambda v: "-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))  # noqa: E731
        cells = [r["family"], r["format"], r["dtype"], fmt(r["max_abs_logit_diff"]), fmt(r["top1_agreement"])]
        cells += [fmt(r["greedy_match_rate"]), str(r["logprobs_close"]), fmt(r["index_sets_equal"])]
        cells += [fmt(r["fast_greedy_match_rate"]), fmt(r["fast_logprobs_close"])]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
