"""`onboard bench-quant`: selection methods side by side on held-out text."""

from pathlib import Path
from typing import Annotated

import typer

from onboard.cli.options import (
    CalibOpt,
    DataOpt,
    MaxMemoryOpt,
    PickleOpt,
    RecipeOpt,
    RemoteOpt,
    SearchTokOpt,
    StepsOpt,
    memory_budget,
)
from onboard.errors import OnboardError


def _budgets(text: str) -> list[float]:
    try:
        budgets = [float(part) for part in text.split(",") if part.strip()]
    except ValueError as err:
        raise OnboardError(f"--budgets {text!r}: not a comma-separated list of numbers") from err
    if not budgets or any(not 0 < b <= 16 for b in budgets):
        raise OnboardError(f"--budgets {text!r}: give bits per weight between 0 and 16, e.g. 4.5,5.5")
    return sorted(set(budgets))


def _methods(text: str) -> tuple[str, ...]:
    from pydantic import ValidationError

    from onboard.recipes import Method, describe

    names = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    for name in names:
        try:
            Method(**Method.parse(name))
        except ValidationError as err:
            raise OnboardError(f"--methods {name!r}: {describe(err)}") from err
        except ValueError as err:
            raise OnboardError(f"--methods {text!r}: {err}") from err
    if not names:
        raise OnboardError("--methods: name at least one method, e.g. rtn,gptq")
    return names


def bench_quant(
    model: Annotated[Path, typer.Argument(help="a Hugging Face checkpoint directory or a .gguf file")],
    budgets: Annotated[
        str, typer.Option(help="bits budgets of the additive and searched selections")
    ] = "4.5,5.0,5.5,6.0",
    out: Annotated[Path, typer.Option(help="the JSON file of rows")] = Path("bench-quant.json"),
    methods: Annotated[
        str | None, typer.Option(help="comma-separated methods measured at 4.5 bits (default: every one shipped)")
    ] = None,
    distill_tokens: Annotated[
        int | None, typer.Option(help="add RTN and the best method with NVFP4 scales distilled on N tokens")
    ] = None,
    data: DataOpt = None,
    calib: CalibOpt = None,
    recipe: RecipeOpt = None,
    search_steps: StepsOpt = None,
    search_tokens: SearchTokOpt = None,
    allow_pickle: PickleOpt = False,
    trust_remote_code: RemoteOpt = False,
    max_memory: MaxMemoryOpt = None,
) -> None:
    """Every quantization method uniform at 4.5 bits (NVFP4 W4A4; rtn is llmcompressor's preset), each
    lever on the weights alone (NVFP4A16) and on the activations alone, then with the best method the
    fixed rules (attention FP8, down_proj FP8, end layers BF16) and the additive and searched
    selections at each budget: held-out mean KLD, same-top-token rate, effective bits and seconds of
    each, measured in one run."""
    from onboard.data import existing_data
    from onboard.models import resolve_model
    from onboard.pipeline import recipe_with_overrides
    from onboard.quantize.bench import METHODS, run_bench_quant

    chosen = _budgets(budgets)
    measured = _methods(methods) if methods else METHODS
    checkpoint = resolve_model(model, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)
    settings = recipe_with_overrides(
        checkpoint,
        recipe,
        {
            "--distill-tokens": ("quantize.distill_tokens", distill_tokens),
            "--search-steps": ("quantize.search.steps", search_steps),
            "--search-tokens": ("quantize.search.tokens", search_tokens),
        },
    )
    from onboard.budget import human, model_shape, plan_stage
    from onboard.errors import OnboardError

    # A model copy per format and per method, scored in memory: the comparison has no streamed
    # path (`quantize --scheme auto` has), so over the budget it refuses before loading anything.
    budget = memory_budget(max_memory)
    plan = plan_stage("selection", model_shape(checkpoint.path), budget, settings.quantize.search.tokens)
    if plan.path != "in-memory":
        raise OnboardError(
            f"bench-quant holds a model per format and method (about {human(plan.in_memory)}), over the "
            f"{human(budget)} budget (--max-memory); `onboard quantize --scheme auto` selects streamed"
        )
    run_bench_quant(checkpoint, settings, chosen, existing_data(calib), existing_data(data), out, measured)
