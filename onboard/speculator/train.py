"""Training the EAGLE-3 draft: training-time test over K steps, forward KL to the target.

Loss at step s (weight `decay**s`): KL(target || draft) over the draft vocabulary, where the
target's distribution is its own lm_head on its captured final state, restricted to the draft
vocabulary and renormalised.  Only positions whose predicted token is part of a response (or of
teacher-forced text) count.  AdamW, linear warm-up then cosine decay (transformers' schedule).
Written against `accelerate`: under `torchrun` or `accelerate launch` every process takes the
global batch one process would and trains on its share of it (`parallel.py`), so N processes
give one process's loss curve and weights up to rounding.
Resumable at epoch boundaries from `checkpoint/` (safetensors + JSON, no pickle).
"""

import itertools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
from safetensors.torch import load_file, save_file

from onboard import atomic
from onboard.console import console
from onboard.speculator import parallel
from onboard.speculator.data import iter_sequences
from onboard.speculator.draft import Eagle3Draft


@dataclass(frozen=True)
class TrainSettings:
    epochs: int = 8
    learning_rate: float = 3e-4
    warmup_ratio: float = 0.05
    batch_sequences: int = 4
    max_seq_len: int = 512
    ttt_steps: int = 3
    step_decay: float = 0.8
    seed: int = 0
    max_steps: int | None = None  # optimizer steps in all (the last epoch cut short); None: every epoch whole


@dataclass
class Example:
    input_ids: torch.Tensor  # [T] tokens at positions 1..T
    aux: torch.Tensor  # [T, A*H] target states at positions 0..T-1
    final: torch.Tensor  # [T, H] target final states at positions 1..T (their next-token distributions)
    trained: torch.Tensor  # [T] bool: final[i] is the distribution of a trained-on token (one in the sequence)


def load_examples(data_dir: Path, max_seq_len: int) -> list[Example]:
    out = []
    for seq in iter_sequences(data_dir):
        ids, n = seq["input_ids"], len(seq["input_ids"])
        if n < 3:
            continue
        end = min(n, max_seq_len + 1)
        positions = torch.arange(1, end)
        out.append(
            Example(
                input_ids=ids[1:end],
                aux=seq["aux"][: end - 1],
                final=seq["final"][1:end],
                # final[i] (position i + 1) gives token i + 2's distribution: trained when that token
                # is a response's (or teacher-forced text's), not past the sequence's end (after EOS).
                trained=(positions + 1 >= max(seq["num_prompt_tokens"], 1)) & (positions + 1 < n),
            )
        )
    return out


def collate(examples: list[Example]) -> dict[str, torch.Tensor]:
    length = max(len(e.input_ids) for e in examples)

    def pad(t: torch.Tensor, value=0) -> torch.Tensor:
        extra = length - t.shape[0]
        return F.pad(t, (0, 0, 0, extra), value=value) if t.dim() == 2 else F.pad(t, (0, extra), value=value)

    return {
        "input_ids": torch.stack([pad(e.input_ids) for e in examples]),
        "aux": torch.stack([pad(e.aux.float()) for e in examples]),
        "final": torch.stack([pad(e.final.float()) for e in examples]),
        "trained": torch.stack([pad(e.trained, False) for e in examples]),
        "valid": torch.stack([pad(torch.ones(len(e.input_ids), dtype=torch.bool), False) for e in examples]),
    }


def trained_counts(batch: dict[str, torch.Tensor], steps: int) -> torch.Tensor:
    """[steps] the trained positions of each training-time-test step (step s: tokens s further on)."""
    valid, trained = batch["valid"], batch["trained"]
    return torch.stack([(valid[:, s:] & trained[:, s:]).sum() for s in range(steps)]).float()


