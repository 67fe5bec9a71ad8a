"""Resident memory while eval's KL loop scores windows, with and without returning freed memory to
the system after each window (docs/benchmarks.md, 0.8.0: where eval's memory went).

    .venv/bin/python scripts/eval_memory_probe.py RUN_DIR TOKENS [keep|trim] [artifact|reference]

`keep` does not trim (eval before 0.8.0), `trim` calls `onboard.memory.release_freed_memory` as eval
does now; `reference` scores the reference against itself (no compressed-tensors at all).
"""

import sys
import time
from pathlib import Path

import psutil
import torch

from onboard.evaluate.kl import KLStats
from onboard.evaluate.logits import logit_chunks
from onboard.evaluate.stage import eval_windows
from onboard.memory import release_freed_memory
from onboard.models import inspect_checkpoint, load_model, load_tokenizer
from onboard.recipes import Eval
from onboard.workspace import RunDir

DATA = Path(__file__).resolve().parents[2] / "shared/data/gsm8k_train.jsonl"


def main(run: Path, tokens: int, mode: str, candidate: str) -> None:
    rss = lambda: psutil.Process().memory_info().rss / 2**30  # noqa: E731
    artifact = inspect_checkpoint(RunDir(run).artifact)
    windows = eval_windows(load_tokenizer(artifact), Eval(max_tokens=tokens), DATA)
    reference = load_model(inspect_checkpoint(RunDir(run).source))
    other = reference if candidate == "reference" else load_model(artifact)
    stats, start = KLStats(), time.time()
    for i, (_, window) in enumerate(windows):
        ids = torch.tensor([window])
        row = 0
        chunks = zip(logit_chunks(reference, ids[:, :-1], 128), logit_chunks(other, ids[:, :-1], 128), strict=True)
        for ref, cand in chunks:
            stats.update(ref, cand, ids[0, 1 + row : 1 + row + len(ref)])
            row += len(ref)
        if mode == "trim":
            release_freed_memory()
        print(f"window {i + 1}/{len(windows)}: {rss():.2f} GiB resident, {time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(Path(args[0]), int(args[1]), args[2] if len(args) > 2 else "keep", args[3] if len(args) > 3 else "artifact")
