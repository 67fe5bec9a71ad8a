"""The memory budget: what each stage would hold in memory, streamed or not, and which path fits.

A stage's peak is estimated before anything loads, from the checkpoint's safetensors headers (the
bytes of every tensor, so of every decoder layer, the embeddings and the head) and its config
(hidden size, vocabulary), plus the tokens the stage works on.  The in-memory path holds whole
models; the streamed path holds the embeddings, the head and a few decoder layers, plus the
hidden states of its tokens.  `plan_stage` picks in-memory where it fits, else streamed, else an
endpoint the user gave, else refuses in one line before anything is written.
"""

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import psutil

from onboard.errors import OnboardError

# The default budget: this share of the machine's memory (or of the cgroup's limit, if lower).
DEFAULT_FRACTION = 0.8
# Held by the process before any model: torch, transformers and llmcompressor imported, measured
# here as the resident size of `onboard quantize` just before it loads the model.
BASELINE_BYTES = 900 * 2**20
LOGIT_CHUNK = 128  # positions per float32 logit block (evaluate/stage.py's CHUNK)

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*$", re.IGNORECASE)
_LAYER = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.")  # a text model's, or a VLM's
# Stages that must generate (a whole model resident, a KV cache), so over budget need endpoints.
GENERATING = ("smoke", "bench")
STREAMED_HOLDS = {
    "quantize": "one layer calibrating, its activations",
    "eval": "one layer per model, the tokens' states",
    "adapt": "one layer per side, the prompts' states",
    "speculator": "one layer, the captured states",
    "selection": "one module of one format, the reference's log-probabilities",
}


def parse_size(text: str) -> int:
    """`6GB`, `6G` (10**9), `6GiB` (2**30), `500MB`, or plain bytes."""
    match = _SIZE.match(str(text))
    if not match:
        raise OnboardError(f"--max-memory {text!r} is not a size (e.g. 6GB, 6GiB, 500MB)")
    number, unit = match.groups()
    return int(float(number) * _UNITS[(unit or "").lower()])


