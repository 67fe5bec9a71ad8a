"""Whole-model parity: the engine's logits and greedy decodes against transformers' on the same
weights, under the rule the checkpoint calls for (`RULES`)."""

import copy
from dataclasses import dataclass
from typing import Any

import torch
from rich.progress import Progress

from onboard.adapt.parity import GreedyComparison, compare_greedy, compare_logits
from onboard.console import console
from onboard.data import builtin_records, chat_prompts
from onboard.errors import OnboardError
from onboard.evaluate.kl import KLStats
from onboard.models import Checkpoint, load_model, load_tokenizer
from onboard.stage import engine_model_for

NUM_PROMPTS = 16
MAX_PROMPT_TOKENS = 192
MAX_NEW_TOKENS = 64
TOP = 5
MOVED_RUNS = 4  # seeds of the one-ulp input moves that a decision tie is judged against
FLOOR_FRACTION = 0.25  # fast's mean |Δ logprob| against that move's: the decision-tie rule's bound


def parity_prompts(tokenizer, num_prompts: int = NUM_PROMPTS) -> list[list[int]]:
    """The first `num_prompts` built-in eval prompts of at most MAX_PROMPT_TOKENS. Longer ones are
    skipped, not cut: parity is checked on prompts as they are served, assistant header included."""
    prompts = chat_prompts(
        builtin_records("eval"), tokenizer, max_tokens=MAX_PROMPT_TOKENS, fit="skip", limit=num_prompts
    )
    return [p.token_ids for p in prompts]


@dataclass
class ReferenceDecode:
    """transformers' greedy continuation of one prompt: its tokens, the float32 logits `[steps, V]`
    that chose each, and the KV cache it ended with (prompt plus every token but the last)."""

    prompt: list[int]
    tokens: list[int]
    logits: torch.Tensor
    cache: Any

    @property
    def top(self) -> list[list[int]]:
        return self.logits.topk(TOP).indices.tolist()


@torch.inference_mode()
def _reference_greedy(model, prompt: list[int], eos_ids: set[int], pad_id: int) -> ReferenceDecode:
    """transformers' greedy continuation of the prompt alone, as a user runs it: the engine's
    exact numerics run the same products with the same rows (`engine/model_runner.py`)."""
    out = model.generate(
        torch.tensor([prompt], device=model.device),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=model.device),
        max_new_tokens=MAX_NEW_TOKENS,
        do_sample=False,
        eos_token_id=sorted(eos_ids),
        pad_token_id=pad_id,
        output_logits=True,
        return_dict_in_generate=True,
    )
    logits = torch.stack([step[0] for step in out.logits]).float().cpu()
    return ReferenceDecode(prompt, out.sequences[0, len(prompt) :].tolist(), logits, out.past_key_values)


def _engine(checkpoint: Checkpoint, dtype: torch.dtype, device: str, numerics: str = "exact"):
    from onboard.engine import EngineConfig, LLMEngine

    config = EngineConfig(device=device, numerics=numerics, enable_prefix_caching=False)
    return LLMEngine(checkpoint.path, config, dtype=dtype)


RULES = ("bitwise", "near_tie", "layerwise_distribution")


