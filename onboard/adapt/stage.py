"""`onboard adapt`: the checkpoint in the reference engine, checked against transformers."""

from pathlib import Path
from typing import Any

import torch
from rich.progress import Progress
from rich.table import Table

from onboard import atomic
from onboard.adapt.parity import compare_greedy, compare_logits
from onboard.console import console
from onboard.data import builtin_records, tokenize_records
from onboard.errors import OnboardError
from onboard.evaluate.kl import KLStats
from onboard.hashing import fingerprint
from onboard.models import Checkpoint, load_model, load_tokenizer
from onboard.workspace import RunDir, Stage

NUM_PROMPTS = 16
MAX_NEW_TOKENS = 64
TOP = 5


def engine_model_for(checkpoint: Checkpoint) -> str:
    """The engine class serving this architecture, or a one-line refusal."""
    from transformers import AutoConfig

    from onboard.engine.models import UnsupportedArchitecture, model_class

    try:
        return model_class(AutoConfig.from_pretrained(checkpoint.path)).__name__
    except UnsupportedArchitecture as err:
        raise OnboardError(str(err)) from err


def parity_prompts(tokenizer) -> list[list[int]]:
    records = builtin_records("eval")[:NUM_PROMPTS]
    return tokenize_records(records, tokenizer, chat=True, max_length=192)


@torch.inference_mode()
def _reference_greedy(model, prompt: list[int], eos_ids: set[int], pad_id: int) -> tuple[list[int], list[list[int]]]:
    """transformers' greedy continuation, decoded on two copies of the prompt: the engine runs every
    linear on at least two rows (oneDNN rounds a one-row product differently, and batch invariance
    needs one kernel for every batch size), so two rows make both sides run the same kernels."""
    out = model.generate(
        torch.tensor([prompt, prompt]),
        attention_mask=torch.ones(2, len(prompt), dtype=torch.long),
        max_new_tokens=MAX_NEW_TOKENS,
        do_sample=False,
        eos_token_id=sorted(eos_ids),
        pad_token_id=pad_id,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    top = [step[0].float().topk(TOP).indices.tolist() for step in out.logits]
    return tokens, top


def measure_parity(checkpoint: Checkpoint) -> dict[str, Any]:
    from onboard.engine.config import EngineConfig
    from onboard.engine.llm_engine import LLMEngine
    from onboard.engine.sampler import SamplingParams

    tokenizer = load_tokenizer(checkpoint)
    prompts = parity_prompts(tokenizer)
    engine = LLMEngine(checkpoint.path, EngineConfig(enable_prefix_caching=False))
    reference = load_model(checkpoint)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, logprobs=TOP)
    stats = KLStats()
    max_diff = 0.0
    cases = []
    with Progress(console=console) as progress:
        task = progress.add_task("parity", total=len(prompts))
        for prompt in prompts:
            # One request at a time, as the reference runs: batch composition is a separate
            # question (smoke's batch-invariance check), not architecture parity.
            (mine,) = engine.generate([prompt], greedy)
            theirs, their_top = _reference_greedy(reference, prompt, engine.eos_ids, tokenizer.pad_token_id)
            my_top = [[entry["top"][k][0] for k in range(len(entry["top"]))] for entry in mine.logprobs]
            verdict = compare_greedy(mine.token_ids, theirs, my_top, their_top)
            forced = prompt + theirs
            with torch.inference_mode():
                ref_logits = reference(torch.tensor([forced])).logits[0].float()
            max_diff = max(max_diff, compare_logits(engine.score(forced), ref_logits, stats))
            cases.append(
                {
                    "prompt_tokens": len(prompt),
                    "matched": verdict.matched,
                    "first_divergence": verdict.first_divergence,
                    "near_tie": verdict.near_tie,
                    "engine_text": tokenizer.decode(mine.token_ids, skip_special_tokens=True),
                    "reference_text": tokenizer.decode(theirs, skip_special_tokens=True),
                }
            )
            progress.advance(task)
    summary = stats.summary()
    return {
        "max_abs_logit_diff": max_diff,
        "mean_kld": summary["mean_kld"],
        "top1_agreement": summary["top1_agreement"],
        "greedy_match_rate": sum(c["matched"] for c in cases) / len(cases),
        "logprobs_close": all(c["near_tie"] for c in cases),
        "num_prompts": len(cases),
        "max_new_tokens": MAX_NEW_TOKENS,
        "num_tokens": summary["num_tokens"],
        "engine_model": engine_model_for(checkpoint),
        "cases": cases,
    }


def parity_table(result: dict[str, Any]) -> Table:
    table = Table(title="engine against transformers, same weights", title_justify="left")
    table.add_column("check")
    table.add_column("value", justify="right")
    table.add_row("max |Δ logit|", f"{result['max_abs_logit_diff']:.4f}")
    table.add_row("mean KLD (nats)", f"{result['mean_kld']:.2e}")
    table.add_row("same top token", f"{100 * result['top1_agreement']:.2f} %")
    table.add_row(f"identical {result['max_new_tokens']}-token greedy", f"{100 * result['greedy_match_rate']:.1f} %")
    table.add_row("divergences only at near-ties", str(result["logprobs_close"]))
    return table


def run_adapt(run: RunDir, checkpoint: Checkpoint) -> dict[str, Any]:
    console.print(f"{', '.join(checkpoint.architectures)} -> engine model {engine_model_for(checkpoint)}")

    def body(stage: Stage) -> dict[str, Any]:
        torch.manual_seed(0)
        result = measure_parity(checkpoint)
        atomic.write_json(stage.path("adapt/parity.json"), result)
        return {k: v for k, v in result.items() if k != "cases"}

    entry = run.run_stage("adapt", {"model": fingerprint(checkpoint.path)}, outputs=["adapt"], body=body)
    console.print(parity_table(entry["metrics"]))
    return entry


def resolve_target(path: Path, out: Path | None) -> tuple[Path, Path]:
    """(checkpoint, run directory) for PATH being a run directory or a plain checkpoint."""
    if (path / "manifest.json").is_file():
        if not (path / "artifact" / "config.json").is_file():
            raise OnboardError(f"{path} has no artifact; run `onboard quantize` first")
        return path / "artifact", out or path
    if out is None:
        raise OnboardError(f"{path} is a checkpoint, not a run directory: pass --out DIR for the results")
    return path, out