def ttt_loss(
    unroll: Callable[..., list[torch.Tensor]],
    batch: dict[str, torch.Tensor],
    head: torch.Tensor,
    settings: TrainSettings,
    counts: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This process's loss of its share of a batch, each step's KL normalised by `counts` (the
    batch's trained positions per step over all processes, `parallel.ddp_mean`), and per step its
    correct predictions and correct chains (every step up to this one right) on trained positions.
    `unroll`: `Eagle3Draft.unroll` or what wraps it (DDP)."""
    logits = unroll(batch["aux"], batch["input_ids"], batch["valid"], settings.ttt_steps)
    with torch.no_grad():
        target_logp = F.linear(batch["final"], head).log_softmax(-1)  # [B, T, Vd]
    loss = torch.zeros((), device=head.device)
    chain = None
    correct_sums, chain_sums = [], []
    for s, step_logits in enumerate(logits):
        length = step_logits.shape[1] - s
        q = step_logits[:, :length].log_softmax(-1)
        p = target_logp[:, s:]
        mask = (batch["valid"][:, s:] & batch["trained"][:, s:]).float()
        kl = (p.exp() * (p - q)).sum(-1)
        loss = loss + parallel.ddp_mean(settings.step_decay**s * (kl * mask).sum(), counts[s])
        with torch.no_grad():
            correct = q.argmax(-1) == p.argmax(-1)
            chain = correct if chain is None else chain[:, :length] & correct
            correct_sums.append((correct.float() * mask).sum())
            chain_sums.append((chain.float() * mask).sum())
    return loss, torch.stack(correct_sums), torch.stack(chain_sums)


def _share(examples: list[Example]) -> dict[str, torch.Tensor]:
    """This process's sequences of a global batch, collated.  A process left without one (a short
    last batch) trains on the first with nothing marked trained: a zero loss whose backward still
    joins DDP's gradient all-reduce."""
    share = parallel.shard(examples)
    if share:
        return collate(share)
    return collate([replace(examples[0], trained=torch.zeros_like(examples[0].trained))])


def _save_checkpoint(path: Path, draft: Eagle3Draft, optimizer, scheduler, epoch: int, history: list, key: str) -> None:
    tensors = {f"model.{k}": v.detach().contiguous() for k, v in draft.state_dict().items()}
    opt_state = optimizer.state_dict()
    for index, state in opt_state["state"].items():
        for name, value in state.items():
            tensors[f"optim.{index}.{name}"] = torch.as_tensor(value).contiguous()
    meta = {
        "key": key,
        "epoch": epoch,
        "param_groups": opt_state["param_groups"],
        "scheduler": {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"},
        "history": history,
    }
    staging = path.with_name(path.name + ".tmp")
    atomic.remove(staging)
    staging.mkdir(parents=True)
    save_file(tensors, str(staging / "state.safetensors"))
    (staging / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    atomic.remove(path)
    staging.rename(path)


def _load_checkpoint(path: Path, draft: Eagle3Draft, optimizer, scheduler) -> tuple[int, list]:
    tensors = load_file(str(path / "state.safetensors"))
    meta = json.loads((path / "meta.json").read_text())
    draft.load_state_dict({k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")})
    state: dict[int, dict] = {}
    for name, value in tensors.items():
        if name.startswith("optim."):
            _, index, key = name.split(".", 2)
            state.setdefault(int(index), {})[key] = value
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    scheduler.load_state_dict({**scheduler.state_dict(), **meta["scheduler"]})
    return meta["epoch"], meta["history"]


def train_draft(
    draft: Eagle3Draft,
    data_dir: Path,
    target_head: torch.Tensor,
    settings: TrainSettings,
    checkpoint: Path,
    resume_key: str = "",
) -> list[dict]:
    """Train in place; returns the per-epoch history (loss, per-step accuracy, acceptance estimate).
    A checkpoint written under the same `resume_key` is resumed; any other is ignored."""
    from accelerate import Accelerator
    from transformers import get_cosine_schedule_with_warmup

    torch.manual_seed(settings.seed)
    # bf16 autocast: half the fp32 time on CPUs with AVX512-BF16/AMX, and what GPUs train in anyway.
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision="bf16")
    examples = load_examples(data_dir, settings.max_seq_len)
    if not examples:
        raise ValueError(f"{data_dir}: no training sequences")
    head = target_head[torch.nonzero(draft.t2d).squeeze(1)].float()  # draft order: ascending target ids
    batches_per_epoch = math.ceil(len(examples) / settings.batch_sequences)
    total = batches_per_epoch * settings.epochs
    if settings.max_steps is not None:
        total = min(total, settings.max_steps)
    epochs = math.ceil(total / batches_per_epoch)
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.learning_rate, betas=(0.9, 0.95), weight_decay=0.0)
    scheduler = get_cosine_schedule_with_warmup(optimizer, math.ceil(settings.warmup_ratio * total), total)
    start_epoch, history = 0, []
    meta_path = checkpoint / "meta.json"
    if meta_path.exists() and json.loads(meta_path.read_text()).get("key") == resume_key:
        start_epoch, history = _load_checkpoint(checkpoint, draft, optimizer, scheduler)
        if accelerator.is_main_process:
            console.print(f"speculator: resuming training after epoch {start_epoch}")
    # DDP's reducer syncs the gradients only through its own forward: the unroll is made one.  The
    # scheduler is stepped here: accelerate's would step once per process (for per-process batches).
    model, optimizer = accelerator.prepare(parallel.Method(draft, "unroll"), optimizer)
    head = head.to(accelerator.device)
    columns = [TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"), TimeRemainingColumn()]
    main = accelerator.is_main_process
    with Progress(*columns, console=console, transient=True, disable=not main) as progress:
        task = progress.add_task(
            "speculator: training", total=total, completed=start_epoch * batches_per_epoch, info=""
        )
        for epoch in range(start_epoch, epochs):
            order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(settings.seed + epoch))
            starts = range(0, len(examples), settings.batch_sequences)
            totals = {"loss": 0.0, "acceptance": 0.0, "accuracy": [0.0] * settings.ttt_steps, "batches": 0}
            model.train()
            for first in itertools.islice(starts, total - epoch * batches_per_epoch):
                chosen = [examples[i] for i in order[first : first + settings.batch_sequences].tolist()]
                batch = {k: v.to(accelerator.device) for k, v in _share(chosen).items()}
                counts = parallel.global_sum(trained_counts(batch, settings.ttt_steps))
                with accelerator.autocast():
                    loss, correct, chains = ttt_loss(model, batch, head, settings, counts)
                accelerator.backward(loss)
                accelerator.clip_grad_norm_(params, 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                # The batch's metrics over all processes (one process: its own, as they were).
                sums = parallel.global_sum(torch.cat([loss.detach()[None], correct, chains]).float())
                k = settings.ttt_steps
                totals["loss"] += float(sums[0] / parallel.world_size())
                accuracy = [float(c) for c in sums[1 : 1 + k] / counts.clamp(min=1)]
                expected = 1.0  # the acceptance length implied by the chains' rates
                for rate in sums[1 + k :] / counts.clamp(min=1):
                    expected += float(rate)
                totals["acceptance"] += expected
                totals["accuracy"] = [a + b for a, b in zip(totals["accuracy"], accuracy, strict=True)]
                totals["batches"] += 1
                n = totals["batches"]
                info = f"epoch {epoch + 1} loss {totals['loss'] / n:.3f} accept~{totals['acceptance'] / n:.2f}"
                progress.update(task, advance=1, info=info)
            n = max(totals["batches"], 1)
            history.append(
                {
                    "epoch": epoch + 1,
                    "steps": epoch * batches_per_epoch + totals["batches"],  # optimizer steps so far
                    "loss": totals["loss"] / n,
                    "acceptance_estimate": totals["acceptance"] / n,
                    "step_accuracy": [a / n for a in totals["accuracy"]],
                    "learning_rate": scheduler.get_last_lr()[0],
                }
            )
            if main:
                console.print(
                    f"speculator: epoch {epoch + 1}/{epochs} loss {history[-1]['loss']:.4f} "
                    f"acceptance estimate {history[-1]['acceptance_estimate']:.2f}"
                )
                _save_checkpoint(checkpoint, draft, optimizer, scheduler, epoch + 1, history, resume_key)
    draft.eval()
    return history