def measure_parity(
    checkpoint: Checkpoint,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    num_prompts: int = NUM_PROMPTS,
    source: Checkpoint | None = None,
) -> dict[str, Any]:
    """Exact numerics against transformers: teacher-forced logits, greedy continuations and, for
    DSA models, the indexer's selected keys at every position.  The fast numerics (what serves)
    are judged against the same reference in the `fast` block: logits, greedy continuations and
    whether every divergence is a near-tie: of the token, or of a decision upstream of it
    (`_decision_tie`: where transformers' continuation is not fixed beyond rounding).

    `rule` says which rule judges the result: `bitwise` (every logit and token transformers'
    own), `near_tie` (bf16, FP8 and weight-only formats: every divergence a near-tie), or, for
    an artifact that quantizes activations to 4 bits, `layerwise_distribution`: the layerwise
    rule (`layerwise.py`) and the distribution rule against `source`, the unquantized model
    (`distribution.py`), for both numerics."""
    from onboard.adapt.distribution import DistributionParity, moved_input_logits, quantizes_activations_to_4_bits
    from onboard.adapt.dsa import compare_selections
    from onboard.engine import SamplingParams

    four_bit = quantizes_activations_to_4_bits(checkpoint.config)
    if four_bit and source is None:
        raise OnboardError(
            f"{checkpoint.path} quantizes activations to 4 bits: its parity rule compares both sides with the "
            "unquantized model; run adapt on the run directory `onboard quantize` made"
        )
    tokenizer = load_tokenizer(checkpoint)
    prompts = parity_prompts(tokenizer, num_prompts)
    engine = _engine(checkpoint, dtype, device)
    fast = _engine(checkpoint, dtype, device, "fast")
    reference = load_model(checkpoint, dtype).to(device)
    source_model = load_model(source, dtype).to(device) if four_bit else None
    distribution, last_bits = DistributionParity(), torch.Generator().manual_seed(0)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, logprobs=TOP)
    stats = KLStats()
    max_diff = fast_max_diff = exact_max_diff = 0.0
    fast_agree = fast_positions = exact_agree = exact_positions = 0
    cases, fast_cases, index_sets, decision_ties, floor_fractions = [], [], [], [], []
    with Progress(console=console) as progress:
        task = progress.add_task("parity", total=len(prompts))
        for prompt in prompts:
            # One request at a time, as the reference runs: batch composition is a separate
            # question (smoke's batch-invariance check), not architecture parity.
            (mine,) = engine.generate([prompt], greedy)
            decoded = _reference_greedy(reference, prompt, engine.eos_ids, tokenizer.pad_token_id)
            theirs, their_top = decoded.tokens, decoded.top
            verdict = compare_greedy(mine.token_ids, theirs, _top_ids(mine), their_top)
            forced = prompt + theirs
            trace: dict = {}
            with torch.inference_mode():
                ref_logits = reference(torch.tensor([forced], device=device)).logits[0].float().cpu()
            engine_logits = engine.score(forced, trace=trace).cpu()
            max_diff = max(max_diff, compare_logits(engine_logits, ref_logits, stats))
            if source_model is not None:
                with torch.inference_mode():
                    source_logits = source_model(torch.tensor([forced], device=device)).logits[0].float().cpu()
                moved = moved_input_logits(reference, torch.tensor([forced], device=device), last_bits).cpu()
                sides = {"exact": engine_logits, "fast": fast.score(forced).cpu()}
                distribution.update(source_logits, ref_logits, moved, sides)
            if trace:
                index_sets.append(compare_selections(reference, forced, trace))
            (quick,) = fast.generate([prompt], greedy)
            decode = _decode_agreement(reference, decoded, quick)
            fast_verdict = compare_greedy(quick.token_ids, theirs, _top_ids(quick), their_top)
            fast_cases.append(fast_verdict)
            if not fast_verdict.near_tie:
                moved_at = _moved_divergence(reference, decoded, engine.eos_ids, tokenizer.pad_token_id)
                floor = _moved_deviation(reference, prompt, quick.token_ids)
                decision_ties.append(_decision_tie(fast_verdict, decode, moved_at, floor))
                floor_fractions.append(decode["mean_abs_logprob_diff"] / max(floor, 1e-12))
            fast_max_diff = max(fast_max_diff, decode["max_abs_logprob_diff"])
            fast_agree += decode["top1_agree"]
            fast_positions += decode["positions"]
            exact_decode = _decode_agreement(reference, decoded, mine)  # the same measure's floor
            exact_max_diff = max(exact_max_diff, exact_decode["max_abs_logprob_diff"])
            exact_agree += exact_decode["top1_agree"]
            exact_positions += exact_decode["positions"]
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
    result = {
        "max_abs_logit_diff": max_diff,
        "mean_kld": summary["mean_kld"],
        "top1_agreement": summary["top1_agreement"],
        "greedy_match_rate": sum(c["matched"] for c in cases) / len(cases),
        "logprobs_close": all(c["near_tie"] for c in cases),
        "num_prompts": len(cases),
        "max_new_tokens": MAX_NEW_TOKENS,
        "num_tokens": summary["num_tokens"],
        "dtype": str(dtype).removeprefix("torch."),
        "numerics": "exact",
        "engine_model": engine_model_for(checkpoint),
        "kv_bytes_per_token": engine.kv_layout.bytes_per_token(),
        "cases": cases,
    }
    if index_sets:
        result["index_sets"] = {
            "positions": sum(s["positions"] for s in index_sets),
            "equal": sum(s["equal"] for s in index_sets),
            "equal_rate": sum(s["equal"] for s in index_sets) / max(1, sum(s["positions"] for s in index_sets)),
        }
    result["fast"] = {
        "numerics": "fast",
        # At the decode steps of fast's own greedy continuations (what the fast kernels compute;
        # a teacher-forced prompt is a prefill, the same kernels in both numerics), against
        # transformers decoding the same tokens; `exact_*`: the same measure on exact's
        # continuations, its floor (1.0 and 0.0 where exact is bitwise).
        "max_abs_logprob_diff": fast_max_diff,
        "top1_agreement": fast_agree / max(fast_positions, 1),
        "num_decode_positions": fast_positions,
        "exact_max_abs_logprob_diff": exact_max_diff,
        "exact_top1_agreement": exact_agree / max(exact_positions, 1),
        "greedy_match_rate": sum(c.matched for c in fast_cases) / len(fast_cases),
        # of num_prompts: parted at a token near-tie; at a decision tie (`_decision_tie`)
        "near_tie_prompts": sum(c.near_tie and not c.matched for c in fast_cases),
        "decision_tie_prompts": sum(decision_ties),
        # the largest, over prompts that no token near-tie explains, of fast's mean |Δ logprob|
        # over a one-ulp input move's (`_decision_tie`; None: every prompt matched or near-tied)
        "moved_floor_fraction": max(floor_fractions, default=None),
        "logprobs_close": all(decision_ties),  # every other prompt matched or parted at a near-tie
    }
    bitwise = max_diff == 0 and result["greedy_match_rate"] == 1 and exact_max_diff == 0
    result["rule"] = "layerwise_distribution" if four_bit else ("bitwise" if bitwise else "near_tie")
    if four_bit:
        from onboard.adapt.layerwise import measure_layerwise

        result["distribution"] = distribution.summary("exact")
        result["fast"]["distribution"] = distribution.summary("fast")
        layerwise = measure_layerwise(checkpoint.path, prompts, dtype, device)
        result["layerwise"] = {k: v for k, v in layerwise.items() if k not in ("dtype", "num_prompts")}
    return result


