"""Smoke generation through transformers, for a family the reference engine does not run
(`onboard run --skip-adapt`): the same prompts, modes and detectors, each side loaded with
`transformers` and generated one prompt at a time with `generate`.

Batch invariance is a property of the serving engine, not of the model: it is not measured here
(`invariance_note` says so and the gate lists it as not measured). Sampling is seeded per prompt
and the checkpoint's own generation defaults are not applied, so both sides sample alike.
"""

import gc
import time
from pathlib import Path
from typing import Any

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from transformers import GenerationConfig

from onboard.console import console
from onboard.data import ChatPrompt
from onboard.models import inspect_checkpoint, load_model, load_tokenizer
from onboard.recipes import Smoke
from onboard.smoke.analysis import Side, compare, worst_cases
from onboard.smoke.passes import MODES, Output
from onboard.smoke.prompts import smoke_prompts

BATCH = 16
INVARIANCE_NOTE = "not measured: generated through transformers (--skip-adapt), not a serving engine"


def _eos_ids(model, tokenizer) -> set[int]:
    """The engine's rule (`LLMEngine._eos_ids`): the tokenizer's EOS and the generation config's."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    configured = model.generation_config.eos_token_id
    ids.update([configured] if isinstance(configured, int) else configured or [])
    return ids


def _entropy(logits: torch.Tensor) -> float:
    """The raw model's entropy at one step (nats), as the engine reports it."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return float(-(logp.exp() * logp).sum())


def generate_side(model, tokenizer, prompts: list[ChatPrompt], config: Smoke, mode: str, label: str) -> list[Output]:
    """`BATCH` prompts at a time, left-padded (one at a time is ten times slower here); sampling
    seeded per batch."""
    eos = sorted(_eos_ids(model, tokenizer))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    sampled = {"do_sample": True, "temperature": config.temperature, "top_p": config.top_p, "top_k": 0}
    settings = GenerationConfig(
        max_new_tokens=config.max_tokens,
        eos_token_id=eos or None,
        pad_token_id=pad,
        output_logits=True,
        return_dict_in_generate=True,
        **(sampled if mode == "sampled" else {"do_sample": False}),
    )
    outputs = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(label, total=len(prompts))
        for start in range(0, len(prompts), BATCH):
            batch = [p.token_ids for p in prompts[start : start + BATCH]]
            width = max(len(ids) for ids in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            torch.manual_seed(config.seed + start)
            with torch.no_grad():
                result = model.generate(ids, attention_mask=mask, generation_config=settings)
            for row in range(len(batch)):
                tokens = result.sequences[row, width:].tolist()
                ends = [i for i, token in enumerate(tokens) if token in eos]
                tokens = tokens[: ends[0] + 1] if ends else tokens
                finish = "stop" if ends else "length"
                text = tokenizer.decode(tokens, skip_special_tokens=True)
                entropies = [_entropy(result.logits[step][row]) for step in range(len(tokens))]
                outputs.append(Output(tokens, text, finish, entropies))
            progress.advance(task, len(batch))
    return outputs


def _side(path: Path, prompts_of, config: Smoke, label: str) -> tuple[dict[str, list[Output]], dict, list]:
    checkpoint = inspect_checkpoint(path)
    tokenizer = load_tokenizer(checkpoint)
    prompts = prompts_of(tokenizer)
    model = load_model(checkpoint)  # whole: the smoke plan counted both models resident
    by_mode, tps = {}, {}
    for mode in MODES:
        start = time.perf_counter()
        by_mode[mode] = generate_side(model, tokenizer, prompts, config, mode, f"{label}, {mode} (transformers)")
        tps[mode] = sum(len(o.token_ids) for o in by_mode[mode]) / max(time.perf_counter() - start, 1e-9)
    del model
    gc.collect()
    return by_mode, tps, prompts


def measure_transformers_smoke(artifact: Path, reference: Path, config: Smoke, data: Path | None) -> dict[str, Any]:
    """smoke.json's content with both sides generated through transformers."""
    prompts_of = lambda tokenizer: smoke_prompts(tokenizer, config, data)  # noqa: E731
    reference_outputs, reference_tps, _ = _side(reference, prompts_of, config, "reference")
    artifact_outputs, artifact_tps, prompts = _side(artifact, prompts_of, config, "artifact")
    tokenizer = load_tokenizer(inspect_checkpoint(artifact))
    mine, theirs = Side(artifact_outputs, config), Side(reference_outputs, config)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    return {
        "num_prompts": len(prompts),
        "max_tokens": config.max_tokens,
        "generated_by": "transformers",
        "modes": list(MODES),
        "speculator": False,
        **compare(mine, theirs, MODES),
        "batch_invariant": None,
        "invariance_note": INVARIANCE_NOTE,
        "invariance": {"prompts": 0, "compositions": [], "diverged": []},
        "speculative": None,
        "throughput": {
            **{f"artifact_{m}_tokens_per_s": v for m, v in artifact_tps.items()},
            **{f"reference_{m}_tokens_per_s": v for m, v in reference_tps.items()},
        },
        "cases": worst_cases(mine, theirs, prompts, decode, config.num_examples),
    }