def human(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(size) < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError


def _cgroup_limit() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            value = Path(path).read_text().strip()
        except OSError:
            continue
        if value.isdigit() and int(value) < 2**60:
            return int(value)
    return None


def machine_memory() -> int:
    """Physical memory, or this process's cgroup limit where that is lower."""
    total = psutil.virtual_memory().total
    limit = _cgroup_limit()
    return min(total, limit) if limit else total


def resolve_budget(max_memory: str | int | None) -> int:
    """`--max-memory` in bytes; by default DEFAULT_FRACTION of the machine's memory."""
    if max_memory is None:
        return int(DEFAULT_FRACTION * machine_memory())
    budget = parse_size(max_memory) if isinstance(max_memory, str) else int(max_memory)
    if budget <= 0:
        raise OnboardError("--max-memory must be positive")
    return budget


@dataclass(frozen=True)
class ModelShape:
    """Byte counts of a checkpoint's parts, as stored, and the sizes the activations scale with."""

    total_bytes: int
    layer_bytes: tuple[int, ...]  # per decoder layer
    other_bytes: int  # embeddings, final norm, head, anything outside the decoder layers
    hidden_size: int
    vocab_size: int
    intermediate_size: int = 0  # the dense MLP's (0: not in the config)
    largest_file: int = 0  # the largest safetensors shard: what a reader may hold mapped at once

    @property
    def largest_layer(self) -> int:
        return max(self.layer_bytes, default=0)

    @property
    def num_layers(self) -> int:
        return len(self.layer_bytes)


def _header(file: Path) -> dict:
    with open(file, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        return json.loads(handle.read(length))


def model_shape(path: Path) -> ModelShape:
    """From the safetensors headers and config.json alone: nothing is loaded."""
    config = json.loads((Path(path) / "config.json").read_text())
    text = config.get("text_config") or config
    layers: dict[int, int] = {}
    other = largest = 0
    for file in sorted(Path(path).glob("*.safetensors")):
        largest = max(largest, file.stat().st_size)
        for name, entry in _header(file).items():
            if name == "__metadata__":
                continue
            size = entry["data_offsets"][1] - entry["data_offsets"][0]
            match = _LAYER.match(name)
            if match:
                layers[int(match.group(1))] = layers.get(int(match.group(1)), 0) + size
            else:
                other += size
    count = int(text.get("num_hidden_layers", len(layers)))
    # Layers stored beyond num_hidden_layers (DeepSeek's MTP layer) are not run by the stages.
    per_layer = tuple(layers.get(i, 0) for i in range(count))
    return ModelShape(
        total_bytes=sum(per_layer) + other,
        layer_bytes=per_layer,
        other_bytes=other,
        hidden_size=int(text.get("hidden_size", 0)),
        vocab_size=int(text.get("vocab_size", 0)),
        intermediate_size=int(text.get("intermediate_size") or 0),
        largest_file=largest,
    )


@dataclass(frozen=True)
class StagePlan:
    stage: str
    in_memory: int  # estimated peak bytes, whole models resident
    streamed: int | None  # estimated peak bytes streamed one layer at a time; None: no such path
    path: str  # "in-memory" | "streamed" | "endpoint" | "transformers" | "skipped" (`stage.skipped`)
    bound: str  # what the chosen path's peak is made of

    def row(self) -> list[str]:
        if self.path == "skipped":
            return [self.stage, "—", "—", self.path, self.bound]
        streamed = "—" if self.streamed is None else human(self.streamed)
        return [self.stage, human(self.in_memory), streamed, self.path, self.bound]


def _logits(shape: ModelShape) -> int:
    # two sides' float32 logit blocks and their log-softmax copies
    return 4 * LOGIT_CHUNK * shape.vocab_size * 4


def estimate(stage: str, shape: ModelShape, tokens: int, reference: ModelShape | None = None) -> tuple[int, int | None]:
    """(in-memory peak, streamed peak or None) in bytes for `stage` over `tokens` tokens.

    `reference`: the unquantized model a stage compares against (eval), when it is another one."""
    ref = reference or shape
    states = tokens * shape.hidden_size * 2  # one bf16 hidden state per token
    base = BASELINE_BYTES
    if stage == "quantize":
        # llmcompressor holds the model plus one layer's calibration activations (fp32 inputs and
        # outputs of the layer being calibrated, and its quantized copy).
        activations = 4 * states * 2
        return (
            base + shape.total_bytes + 2 * shape.largest_layer + activations,
            base + shape.other_bytes + 3 * shape.largest_layer + activations,
        )
    if stage == "eval":
        both = base + _logits(shape) + 2 * states
        return (
            both + ref.total_bytes + shape.total_bytes,
            both + ref.other_bytes + shape.other_bytes + 2 * max(ref.largest_layer, shape.largest_layer),
        )
    if stage == "adapt":  # transformers' model and the engine's
        return (
            base + 2 * shape.total_bytes + 2 * states + _logits(shape),
            base + 2 * shape.other_bytes + 3 * shape.largest_layer + 2 * states + _logits(shape),
        )
    if stage == "speculator":
        # The captured data: three aux layers' states and the final state per token, and the
        # running state while capturing (the draft's training: `draft_training`).
        return (
            base + shape.total_bytes + 5 * states + _logits(shape),
            base + shape.other_bytes + 2 * shape.largest_layer + 5 * states + _logits(shape),
        )
    if stage == "selection":
        # The reference's log-probabilities on the search tokens (float32 over the vocabulary) and
        # its decoder layers' inputs, twice (the reference's and the best candidate's), beside a
        # model per format (BF16, FP8, NVFP4) and the Fisher estimate's float32 squared gradients
        # and gradients in memory, or one module of one of them streamed (no Fisher estimate).
        replay = tokens * shape.vocab_size * 4 + 2 * shape.num_layers * states + _logits(shape)
        return base + 6 * shape.total_bytes + replay, base + shape.other_bytes + 2 * shape.largest_layer + replay
    if stage in GENERATING:
        return base + 2 * shape.total_bytes + _logits(shape), None
    raise ValueError(stage)


def draft_training(shape: ModelShape, batch_tokens: int, steps: int, draft_vocab: int) -> int:
    """The EAGLE-3 draft's training, beside the data it trains on: the float32 frozen embedding table
    and head (the draft's and the loss's copy), the trainable `fc` (3 states in, H out) and decoder
    layer (attention reading 2H, the target's MLP width) with AdamW's gradient and two moments per
    weight, and each training-time-test step's activations over one batch (the layer's widths, the
    draft vocabulary's logits, their log-softmax and gradients, as autograd keeps them).  The
    coefficients are the scale run's: on the 16 GB checkpoint (H 2048, MLP 6144, 2.2k tokens of
    data) 4x512-token batches were killed at a 6 GB cap (planned here 7.0 GB) and 1x256 ran (4.1 GB)."""
    hidden, width = shape.hidden_size, shape.intermediate_size or 4 * shape.hidden_size
    frozen = 4 * (shape.vocab_size + 2 * draft_vocab) * hidden
    trainable = 3 * hidden * hidden + 7 * hidden * hidden + 3 * hidden * width
    activations = 4 * batch_tokens * steps * (24 * hidden + 6 * width + 6 * draft_vocab)
    return frozen + 16 * trainable + activations


def plan_stage(
    stage: str,
    shape: ModelShape,
    budget: int,
    tokens: int,
    *,
    reference: ModelShape | None = None,
    endpoint: bool = False,
    options: str = "",
    peaks: tuple[int, int | None] | None = None,
) -> StagePlan:
    """The path `stage` takes under `budget`, or a one-line refusal (naming `options`, the flags
    that would let it run through a deployment) when none fits.  `peaks`: (in memory, streamed)
    where the stage runs several estimated parts (quantize's selection, then its calibration)."""
    in_memory, streamed = peaks or estimate(stage, shape, tokens, reference)
    if in_memory <= budget:
        return StagePlan(stage, in_memory, streamed, "in-memory", "whole model resident")
    if streamed is not None and streamed <= budget:
        return StagePlan(stage, in_memory, streamed, "streamed", STREAMED_HOLDS.get(stage, "one decoder layer"))
    if endpoint:
        return StagePlan(stage, in_memory, streamed, "endpoint", "the deployment")
    need = human(in_memory if streamed is None else streamed)
    path = "streamed" if streamed is not None else "in memory"
    how = f"; run it against a deployment with {options}" if options else ""
    raise OnboardError(f"{stage} needs about {need} {path}, over the {human(budget)} budget (--max-memory){how}")


def plan_table(plans: list[StagePlan], budget: int, shape: ModelShape | None = None):
    """The plans, and under them what the page cache needs beside the budget: a container's limit
    counts it (`pagecache.py` writes back and drops what the stages write and read as they go)."""
    from rich.table import Table

    from onboard.pagecache import INTERVAL

    caption = None
    if shape is not None and shape.largest_file:
        caption = (
            f"page cache besides: up to {human(shape.largest_file)} mapped while a checkpoint shard is read, "
            f"and what a stage writes in {INTERVAL:g} s (written back as it goes); "
            "leave that above --max-memory under a container's memory limit"
        )
    table = Table(title=f"memory plan (budget {human(budget)})", title_justify="left", caption=caption)
    for column in ("stage", "in memory", "streamed", "path", "peak held"):
        table.add_column(column, justify="right" if column in ("in memory", "streamed") else "left")
    for plan in plans:
        table.add_row(*plan.row())
    return table
