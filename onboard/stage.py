"""The one shape every stage has: a module with `plan(ctx) -> StagePlan` and
`run(run_dir, ctx) -> StageResult`, listed in `pipeline.STAGE_MODULES`.

`plan` says, before the run directory is touched, which path the stage takes under the memory
budget (or refuses in one line); `run` does the work in a `RunDir`, resuming a finished stage with
the same inputs.  Both read everything the user gave from one `StageContext`, built once per
command (`pipeline.stage_context`).  `docs/adding-a-stage.md` walks through adding one.
"""

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Protocol

from onboard.budget import ModelShape, StagePlan, model_shape
from onboard.errors import OnboardError

if TYPE_CHECKING:
    from onboard.endpoint import EndpointSpec
    from onboard.models import Checkpoint
    from onboard.recipes import Recipe
    from onboard.workspace import RunDir

# What `run` returns: the stage's manifest entry (status, inputs, outputs, metrics).
StageResult = dict[str, Any]


@dataclass(frozen=True)
class StageContext:
    """Everything a stage may read besides its run directory, checked before any stage runs."""

    checkpoint: "Checkpoint"  # the source model, resolved and validated
    recipe: "Recipe"  # with the command line's overrides applied
    budget: int  # bytes (--max-memory, or the default share of this machine)
    device: str = "cpu"
    numerics: str = "fast"
    endpoint: "EndpointSpec | None" = None  # the artifact served (--endpoint)
    reference_endpoint: "EndpointSpec | None" = None  # the unquantized reference served
    calib: Path | None = None  # the calibration data, None: the built-in set
    data: Path | None = None  # the evaluation and smoke prompts, None: the built-in set
    skip_adapt: bool = False  # --skip-adapt: no adaptation proof; transformers where the engine lacks the family

    @cached_property
    def shape(self) -> ModelShape:
        """The source model's shape, from its safetensors headers: parsed once, for every plan."""
        return model_shape(self.checkpoint.path)


def engine_model_for(checkpoint: "Checkpoint") -> str:
    """The engine class serving `checkpoint`'s family, or a one-line refusal naming what the engine
    lacks (`UnsupportedArchitecture`). Read from config.json's `architectures` and `model_type`
    alone: nothing is loaded."""
    from onboard.engine import engine_model_name

    return engine_model_name(SimpleNamespace(architectures=checkpoint.architectures, model_type=checkpoint.model_type))


def engine_refusal(checkpoint: "Checkpoint") -> str | None:
    """Why the reference engine cannot run `checkpoint`'s family, in one line (None: it can)."""
    try:
        engine_model_for(checkpoint)
    except OnboardError as err:
        return str(err)
    return None


def require_engine(ctx: StageContext, stage: str) -> None:
    """A stage that runs the reference engine refuses, in its plan (so before any stage runs), a
    family the engine does not run, naming what it lacks; quantize and eval need no engine."""
    refusal = engine_refusal(ctx.checkpoint)
    if refusal is not None:
        raise OnboardError(
            f"{stage}: {refusal}; --skip-adapt runs quantize, eval and smoke without it (through transformers)"
        )


SKIPPED = "skipped"  # a plan's path when the stage does not run (`skipped`)


def skipped(stage: str, reason: str) -> StagePlan:
    """The plan of a stage that does not run: `run_pipeline` records `reason` in the manifest, and
    the gate and the report show the stage as skipped, with it."""
    return StagePlan(stage, 0, None, SKIPPED, reason)


class StageModule(Protocol):
    """What `pipeline.STAGE_MODULES` names: a module (`onboard/<stage>/stage.py`) with these two."""

    def plan(self, ctx: StageContext) -> StagePlan: ...

    def run(self, run_dir: "RunDir", ctx: StageContext) -> StageResult: ...
