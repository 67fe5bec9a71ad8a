"""Hidden-state capture: every training sequence teacher-forced through the engine, several per forward.

`engine.hidden_states` runs one sequence per forward; on an accelerator (and on a CPU, for short
sequences) that leaves most of the hardware idle. Here sequences are packed in order, up to
`pack_tokens` tokens a pack, and each pack is one prefill of several sequences over the paged KV
cache, with the block manager used exactly as `hidden_states` uses it (allocated without prefix
reuse, released after the forward). A sequence's states then differ from its lone forward only by
the rounding of GEMMs whose row count differs (the function is the same).
"""

import json
from collections.abc import Sequence as Seq
from pathlib import Path

import torch
from safetensors.torch import save_file

from onboard.speculator.data import TrainingSequence
from onboard.speculator.progress import Rate, rate_progress

PACK_TOKENS = 2048  # tokens of one capture forward (the engine's default step budget)


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


@torch.inference_mode()
def batched_hidden_states(
    engine, token_lists: Seq[list[int]], aux_layers: Seq[int] = ()
) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """`engine.hidden_states` of several sequences in one forward: per sequence, its final normed
    hidden states [T, H] and the inputs of decoder layers `aux_layers` (each [T, H])."""
    from onboard.engine.scheduler import ScheduledSeq
    from onboard.engine.sequence import Sequence, SequenceStatus

    manager = engine.block_manager
    seqs = [Sequence(list(ids), engine.config.block_size) for ids in token_lists]
    allocated = []
    try:
        for seq in seqs:
            if not manager.can_allocate(seq, reuse_prefix=False):
                raise ValueError("not enough free KV-cache blocks for these sequences")
            manager.allocate(seq, reuse_prefix=False)
            allocated.append(seq)
        final, aux = engine.runner.forward_hidden([ScheduledSeq(s, len(s)) for s in seqs], tuple(aux_layers))
    finally:
        for seq in allocated:
            manager.deallocate(seq)
            seq.status = SequenceStatus.FINISHED
    lengths = [len(s) for s in seqs]
    finals = final.split(lengths)
    per_layer = [a.split(lengths) for a in aux]
    return [(finals[i], [states[i] for states in per_layer]) for i in range(len(seqs))]


def capture_shards(
    engine,
    sequences: list[TrainingSequence],
    aux_layers: list[int],
    out_dir: Path,
    shard_tokens: int = 16384,
    pack_tokens: int = PACK_TOKENS,
) -> dict:
    """Teacher-force every sequence through the engine, `pack_tokens` tokens a forward; write
    aux/final states (bf16) in shards of about `shard_tokens` tokens, in the sequences' order."""
    out_dir.mkdir(parents=True, exist_ok=True)
    shards: list[str] = []
    pending: list[dict[str, torch.Tensor]] = []

    def flush() -> None:
        if not pending:
            return
        name = f"shard-{len(shards):05d}.safetensors"
        tensors = {
            "input_ids": torch.cat([p["input_ids"] for p in pending]),
            "lengths": torch.tensor([len(p["input_ids"]) for p in pending], dtype=torch.int64),
            "num_prompt_tokens": torch.tensor([int(p["num_prompt_tokens"]) for p in pending], dtype=torch.int64),
            "aux": torch.cat([p["aux"] for p in pending]),
            "final": torch.cat([p["final"] for p in pending]),
        }
        save_file(tensors, str(out_dir / name))
        shards.append(name)
        pending.clear()

    block_size = engine.config.block_size
    groups = packs([len(s.token_ids) for s in sequences], pack_tokens, engine.block_manager.num_free_blocks, block_size)
    total = sum(len(s.token_ids) for s in sequences)
    rate = Rate()
    with rate_progress() as progress:
        task = progress.add_task("speculator: hidden states", total=total, rate="")
        for group in groups:
            batch = [sequences[i] for i in group]
            states = batched_hidden_states(engine, [s.token_ids for s in batch], aux_layers)
            for seq, (final, aux) in zip(batch, states, strict=True):
                pending.append(
                    {
                        "input_ids": torch.tensor(seq.token_ids, dtype=torch.int64),
                        "num_prompt_tokens": torch.tensor(seq.num_prompt_tokens),
                        "aux": torch.cat(aux, dim=-1).to(torch.bfloat16).cpu().contiguous(),
                        "final": final.to(torch.bfloat16).cpu().contiguous(),
                    }
                )
            if sum(len(p["input_ids"]) for p in pending) >= shard_tokens:
                flush()
            tokens = sum(len(s.token_ids) for s in batch)
            progress.update(task, advance=tokens, rate=rate.add(tokens))
    flush()
    index = {
        "shards": shards,
        "aux_layers": aux_layers,
        "num_sequences": len(sequences),
        "num_tokens": total,
        "traffic": sorted({s.traffic for s in sequences}),
    }
    (out_dir / "index.json").write_text(json.dumps(index, indent=2) + "\n")
    return index


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
