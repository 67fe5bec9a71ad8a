"""A GPU check for a lent device: the reference engine on a random-weight model of a real size.

No network and no weights travel: a Llama-3-8B-shaped model (hidden 4096, 32 layers, GQA 32/8,
vocabulary 128256, rope theta 500000, bf16) is built with random weights directly on the device,
saved as a checkpoint the engine loads, and then measured against transformers on the same weights:

* throughput: the engine (fast numerics) against `transformers.generate` (greedy, 64 new tokens,
  EOS never stops either side) at concurrency 1, 16 and 64 on random prompts of 128 tokens;
* parity in float32 and bfloat16: the engine in exact numerics against transformers on ONE copy
  of each prompt (batch 1, as `onboard adapt` compares: exact numerics call transformers' own ops
  with the same shapes for a request alone): teacher-forced logits (max |Δ logit|, top-1
  agreement) and greedy continuations, one prompt at a time; `rule` per dtype is `bitwise` (every
  logit and greedy token identical) or else `near_tie`;
* quantized artifacts: the random model through onboard's own quantize stage (`run_quantize`, a
  run directory under the temporary directory; calibration on random ids of the check's own
  vocabulary, 4 samples x 128 tokens), then, on the same prompts, in bf16:
  - FP8 W8A8: the exact engine against transformers on the artifact, rule `bitwise` or
    `near_tie`, passing under the Gate's token thresholds (max |Δ logit|, top-1 agreement,
    divergences only at near-ties);
  - NVFP4 W4A4: the same figures for information, judged by the `layerwise_distribution` rule:
    KL(transformers‖engine) / KL(source‖transformers) and the damage difference, the worse of
    exact and fast numerics (the source: the bf16 random model), and every layer and linear
    against its floor (`measure_layerwise`), under the Gate's defaults;
* speculative decoding's exactness: a random-weight EAGLE-3 draft (`engine.set_speculator(draft, 3)`)
  must leave greedy outputs exactly as plain greedy decoding gives them (exact numerics: token for
  token; fast numerics: the match rate is reported); the acceptance length is reported too (about
  1 with a random draft: this is an exactness check, not a speed one).

* NVFP4 scale distillation (`quantize --distill-tokens`, `--distill-tokens` calibration tokens):
  it runs on the device, kept scales do not raise the calibration KL and change some scales, and
  the artifact stays NVFP4 (chosen with `--phases`, not run by default).

Phases run in the order that puts the pass criteria first (the build, bf16 parity, exact spec
decoding, fp32 parity, the FP8 and NVFP4 artifacts, then throughput, fast spec decoding and
distillation); each
has a time budget, prints its elapsed time, and a phase that would end past `--deadline` is
skipped.  The JSON report (`--out`) is rewritten after every phase, so a run cut short still
leaves what it measured.  Each artifact, its models and engines are freed after its phase.

Exit status 0 when fp32 exact parity has top-1 agreement >= 0.99 and speculative decoding in
exact numerics reproduces plain greedy decoding token for token, and, for those of these phases
that ran, bf16 exact parity is `bitwise`, the FP8 artifact passes the near-tie rule and the NVFP4
artifact the layerwise-distribution rule; 1 otherwise (one-line reason).  A conditional phase
skipped (deadline, --phases) is listed as not checked, not failed; one that failed is a failure.

    scripts/gpu_check.sh                                   # llama3-8b shape on cuda (< 9 min on one H200)
    scripts/gpu_check.sh --shape tiny --device cpu         # the same code on the CPU (< 1 min)

The parts live in scripts/gpu_checks/ (settings, the random model, each phase family, the report);
this file is the entry point: its flags and `main`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without the package installed
    sys.path.insert(0, str(ROOT))
# The parts (scripts/gpu_checks/), found both as `python scripts/gpu_check.py` finds them and when
# this file is loaded by its path (tests/test_gpu_check.py).
HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from gpu_checks.check import GpuCheck  # noqa: E402 (after the path above)
from gpu_checks.settings import DEFAULT_PHASES, PHASES, SHAPES, Settings  # noqa: E402

__all__ = ["DEFAULT_PHASES", "PHASES", "SHAPES", "GpuCheck", "Settings", "main", "parse_args"]


WORKLOAD = (
    "prompt_tokens",
    "new_tokens",
    "parity_prompts",
    "parity_tokens",
    "spec_prompts",
    "spec_tokens",
    "spec_k",
    "calib_samples",
    "distill_tokens",
    "calib_tokens",
)


def parse_args(argv: list[str] | None = None) -> Settings:
    defaults = Settings()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default=defaults.shape)
    parser.add_argument("--device", default=None, help="torch device (default: cuda, or cpu for --shape tiny)")
    parser.add_argument("--out", type=Path, default=defaults.out, help="JSON report (default: %(default)s)")
    parser.add_argument("--workdir", type=Path, default=None, help="where the temporary checkpoint goes")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint directory")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    for name in WORKLOAD:
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=int, default=None, help=f"default {getattr(defaults, name)}"
        )
    parser.add_argument(
        "--concurrency",
        type=lambda v: [int(x) for x in v.split(",")],
        default=defaults.concurrency,
        help="e.g. 1,16,64",
    )
    parser.add_argument("--deadline", type=float, default=defaults.deadline, help="seconds (default: %(default)s)")
    parser.add_argument(
        "--phases",
        type=lambda v: [p.strip() for p in v.split(",") if p.strip()],
        default=list(DEFAULT_PHASES),
        help=f"comma-separated subset of {','.join(PHASES)} (build always runs; default: all but distill)",
    )
    args = parser.parse_args(argv)
    unknown = set(args.phases) - set(PHASES)
    if unknown:
        parser.error(f"unknown phases: {', '.join(sorted(unknown))}")
    device = args.device or ("cpu" if args.shape == "tiny" else "cuda")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {device}: CUDA is not available in torch {torch.__version__}")
    shape = SHAPES[args.shape]
    workload = {
        name: getattr(args, name)
        if getattr(args, name) is not None
        else shape.workload.get(name, getattr(defaults, name))
        for name in WORKLOAD
    }
    return Settings(
        shape=args.shape,
        device=device,
        out=args.out,
        workdir=args.workdir,
        keep=args.keep,
        seed=args.seed,
        concurrency=args.concurrency,
        deadline=args.deadline,
        phases=sorted({"build", *args.phases}, key=PHASES.index),
        **workload,
    )


def main(argv: list[str] | None = None) -> int:
    return GpuCheck(parse_args(argv)).run()


if __name__ == "__main__":
    # `timeout` sends SIGTERM first: unwind, so the checkpoint (maybe in /dev/shm) is removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())
