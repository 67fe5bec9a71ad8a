"""The eval of a model larger than memory, in two passes (llama.cpp's `--kl-divergence-base` shape).

Pass 1 runs the reference one decoder layer at a time over the eval windows and keeps its final
hidden states (before the norm: [tokens x hidden], far smaller than logits [tokens x vocab]) in
a cache keyed by the reference's fingerprint, the windows' tokens and what decides their bits
(dtype, torch, the CPU kernels).  Pass 2 streams the artifact the same way; each side's norm and
head then turn its states into logits a chunk of positions at a time, and the statistics are
those of `measure_kl` on the same positions in the same chunks, so they equal the in-memory eval.

The per-layer contributions come from one more streamed pass that holds layer i of both models:
"layer i alone" streams (reference input, artifact layer i, reference layers after it) and
"layers up to i" streams (artifact layers 0..i, reference after) advance together, so every
layer is read once while `per_layer_kl`'s numbers come out.
"""

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save

from onboard import atomic
from onboard.console import console
from onboard.evaluate.kl import KLStats, token_kl
from onboard.hashing import fingerprint, hash_json
from onboard.models.streamed import State, StreamedModel
from onboard.paths import cache_dir

CHUNK = 128  # evaluate.stage.CHUNK: the same chunks give the same float32 logits
REPLAY_CHUNK = 256  # evaluate.replay.CHUNK


def _window_ids(windows: list[tuple[str, list[int]]]) -> list[torch.Tensor]:
    return [torch.tensor([window[:-1]]) for _, window in windows]


def states_key(reference: Path, windows: list[tuple[str, list[int]]], dtype: torch.dtype) -> str:
    tokens = hashlib.sha256(json.dumps([w for _, w in windows]).encode()).hexdigest()
    return hash_json(
        {
            "reference": fingerprint(reference),
            "tokens": tokens,
            "dtype": str(dtype),
            "torch": torch.__version__,
            "cpu": torch.backends.cpu.get_cpu_capability(),
            "onednn_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
        }
    )


def reference_states(
    reference: Path, windows: list[tuple[str, list[int]]], dtype: torch.dtype = torch.bfloat16
) -> tuple[list[torch.Tensor], bool]:
    """Pass 1: the reference's final hidden states per window, and whether they came from the cache."""
    path = cache_dir() / "reference_states" / f"{states_key(reference, windows, dtype)}.safetensors"
    if path.is_file():
        stored = load_file(path)
        return [stored[f"window.{i}"] for i in range(len(windows))], True
    hidden = StreamedModel(reference, dtype).final_hidden(_window_ids(windows), "reference states (pass 1)")
    states = [h[0].contiguous() for h in hidden]
    atomic.write_bytes(path, save({f"window.{i}": s for i, s in enumerate(states)}))
    return states, False


def streamed_kl(reference: Path, artifact: Path, windows: list[tuple[str, list[int]]]) -> dict[str, KLStats]:
    """`measure_kl`'s statistics (overall under "all", and per traffic type), streamed."""
    ref_states, cached = reference_states(reference, windows)
    console.print(f"reference states: {'reused from the cache' if cached else 'computed and cached'}")
    ref_model, art_model = StreamedModel(reference), StreamedModel(artifact)
    art_states = [h[0] for h in art_model.final_hidden(_window_ids(windows), "artifact states (pass 2)")]
    ref_norm, art_norm = ref_model.norm(), art_model.norm()
    ref_head, art_head = ref_model.head().float(), art_model.head().float()
    stats: dict[str, KLStats] = {"all": KLStats()}
    with torch.inference_mode():
        for (traffic, window), ref_hidden, art_hidden in zip(windows, ref_states, art_states, strict=True):
            targets = torch.tensor(window[1:])
            chunks = zip(
                ref_model.logit_chunks(ref_norm(ref_hidden[None])[0], CHUNK, ref_head),
                art_model.logit_chunks(art_norm(art_hidden[None])[0], CHUNK, art_head),
                strict=True,
            )
            start = 0
            for ref_chunk, art_chunk in chunks:
                chunk_targets = targets[start : start + len(ref_chunk)]
                for key in ("all", traffic):
                    stats.setdefault(key, KLStats()).update(ref_chunk, art_chunk, chunk_targets)
                start += len(ref_chunk)
    return stats


@torch.inference_mode()
def streamed_per_layer_kl(
    reference: Path, artifact: Path, input_ids: torch.Tensor, formats: dict[int, dict[str, int]]
) -> dict[str, Any]:
    """`per_layer_kl`'s result, with one layer of each model resident at a time."""
    ref_model, art_model = StreamedModel(reference), StreamedModel(artifact)
    count = ref_model.num_layers
    ref_stream: State = ref_model.embed(input_ids)
    art_stream = ref_stream
    alone: dict[int, State] = {}  # artifact layer i on the reference's input, reference after
    running: dict[int, State] = {}  # artifact layers 0..i, reference after
    for index in ref_model.indices("per-layer KL"):
        ref_layer, art_layer = ref_model.layer(index), art_model.layer(index)
        for streams in (alone, running):
            for i in streams:
                streams[i] = ref_model.run(ref_layer, streams[i])
        alone[index] = ref_model.run(art_layer, ref_stream)
        art_stream = ref_model.run(art_layer, art_stream)
        running[index] = art_stream
        ref_stream = ref_model.run(ref_layer, ref_stream)
        del art_layer, ref_layer
    norm, head = ref_model.norm(), ref_model.head().float()

    def logits(state: State):
        hidden = norm(state[0])
        return ref_model.logit_chunks(hidden.reshape(-1, hidden.shape[-1]), REPLAY_CHUNK, head)

    reference_logp = torch.cat([torch.log_softmax(chunk, dim=-1) for chunk in logits(ref_stream)])

    def mean_kl(state: State) -> float:
        out = []
        for index, chunk in enumerate(logits(state)):
            part = reference_logp[index * REPLAY_CHUNK : index * REPLAY_CHUNK + len(chunk)]
            out.append(token_kl(part, chunk).double())
        return float(torch.cat(out).mean())

    return {
        "tokens": input_ids.numel(),
        "full_kld": mean_kl(running[count - 1]),
        "layers": [
            {
                "layer": i,
                "formats": formats.get(i, {}),
                "alone_kld": mean_kl(alone[i]),
                "running_kld": mean_kl(running[i]),
            }
            for i in range(count)
        ],
    }