@torch.inference_mode()
def _decode_agreement(model, reference: ReferenceDecode, completion) -> dict[str, Any]:
    """transformers decoding the engine's own continuation token by token, as its `generate` would
    have: at each generated position, whether the engine's token is transformers' top-1 there, and
    how far apart the two log probabilities of that token are.  Up to where the continuation parts
    from transformers' own, its generate logits are those; from there, its cache (cut back to the
    common tokens) decodes the rest.  Decode-shaped on both sides, so exact numerics scores 1.0
    and 0.0, and what differs is the fast kernels' own rounding (a teacher-forced prefill would
    add transformers' prefill-against-decode rounding: 15 % of top tokens on an NVFP4 artifact)."""
    tokens = completion.token_ids
    if not tokens:
        return {"positions": 0, "top1_agree": 0, "max_abs_logprob_diff": 0.0, "mean_abs_logprob_diff": 0.0}
    logits = _decode_logits(model, reference, tokens)
    ids = torch.tensor(tokens)
    theirs = logits.log_softmax(-1)[torch.arange(len(tokens)), ids]
    mine = torch.tensor([entry["logprob"] for entry in completion.logprobs])
    return {
        "positions": len(tokens),
        "top1_agree": int((logits.argmax(-1) == ids).sum()),
        "max_abs_logprob_diff": float((mine - theirs).abs().max()),
        "mean_abs_logprob_diff": float((mine - theirs).abs().mean()),
    }


@torch.inference_mode()
def _decode_logits(model, reference: ReferenceDecode, tokens: list[int]) -> torch.Tensor:
    """transformers' float32 logits `[len(tokens), V]` that chose each of `tokens`, a continuation
    of the reference's prompt, decoded as `generate` decodes (see `_decode_agreement`)."""
    common = next((i for i, (a, b) in enumerate(zip(tokens, reference.tokens, strict=False)) if a != b), len(tokens))
    known = min(common + 1, len(reference.logits), len(tokens))  # positions whose logits generate made
    steps = [reference.logits[:known]]
    if known < len(tokens):
        cache, mask = _cache_after(model, reference, known - 1)
        for token in tokens[known - 1 : -1]:
            out = _decode_step(model, token, mask, cache)
            mask = torch.cat([mask, mask[:, :1]], dim=1)
            steps.append(out.logits[:, -1].float().cpu())
    return torch.cat(steps)


@torch.inference_mode()
def _moved_divergence(model, reference: ReferenceDecode, eos_ids: set[int], pad_id: int) -> int | None:
    """Where transformers' own greedy continuation first parts from itself with its input embeddings
    moved by one ulp (the earliest of `MOVED_RUNS` seeds); None where no moved run parts."""
    from onboard.adapt.layerwise import last_bit_perturbed

    first = None
    for seed in range(MOVED_RUNS):
        gen = torch.Generator().manual_seed(seed)
        handle = model.get_input_embeddings().register_forward_hook(
            lambda _module, _args, output, gen=gen: last_bit_perturbed(output, gen)
        )
        try:
            moved = _reference_greedy(model, reference.prompt, eos_ids, pad_id).tokens
        finally:
            handle.remove()
        no_top = [[]] * max(len(moved), len(reference.tokens))  # where they part, not whether at a near-tie
        parted = compare_greedy(moved, reference.tokens, no_top, no_top).first_divergence
        if parted is not None:
            first = parted if first is None else min(first, parted)
    return first


