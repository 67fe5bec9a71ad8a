"""vLLM serving an onboard artifact's MTP layers (`method: mtp`) against onboard's engine.

    .venv/bin/python scripts/mtp_interop.py RUN_DIR [--scheme fp8]
    scripts/interop_serve.sh RUN_DIR/artifact 8031 --speculative-config '{"method": "mtp", "num_speculative_tokens": 1}'
    .venv/bin/onboard speculator RUN_DIR --endpoint http://127.0.0.1:8031 --served-model artifact
    scripts/interop_serve.sh stop 8031

Builds a tiny DeepSeek-V3 with an MTP layer in the shapes vLLM's CPU MLA kernels take (its
`kv_lora_rank + qk_rope_head_dim` one of 320/512/576, head dims a multiple of 32, and the
release's `topk_method: noaux_tc` router), trains that MTP layer on the model's own BF16 states
(`scripts/mtp_table.py`'s step, as a release ships it), quantizes it with the DeepSeek-V3 recipe and
measures the MTP acceptance on the held-out prompts in the engine (`speculator/metrics.json`
`mtp`, one epoch of `--draft mtp` fine-tuning after it). vLLM then serves the artifact with those
layers and `onboard speculator --endpoint` reads its acceptance on the same prompts.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import tiny_models
from mtp_table import SETTINGS, train_source_mtp

from onboard.models import inspect_checkpoint
from onboard.quantize.stage import run_quantize
from onboard.recipes import Calibration, Quantize, recipe_for
from onboard.speculator.stage import run_speculator
from onboard.workspace import SPECULATOR_METRICS, RunDir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--scheme", default="fp8")
    parser.add_argument("--residual-scale", type=float, default=0.3)
    args = parser.parse_args()
    source = args.run_dir.with_name(args.run_dir.name + "-source")
    tiny_models.build_mtp_model(source, "deepseek_v3", residual_scale=args.residual_scale, vllm_cpu_shapes=True)
    print(json.dumps(train_source_mtp(source, args.run_dir.with_name(args.run_dir.name + "-train"))))
    recipe, _ = recipe_for(["DeepseekV3ForCausalLM"])
    calibration = Calibration(num_samples=8).model_dump()
    data = {**recipe.quantize.model_dump(), "scheme": args.scheme, "calibration": calibration}
    # vLLM's CPU build has no FP8 or NVFP4 fused-MoE kernel ("Unsupported FP8 MoE backend: NONE"):
    # the routed experts stay BF16, everything else the recipe quantizes is quantized.
    data["ignore"] = [*data["ignore"], "re:.*mlp\\.experts\\..*"]
    settings = SETTINGS.model_copy(update={"epochs": 1})
    with RunDir(args.run_dir) as run:
        run_quantize(run, inspect_checkpoint(source), Quantize.model_validate(data), None)
        run_speculator(run, settings, None, numerics="exact")
    print(json.dumps(json.loads(RunDir(args.run_dir).path(SPECULATOR_METRICS).read_text())["mtp"], indent=1))


if __name__ == "__main__":
    main()
