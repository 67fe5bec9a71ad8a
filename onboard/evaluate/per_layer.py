"""Where the KL comes from: per decoder layer, the KL when that layer alone is as in the artifact,
and the running KL when every layer up to it is."""

from collections import Counter
from typing import Any

import torch
from rich.progress import Progress

from onboard.console import console
from onboard.evaluate.replay import LAYER, LayerReplay, decoder_layers


def batch_windows(windows: list[tuple[str, list[int]]], tokens: int) -> torch.Tensor:
    """Full-length windows taken in turn from each traffic type, about `tokens` in all, as [n, T]."""
    length = max(len(w) for _, w in windows)
    by_traffic: dict[str, list[list[int]]] = {}
    for traffic, window in windows:
        if len(window) == length:
            by_traffic.setdefault(traffic, []).append(window)
    queues = list(by_traffic.values())
    chosen = [queue[i] for i in range(max(len(q) for q in queues)) for queue in queues if i < len(queue)]
    return torch.tensor(chosen[: max(1, round(tokens / length))])


def layer_formats(layers: dict[str, dict]) -> dict[int, dict[str, int]]:
    """{layer index: {format: modules}} from selection.json's `layers`."""
    counts: dict[int, Counter] = {}
    for name, entry in layers.items():
        match = LAYER.search(name)
        if match:
            counts.setdefault(int(match.group(1)), Counter())[entry["format"]] += 1
    return {i: dict(sorted(c.items())) for i, c in counts.items()}


def per_layer_kl(reference, quantized, input_ids: torch.Tensor, formats: dict[int, dict[str, int]]) -> dict[str, Any]:
    """Swaps the artifact's decoder layers into the reference (embeddings, final norm and head
    are BF16 in both). Layers before the first swapped one replay the recorded input."""
    replay = LayerReplay(reference, input_ids)
    own = list(replay.layers)
    theirs = list(decoder_layers(quantized))
    count = len(own)
    alone, running = [], [0.0] * count
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("per-layer KL", total=2 * count)
        for i in range(count):
            replay.layers[i] = theirs[i]
            alone.append(replay.mean_kl(i, replay.reference_inputs[i] if i else None)[0])
            replay.layers[i] = own[i]
            progress.advance(task)
        for i in range(count):
            replay.layers[i] = theirs[i]
        full, quantized_inputs = replay.mean_kl()
        for i in range(count):
            replay.layers[i] = own[i]
        running[count - 1] = full
        progress.advance(task)
        for i in range(count - 1):  # layers 0..i as in the artifact: the reference from layer i+1 on
            running[i] = replay.mean_kl(i + 1, quantized_inputs[i + 1])[0]
            progress.advance(task)
    return {
        "tokens": replay.num_tokens,
        "full_kld": full,
        "layers": [
            {"layer": i, "formats": formats.get(i, {}), "alone_kld": alone[i], "running_kld": running[i]}
            for i in range(count)
        ],
    }


def per_layer_table(per_layer: dict[str, Any], top: int = 8):
    from rich.table import Table

    table = Table(title=f"KL per decoder layer ({per_layer['tokens']} tokens; top {top} alone)", title_justify="left")
    for column in ("layer", "formats", "alone (nats)", "running (nats)"):
        table.add_column(column, justify="right" if column != "formats" else "left")
    rows = sorted(per_layer["layers"], key=lambda r: -r["alone_kld"])[:top]
    for row in sorted(rows, key=lambda r: r["layer"]):
        formats = ", ".join(f"{n} {f}" for f, n in row["formats"].items())
        table.add_row(str(row["layer"]), formats, f"{row['alone_kld']:.4f}", f"{row['running_kld']:.4f}")
    return table