@torch.inference_mode()
def _moved_deviation(model, prompt: list[int], tokens: list[int]) -> float:
    """How far a one-ulp move of the input embeddings shifts transformers' log probability of each of
    `tokens` (a continuation of `prompt`, teacher-forced on both sides): the mean |Δ| over the
    tokens, averaged over `MOVED_RUNS` seeds."""
    from onboard.adapt.distribution import moved_input_logits

    ids = torch.tensor([prompt + tokens], device=model.device)
    at = torch.arange(len(prompt) - 1, len(prompt) + len(tokens) - 1)
    chosen = torch.tensor(tokens)
    plain = model(ids).logits[0].float().cpu().log_softmax(-1)[at, chosen]
    shifts = []
    for seed in range(MOVED_RUNS):
        moved = moved_input_logits(model, ids, torch.Generator().manual_seed(seed)).cpu().log_softmax(-1)[at, chosen]
        shifts.append(float((moved - plain).abs().mean()))
    return sum(shifts) / len(shifts)


def _decision_tie(
    verdict: GreedyComparison, decode: dict[str, Any], moved_divergence: int | None, floor: float
) -> bool:
    """Whether fast numerics' greedy divergence at a token that is no near-tie is still rounding's: a
    router's or an indexer's top-k flipped at a near-tie of its scores upstream gives such a token
    (issue #37, item 9).  It is when transformers' own continuation parts from itself under a
    one-ulp move of its input embeddings no later than fast's does (what it decodes there is not
    fixed beyond rounding), and fast's log probabilities along its own tokens sit within
    `FLOOR_FRACTION` of what that move shifts transformers' by along them (`floor`).  Over 25
    random MLA models fast numerics sat at most at 0.024 of the floor on a CPU with AMX and at
    0.135 on one with AVX-512 but no avx512_bf16 or AMX (which upstream flips a rounding difference makes is luck); one
    layer's o_proj scaled by 0.99, a 1 % error at bf16's resolution, at 0.06 to 0.37 (docs/benchmarks.md,
    the fast-MLA sweep), and by 0.95 at 0.60 (`tests/adapt/test_decision_tie.py`)."""
    return (
        moved_divergence is not None
        and moved_divergence <= verdict.first_divergence
        and decode["mean_abs_logprob_diff"] <= FLOOR_FRACTION * floor
    )


def _cache_after(model, reference: ReferenceDecode, generated: int):
    """transformers' cache after the prompt and the first `generated` tokens of its own
    continuation, and its attention mask: the end cache cut back, or, where a layer cannot be cut
    back (linear attention's recurrent state, a sliding layer past its window: transformers keeps
    the last window of keys only), rebuilt the way `generate` built it (the prompt, then each token
    alone)."""
    length = len(reference.prompt) + generated
    layers = getattr(reference.cache, "layers", [])
    if not any(hasattr(layer, "recurrent_states") or hasattr(layer, "sliding_window") for layer in layers):
        cache = copy.deepcopy(reference.cache)
        cache.crop(length)
        return cache, torch.ones(1, length, dtype=torch.long, device=model.device)
    mask = torch.ones(1, len(reference.prompt), dtype=torch.long, device=model.device)
    out = model(torch.tensor([reference.prompt], device=model.device), attention_mask=mask, use_cache=True)
    cache = out.past_key_values
    for token in reference.tokens[:generated]:
        _decode_step(model, token, mask, cache)
        mask = torch.cat([mask, mask[:, :1]], dim=1)
    return cache, mask


def _decode_step(model, token: int, mask: torch.Tensor, cache):
    """One token after the `mask.shape[1]` cached ones, as `generate` steps (positions given: a VLM
    would otherwise derive its multimodal ones from the mask)."""
    position = torch.tensor([[mask.shape[1]]], device=model.device)
    ids = torch.tensor([[token]], device=model.device)
    mask = torch.cat([mask, mask[:, :1]], dim=1)
    return model(
        ids, attention_mask=mask, past_key_values=cache, use_cache=True, position_ids=position, logits_to_keep=1
    )


def _top_ids(completion) -> list[list[int]]:
    return [[entry["top"][k][0] for k in range(len(entry["top"]))] for entry in completion.logprobs]
