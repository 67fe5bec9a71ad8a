"""Batch invariance: a greedy request must decode the same whatever runs beside it.

Each checked prompt is decoded alone first; then all of them together, again (the prefix cache now
warm), and interleaved with other requests that sample. Any difference is reported with the
first position where the tokens part. CPU GEMM kernels may sum in another order when a batch has
another number of rows, so this is a property to measure, not one to assume.
"""

from typing import Any

from onboard.recipes import Smoke
from onboard.smoke.detectors import first_divergence
from onboard.smoke.passes import generate, params_for


def check_invariance(engine, prompts: list[list[int]], config: Smoke) -> dict[str, Any]:
    chosen = prompts[: config.invariance_prompts]
    greedy = params_for("greedy", config.invariance_max_tokens, config.temperature, config.top_p, config.seed)
    if not chosen:
        return {"prompts": 0, "compositions": [], "diverged": []}
    alone = [generate(engine, [p], [greedy], f"invariance: alone {i + 1}/{len(chosen)}") for i, p in enumerate(chosen)]
    baseline = [result.outputs[0].token_ids for result in alone]

    others = prompts[len(chosen) : 3 * len(chosen)] or chosen[::-1]
    mixed_prompts, mixed_params, positions = [], [], []
    for i, prompt in enumerate(chosen):  # each checked request between two sampled ones
        for j, other in enumerate(others[2 * i : 2 * i + 2] or others[:1]):
            seed = config.seed + 1000 + 2 * i + j
            mixed_prompts.append(other)
            mixed_params.append(params_for("sampled", config.invariance_max_tokens, config.temperature, 1.0, seed))
            if j == 0:
                positions.append(len(mixed_prompts))
                mixed_prompts.append(prompt)
                mixed_params.append(greedy)

    mixed = generate(engine, mixed_prompts, mixed_params, "invariance: mixed").outputs
    batched = [greedy] * len(chosen)
    runs = {
        f"batch of {len(chosen)}": generate(engine, chosen, batched, "invariance: batched").outputs,
        "batch again (warm prefix cache)": generate(engine, chosen, batched, "invariance: again").outputs,
        "among sampled requests": [mixed[k] for k in positions],
    }
    diverged = []
    for composition, outputs in runs.items():
        for i, output in enumerate(outputs):
            position = first_divergence(baseline[i], output.token_ids)
            if position is not None:
                diverged.append({"prompt": i, "composition": composition, "first_divergence": position})
    return {"prompts": len(chosen), "compositions": ["alone", *runs], "diverged": diverged, "baseline": baseline}


def check_speculative(engine, draft_dir, prompts: list[list[int]], baseline: list[list[int]], config: Smoke) -> dict:
    """The checked prompts batched again with the exported speculator: greedy speculative decoding
    must give the tokens plain decoding gave; also its acceptance on them."""
    from onboard.speculator.export import load_speculator, speculative_tokens

    k = speculative_tokens(draft_dir)
    engine.set_speculator(load_speculator(draft_dir), k)
    try:
        greedy = params_for("greedy", config.invariance_max_tokens, config.temperature, config.top_p, config.seed)
        chosen = prompts[: len(baseline)]
        outputs = generate(engine, chosen, [greedy] * len(chosen), "invariance: speculative").outputs
        stats = engine.speculator.stats
    finally:
        engine.set_speculator(None, 0)
    composition = f"batched, speculative (k={k})"
    diverged = []
    for i, output in enumerate(outputs):
        position = first_divergence(baseline[i], output.token_ids)
        if position is not None:
            diverged.append({"prompt": i, "composition": composition, "first_divergence": position})
    return {
        "composition": composition,
        "num_speculative_tokens": k,
        "acceptance_length": 1 + stats.num_accepted_tokens / max(stats.num_drafts, 1),
        "num_drafts": stats.num_drafts,
        "diverged": diverged,
    }
