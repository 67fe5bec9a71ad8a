"""Hidden-state capture: every training sequence teacher-forced through the engine, several per forward.

`engine.hidden_states` runs one sequence per forward; on an accelerator (and on a CPU, for short
sequences) that leaves most of the hardware idle. Here sequences are packed in order, up to
`pack_tokens` tokens a pack, and each pack is one prefill of several sequences over the paged KV
cache (`engine.batched_hidden_states`). A sequence's states then differ from its lone forward
only by the rounding of GEMMs whose row count differs (the function is the same).
"""

import json
from collections.abc import Sequence as Seq
from pathlib import Path

import torch
from safetensors.torch import save_file

from onboard.engine import draft_input
from onboard.speculator.data import TrainingSequence
from onboard.speculator.progress import Rate, rate_progress

PACK_TOKENS = 2048  # tokens of one capture forward (the engine's default step budget)
SHARD_TOKENS = 16384  # tokens of one written shard


def _blocks(length: int, block_size: int) -> int:
    return -(-length // block_size)


def packs(lengths: Seq[int], max_tokens: int, max_blocks: int, block_size: int) -> list[list[int]]:
    """Indices of consecutive sequences, grouped in order: a group holds at most `max_tokens`
    tokens and `max_blocks` KV blocks, or is one sequence alone."""
    groups: list[list[int]] = []
    tokens = blocks = 0
    for i, length in enumerate(lengths):
        need = _blocks(length, block_size)
        if groups and tokens + length <= max_tokens and blocks + need <= max_blocks:
            groups[-1].append(i)
            tokens, blocks = tokens + length, blocks + need
        else:
            groups.append([i])
            tokens, blocks = length, need
    return groups


def batched_hidden_states(
    engine, token_lists: Seq[list[int]], aux_layers: Seq[int] = ()
) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """`engine.hidden_states` of several sequences in one forward (`LLMEngine.batched_hidden_states`):
    per sequence, its final normed hidden states [T, H] and the inputs of decoder layers `aux_layers`."""
    return engine.batched_hidden_states(token_lists, aux_layers)


class ShardWriter:
    """Captured sequences, in the order added, as safetensors shards of about `shard_tokens` tokens
    (aux and final states in bf16) and the `index.json` training reads."""

    def __init__(self, out_dir: Path, aux_layers: list[int], shard_tokens: int = SHARD_TOKENS):
        out_dir.mkdir(parents=True, exist_ok=True)
        self.out_dir, self.aux_layers, self.shard_tokens = out_dir, aux_layers, shard_tokens
        self.shards: list[str] = []
        self.pending: list[dict[str, torch.Tensor]] = []
        self.num_sequences = self.num_tokens = 0
        self.traffic: set[str] = set()

    def add(self, seq: TrainingSequence, final: torch.Tensor, aux: Seq[torch.Tensor]) -> None:
        self.pending.append(
            {
                "input_ids": torch.tensor(seq.token_ids, dtype=torch.int64),
                "num_prompt_tokens": torch.tensor(seq.num_prompt_tokens),
                "aux": draft_input(list(aux)).to(torch.bfloat16).cpu().contiguous(),
                "final": final.to(torch.bfloat16).cpu().contiguous(),
            }
        )
        self.num_sequences += 1
        self.num_tokens += len(seq.token_ids)
        self.traffic.add(seq.traffic)

    def flush(self, force: bool = False) -> None:
        """Write the pending sequences as one shard once they reach `shard_tokens` (or `force`)."""
        if not self.pending or (not force and sum(len(p["input_ids"]) for p in self.pending) < self.shard_tokens):
            return
        pending = self.pending
        name = f"shard-{len(self.shards):05d}.safetensors"
        tensors = {
            "input_ids": torch.cat([p["input_ids"] for p in pending]),
            "lengths": torch.tensor([len(p["input_ids"]) for p in pending], dtype=torch.int64),
            "num_prompt_tokens": torch.tensor([int(p["num_prompt_tokens"]) for p in pending], dtype=torch.int64),
            "aux": torch.cat([p["aux"] for p in pending]),
            "final": torch.cat([p["final"] for p in pending]),
        }
        save_file(tensors, str(self.out_dir / name))
        self.shards.append(name)
        self.pending = []

    def close(self) -> dict:
        """The last shard and the index; returns the index."""
        self.flush(force=True)
        index = {
            "shards": self.shards,
            "aux_layers": self.aux_layers,
            "num_sequences": self.num_sequences,
            "num_tokens": self.num_tokens,
            "traffic": sorted(self.traffic),
        }
        (self.out_dir / "index.json").write_text(json.dumps(index, indent=2) + "\n")
        return index


def capture_shards(
    engine,
    sequences: list[TrainingSequence],
    aux_layers: list[int],
    out_dir: Path,
    shard_tokens: int = SHARD_TOKENS,
    pack_tokens: int = PACK_TOKENS,
) -> dict:
    """Teacher-force every sequence through the engine, `pack_tokens` tokens a forward; write
    aux/final states (bf16) in shards of about `shard_tokens` tokens, in the sequences' order."""
    writer = ShardWriter(out_dir, aux_layers, shard_tokens)
    block_size = engine.config.block_size
    free_blocks = engine.stats()["num_free_blocks"]
    groups = packs([len(s.token_ids) for s in sequences], pack_tokens, free_blocks, block_size)
    total = sum(len(s.token_ids) for s in sequences)
    rate = Rate()
    with rate_progress() as progress:
        task = progress.add_task("speculator: hidden states", total=total, rate="")
        for group in groups:
            batch = [sequences[i] for i in group]
            states = batched_hidden_states(engine, [s.token_ids for s in batch], aux_layers)
            for seq, (final, aux) in zip(batch, states, strict=True):
                writer.add(seq, final, aux)
            writer.flush()
            tokens = sum(len(s.token_ids) for s in batch)
            progress.update(task, advance=tokens, rate=rate.add(tokens))
    return writer.close()


def combine_captures(out_dir: Path, parts: list[Path]) -> dict:
    """A data directory whose index lists the shards of `parts` (captured data directories, read in
    place through relative paths): reuse captured data in several combinations without copying."""
    import os

    out_dir.mkdir(parents=True, exist_ok=True)
    indexes = [json.loads((part / "index.json").read_text()) for part in parts]
    if len({tuple(i["aux_layers"]) for i in indexes}) > 1:
        raise ValueError("captured parts read different aux layers")
    index = {
        "shards": [
            os.path.relpath(part / name, out_dir)
            for part, i in zip(parts, indexes, strict=True)
            for name in i["shards"]
        ],
        "aux_layers": indexes[0]["aux_layers"] if indexes else [],
        "num_sequences": sum(i["num_sequences"] for i in indexes),
        "num_tokens": sum(i["num_tokens"] for i in indexes),
        "traffic": sorted({t for i in indexes for t in i["traffic"]}),
    }
    (out_dir / "index.json").write_text(json.dumps(index, indent=2) + "\n")
    return index
