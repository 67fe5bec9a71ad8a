"""How `--scheme auto`'s selection time grows with the number of decoder layers, in memory and streamed.

    python scripts/selection_scaling.py --tokenizer DEMO_CHECKPOINT --layers 4 8 16 [--out scaling.md]

Random-weight checkpoints of the demo model's shape (SmolLM2-135M: hidden 576, 9 heads, 3 KV
heads, MLP 1536) at each depth, each quantized with `scheme: auto` at 5.5 bits through
`run_quantize`, once in memory and once streamed (a budget between the two estimates), on the same
calibration and search tokens.  The table is each phase's seconds from `selection.json`: the
formats' copies, the sensitivities (one run per group and format, from the group's layer to the
last) and the measured search (each candidate from its first changed layer on).
"""

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch

from onboard.budget import estimate, model_shape
from onboard.models import inspect_checkpoint
from onboard.quantize.stage import run_quantize
from onboard.recipes import Calibration, Quantize, Search
from onboard.workspace import SELECTION, RunDir

SETTINGS = Quantize(
    scheme="auto",
    bits_budget=5.5,
    calibration=Calibration(num_samples=16, max_seq_length=256),
    search=Search(tokens=512, steps=8),
)


def checkpoint(root: Path, tokenizer: Path, layers: int) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tokenizer)
    config.num_hidden_layers = layers
    torch.manual_seed(layers)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    out = root / f"layers{layers}"
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer / name).exists():
            shutil.copy(tokenizer / name, out / name)
    return out


def streaming_budget(path: Path) -> int:
    shape, calibration = model_shape(path), SETTINGS.calibration
    selection = estimate("selection", shape, SETTINGS.search.tokens)
    quantize = estimate("quantize", shape, calibration.num_samples * calibration.max_seq_length)
    return (max(selection[1], quantize[1]) + max(selection[0], quantize[0])) // 2


def selected(path: Path, root: Path, max_memory: int | None) -> dict:
    with RunDir(root) as run:
        run_quantize(run, inspect_checkpoint(path), SETTINGS, None, max_memory)
    return json.loads(run.path(SELECTION).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--out", type=Path, default=Path("selection_scaling.md"))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        for layers in args.layers:
            path = checkpoint(root, args.tokenizer, layers)
            memory = selected(path, root / f"mem{layers}", None)
            streamed = selected(path, root / f"streamed{layers}", streaming_budget(path))
            same = memory["groups"] == streamed["groups"] and memory["search"] == streamed["search"]
            row = [layers, len(memory["groups"])]
            for phase in ("sources", "sensitivity", "search"):
                row += [memory["seconds"][phase], streamed["seconds"][phase]]
            rows.append([*row, "yes" if same else "NO"])
    header = "| layers | groups | copies (s) in memory | streamed | sensitivity (s) in memory | streamed |"
    header += " search (s) in memory | streamed | same selection |"
    lines = [header, "|" + "---|" * 9]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in rows]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
