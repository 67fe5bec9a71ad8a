"""The schema of `recipes/*.yaml`: per-family defaults for every stage, as data."""

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from onboard.errors import OnboardError
from onboard.paths import RECIPES_DIR

Scheme = Literal["nvfp4", "nvfp4a16", "fp8"]
Traffic = Literal["chat", "code", "math", "summarization", "structured"]

# Modules that stay in high precision whatever the scheme: the output projection, MoE
# routers (a misrouted token costs more than any weight error), and the vision/audio side of
# multimodal models. Embeddings are not Linear layers, so `targets: [Linear]` skips them.
NEVER_QUANTIZE = [
    "lm_head",
    "re:.*mlp\\.gate$",
    "re:.*block_sparse_moe\\.gate$",
    "re:.*shared_expert_gate$",
    "re:.*router.*",
    "re:.*(vision_tower|visual|vision_model|multi_modal_projector|mm_projector|audio_tower).*",
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Calibration(_Strict):
    num_samples: int = Field(64, gt=0)
    max_seq_length: int = Field(512, gt=1)
    # Built-in traffic sets used when no --calib DATA is given.
    traffic: list[Traffic] = ["chat", "code", "math", "summarization", "structured"]


class Quantize(_Strict):
    scheme: Scheme = "nvfp4"
    targets: list[str] = ["Linear"]
    ignore: list[str] = NEVER_QUANTIZE
    calibration: Calibration = Calibration()


class Eval(_Strict):
    max_tokens: int = Field(8192, gt=0)
    window: int = Field(512, gt=1)
    traffic: list[Traffic] = ["chat", "code", "math", "summarization", "structured"]


class Recipe(_Strict):
    name: str = "default"
    description: str = ""
    # transformers architecture class names this recipe is written for (config.architectures).
    architectures: list[str] = []
    quantize: Quantize = Quantize()
    eval: Eval = Eval()


def _describe(err: ValidationError) -> str:
    reasons = []
    for problem in err.errors():
        where = ".".join(str(part) for part in problem["loc"])
        if problem["type"] == "extra_forbidden":
            reasons.append(f"unknown key '{where}'")
        else:
            reasons.append(f"'{where}' = {problem.get('input')!r}: {problem['msg']}")
    return "; ".join(reasons)


def load_recipe(path: Path) -> Recipe:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError as err:
        raise OnboardError(f"recipe {path} does not exist") from err
    except (OSError, UnicodeDecodeError) as err:
        raise OnboardError(f"recipe {path} is unreadable: {err}") from err
    except yaml.YAMLError as err:
        raise OnboardError(f"recipe {path} is not valid YAML: {' '.join(str(err).split())}") from err
    if not isinstance(raw, dict):
        raise OnboardError(f"recipe {path} must be a YAML mapping of stage sections")
    try:
        return Recipe.model_validate(raw)
    except ValidationError as err:
        raise OnboardError(f"recipe {path}: {_describe(err)}") from err


def with_overrides(recipe: Recipe, overrides: dict[str, tuple[str, object]]) -> Recipe:
    """Apply CLI overrides, {"--num-samples": ("quantize.calibration.num_samples", 16)},
    validated by the same schema as the YAML, so `--max-seq-length 1` fails like a recipe would."""
    data = recipe.model_dump()
    for dotted, value in overrides.values():
        if value is None:
            continue
        *parents, leaf = dotted.split(".")
        node = data
        for part in parents:
            node = node[part]
        node[leaf] = value
    try:
        return Recipe.model_validate(data)
    except ValidationError as err:
        flags = {dotted: flag for flag, (dotted, _) in overrides.items()}
        problem = err.errors()[0]
        flag = flags.get(".".join(str(part) for part in problem["loc"]), "option")
        raise OnboardError(f"{flag} {problem.get('input')!r}: {problem['msg']}") from err


def shipped_recipes() -> list[Path]:
    return sorted(RECIPES_DIR.glob("*.yaml"))


def recipe_for(architectures: list[str]) -> tuple[Recipe, Path | None]:
    """The shipped recipe written for this architecture, else the schema's defaults."""
    for path in shipped_recipes():
        recipe = load_recipe(path)
        if set(recipe.architectures) & set(architectures):
            return recipe, path
    return Recipe(), None
