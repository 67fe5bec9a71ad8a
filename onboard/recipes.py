"""The schema of `recipes/*.yaml`: per-family defaults for every stage, as data."""

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from onboard.errors import OnboardError
from onboard.paths import RECIPES_DIR

Scheme = Literal["nvfp4", "nvfp4a16", "fp8", "auto"]
Base = Literal["nvfp4", "nvfp4a16"]  # the formats `auto` starts from
Format = Literal["nvfp4", "nvfp4a16", "fp8", "fp8_weight", "bf16"]
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
    "re:.*\\.indexer\\..*",  # DSA's lightning indexer: a discrete top-k selection
    "re:.*(vision_tower|visual|vision_model|multi_modal_projector|mm_projector|audio_tower).*",
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Calibration(_Strict):
    num_samples: int = Field(64, gt=0)
    max_seq_length: int = Field(512, gt=1)
    # Built-in traffic sets used when no --calib DATA is given.
    traffic: list[Traffic] = ["chat", "code", "math", "summarization", "structured"]


Observer = Literal["minmax", "mse", "nvfp4_expanded_mse", "imatrix_mse", "nvfp4_expanded_imatrix"]

# The names `--method` and `quantize.method: NAME` compose with "+" (gptq+expanded_mse), each
# setting some of Method's fields; the canonical name lists them in llm-compressor's order.
METHOD_PARTS: dict[str, dict[str, object]] = {
    "smoothquant": {"smoothing": "smoothquant"},
    "awq": {"smoothing": "awq"},
    "spinquant": {"rotations": ["R1", "R2"]},
    "rtn": {"algorithm": "rtn"},
    "gptq": {"algorithm": "gptq"},
    "autoround": {"algorithm": "autoround"},
    "minmax": {"observer": "minmax"},
    "mse": {"observer": "mse"},
    "expanded_mse": {"observer": "nvfp4_expanded_mse"},
    "fouroversix": {"observer": "nvfp4_expanded_mse"},  # llm-compressor's alias
    "imatrix": {"observer": "imatrix_mse"},
    "expanded_imatrix": {"observer": "nvfp4_expanded_imatrix"},
}


# the fields the named parts set; every other field of Method is an option (`field=value`)
_PART_FIELDS = frozenset(key for fields in METHOD_PARTS.values() for key in fields)


class Method(_Strict):
    """How weights and activations are prepared and rounded: llm-compressor's levers that keep the
    artifact a plain compressed-tensors checkpoint (no runtime op), composed in its order:
    smoothing, then rotations fused into the weights, then the quantizer with its weight observer."""

    smoothing: Literal["none", "smoothquant", "awq"] = "none"
    smoothing_strength: float = Field(0.5, gt=0, lt=1)  # SmoothQuant's alpha
    # SpinQuant's offline rotations (R1: the residual stream, R2: each head's values), fused into the
    # weights. Online rotations (R3/R4, QuIP) need runtime ops and are not offered.
    rotations: list[Literal["R1", "R2"]] = []
    # Hadamard blocks of this size (None: the hidden size, which must then have a Hadamard matrix;
    # SmolLM2's 576 does not, 64 divides it and every head).
    rotation_block: int | None = Field(64, gt=0)
    rotation_type: Literal["hadamard", "random-hadamard"] = "random-hadamard"
    algorithm: Literal["rtn", "gptq", "autoround"] = "rtn"
    observer: Observer = "minmax"  # of the weight scales; minmax is the preset's own
    gptq_actorder: Literal["static", "group", "weight"] | None = "static"
    gptq_dampening: float = Field(0.01, gt=0)
    autoround_iters: int = Field(20, gt=0)  # AutoRound's default 200 is sized for a GPU

    @property
    def name(self) -> str:
        """The parts in llm-compressor's order, then every option off its default as `field=value`
        (`awq+gptq+expanded_mse+gptq_dampening=0.1`): one name per method, which `parse` reads back."""
        defaults = Method()
        parts = []
        for part, fields in METHOD_PARTS.items():
            if part in ("rtn", "minmax", "fouroversix"):
                continue
            if all(getattr(self, k) == v for k, v in fields.items()) and any(
                getattr(defaults, k) != v for k, v in fields.items()
            ):
                parts.append(part)
        options = [
            f"{key}={'none' if value is None else value}"
            for key, value in self
            if key not in _PART_FIELDS and value != getattr(defaults, key)
        ]
        return "+".join((parts or ["rtn"]) + options)

    @classmethod
    def parse(cls, name: str) -> dict[str, object]:
        fields: dict[str, object] = {}
        for part in (part.strip() for part in name.split("+")):
            key, sep, text = part.partition("=")
            if sep:
                if key not in cls.model_fields or key in _PART_FIELDS:
                    options = ", ".join(k for k in cls.model_fields if k not in _PART_FIELDS)
                    raise ValueError(f"unknown method option {key!r}; options: {options}")
                given = {key: None if text == "none" else text}
            elif part in METHOD_PARTS:
                given = METHOD_PARTS[part]
            else:
                raise ValueError(f"unknown method part {part!r}; compose with + from {', '.join(METHOD_PARTS)}")
            for key, value in given.items():
                if key in fields and fields[key] != value:
                    raise ValueError(f"{name!r} sets {key} twice")
                fields[key] = value
        return fields

    @model_validator(mode="after")
    def _one_weight_rounding(self) -> "Method":
        if self.algorithm == "autoround" and self.observer != "minmax":
            raise ValueError("autoround tunes the weight scales itself: it takes no observer")
        return self


class Search(_Strict):
    """The layer-selection search of `scheme: auto`: KL measured on calibration text."""

    tokens: int = Field(2048, gt=1)  # calibration tokens every candidate is scored on
    steps: int = Field(32, ge=0)  # measured candidates after the additive start


class Quantize(_Strict):
    scheme: Scheme = "nvfp4"
    base: Base = "nvfp4"  # `auto`: the format every group starts in, upgraded where the budget allows
    bits_budget: float | None = Field(None, gt=0)  # `auto`: effective bits per quantizable weight
    # A Method, a method name ("gptq+expanded_mse"), or auto: the candidates measured on calibration
    # text by end-to-end KL, a lever kept only when it gains beyond two standard errors.
    method: Method | Literal["auto"] = Method()
    # Left out, on SmolLM2's figures (docs/benchmarks.md, issue #24): SpinQuant, which raised the KL,
    # and AutoRound, which took longer than AWQ for a higher KL.
    candidates: list[str] = [
        "expanded_mse",
        "expanded_imatrix",
        "gptq+expanded_mse",
        "awq",
        "awq+gptq+expanded_mse+gptq_dampening=0.1",
    ]
    # After the method: NVFP4 block scales trained on KL to the unquantized model over this many
    # calibration tokens (0: none), kept only if the calibration KL does not rise.
    distill_tokens: int = Field(0, ge=0)
    targets: list[str] = ["Linear"]
    ignore: list[str] = NEVER_QUANTIZE
    calibration: Calibration = Calibration()
    search: Search = Search()
    # Pinned per-module formats over the scheme (module-name patterns, as `ignore`): how a
    # selection found by `auto` is replayed without searching (selection.json's `pinned`).
    formats: dict[Format, list[str]] = {}

    @field_validator("method", mode="before")
    @classmethod
    def _method_by_name(cls, value: object) -> object:
        return Method.parse(value) if isinstance(value, str) and value != "auto" else value

    @field_validator("candidates")
    @classmethod
    def _candidates_parse(cls, value: list[str]) -> list[str]:
        for name in value:
            Method.parse(name)
        return value

    @model_validator(mode="after")
    def _auto_needs_budget(self) -> "Quantize":
        if self.scheme == "auto" and self.bits_budget is None:
            raise ValueError("scheme auto needs a bits budget (--bits-budget B)")
        if self.scheme != "auto" and self.bits_budget is not None:
            raise ValueError("a bits budget is only read by scheme auto")
        if self.scheme == "auto" and self.formats:
            raise ValueError("scheme auto searches the formats: pin them (formats) or search, not both")
        if self.distill_tokens and self.scheme == "fp8":
            raise ValueError("distill_tokens trains NVFP4 block scales: scheme fp8 has none")
        if self.distill_tokens == 1:
            raise ValueError("distill_tokens: at least 2 tokens (one next-token distribution)")
        method = self.method
        if isinstance(method, Method) and method.algorithm == "autoround":
            fmt = self.base if self.scheme == "auto" else self.scheme
            if fmt != "nvfp4":
                raise ValueError(f"autoround tunes NVFP4 W4A4 (auto-round's NVFP4 preset), not {fmt}")
        return self


class Eval(_Strict):
    max_tokens: int = Field(8192, gt=0)
    window: int = Field(512, gt=1)
    per_layer_tokens: int = Field(2048, ge=0)  # held-out tokens of the per-layer KL (0: not measured)
    traffic: list[Traffic] = ["chat", "code", "math", "summarization", "structured"]


class SpeculatorSettings(_Strict):
    # eagle3: train an EAGLE-3 head; mtp: fine-tune the artifact's own MTP layers (DeepSeek-V3/V3.2,
    # GLM-5) on its states, written back into it when they accept more.
    draft: Literal["eagle3", "mtp"] = "eagle3"
    traffic: Literal["chat", "code", "math", "mixed"] = "mixed"
    num_prompts: int = Field(400, gt=0)
    max_prompt_tokens: int = Field(256, gt=1)
    max_new_tokens: int = Field(192, gt=0)  # per response regenerated by the target
    responses_per_prompt: int = Field(4, gt=0)  # the greedy one, then sampled ones
    response_temperature: float = Field(0.8, gt=0)
    # Requests the engine runs at once while generating them (its max_num_seqs; the KV cache is
    # sized to hold that many prompts and responses).
    generation_concurrency: int = Field(64, gt=0)
    stdlib_files: int = Field(24, ge=0)  # teacher-forced standard-library code (code and mixed traffic)
    # DATA files whose rows carry answers (gsm8k question/answer, alpaca/self-instruct outputs, chat
    # ending in an assistant turn), teacher-forced: the answers are trained on with the target's own
    # distributions, nothing generated. Relative paths start at the current directory.
    teacher_forced_data: list[str] = []
    teacher_forced_max_sequences: int = Field(2000, gt=0)  # of those files' answers, in all
    # Start the draft's decoder layer from the target's last one (MLP, o_proj, norms, the q/k/v
    # columns reading the fused state) instead of random weights; MoE/MLA last layers stay random.
    init_from_last_layer: bool = False
    draft_vocab_size: int = Field(8192, gt=0)
    aux_layers: list[int] | None = None  # None: low/mid/high, layers 2, L//2, L-3
    num_speculative_tokens: int = Field(3, gt=0)
    epochs: int = Field(3, gt=0)
    learning_rate: float = Field(1e-3, gt=0)
    batch_sequences: int = Field(4, gt=0)
    max_seq_len: int = Field(512, gt=2)
    eval_prompts: int = Field(24, ge=0)  # held-out prompts the acceptance is measured on
    eval_max_tokens: int = Field(96, gt=0)


class Adapt(_Strict):
    # Built-in eval prompts whose greedy continuations (64 tokens) and teacher-forced logits are
    # compared with transformers'; the parity stage's time grows with it (24 s a prompt for the
    # demo's mixed artifact on 2 cores).
    num_prompts: int = Field(16, gt=0)


class Smoke(_Strict):
    num_prompts: int = Field(120, gt=0)  # built-in prompts, every traffic type (eval split first)
    max_tokens: int = Field(512, gt=0)
    temperature: float = Field(0.8, gt=0)  # the seeded-sampling pass; the other pass is greedy
    top_p: float = Field(0.95, gt=0, le=1)
    seed: int = 0
    loop_min_period: int = Field(1, gt=0)
    loop_max_period: int = Field(64, gt=0)
    loop_min_repeats: int = Field(3, ge=2)
    loop_min_span: int = Field(32, gt=0)
    near_duplicate_similarity: float = Field(0.9, gt=0, le=1)  # Jaccard of token 4-gram sets
    invariance_prompts: int = Field(8, ge=0)  # greedy outputs compared across batch compositions
    invariance_max_tokens: int = Field(128, gt=0)
    num_examples: int = Field(8, ge=0)  # worst cases kept in smoke.json


class Gate(_Strict):
    """Release thresholds; `onboard gate` checks each and `--set name=value` overrides one."""

    # A source's MTP layers (its own speculator) are in the artifact, so `method: mtp` serves.
    require_mtp_kept: bool = True
    # A VLM's vision tower and projector are in the artifact as the source stores them.
    require_vision_kept: bool = True
    max_mean_kld: float = Field(0.5, ge=0)
    min_top1_agreement: float = Field(0.6, ge=0, le=1)
    min_acceptance_length: float = Field(1.2, ge=1)
    max_loop_rate_excess: float = Field(0.1, ge=0)  # artifact loop rate minus the reference's
    max_run_on_excess: float = Field(0.1, ge=0)
    max_near_duplicate_excess: float = Field(0.1, ge=0)
    min_entropy_ratio: float = Field(0.5, ge=0)  # artifact mean entropy over the reference's
    max_garbage_excess: float = Field(0.05, ge=0, le=1)  # outputs with bad UTF-8 or control characters
    max_parity_logit_diff: float = Field(0.5, ge=0)
    min_parity_top1_agreement: float = Field(0.99, ge=0, le=1)
    require_batch_invariance: bool = True
    # adapt's fast numerics (what serve runs): its greedy continuations part from transformers'
    # only at near-ties (parity.json `fast.logprobs_close`).
    require_fast_parity: bool = True
    # Artifacts that quantize activations to 4 bits (parity.json rule `layerwise_distribution`)
    # replace the three parity checks above: each W4A4 linear re-quantizes its input, so a
    # last-bit kernel difference grows into other tokens and no token rule holds on another
    # machine.  KL(transformers || engine) over transformers' own floor, KL(transformers ||
    # transformers on inputs moved by one ulp), the worse numerics: on the demo's mixed artifact
    # under ONEDNN_MAX_CPU_ISA=AVX512_CORE, fast numerics' kernels give 0.90 (0.19 nats against a
    # 0.21 floor) and transformers with oneDNN off 1.02; twice the floor is two such differences.
    max_parity_kl_ratio: float = Field(2.0, ge=0)
    # |KL(source || engine) - KL(source || transformers)| over the latter: the damage served is the
    # damage measured.  Measured there: a kernel difference moves it by 1.1-7.4 % (fast numerics
    # 7.4 %, standard error 1.9 %; transformers with oneDNN off 1.1 %), a 5 % scaled o_proj in one
    # layer by 17 % (2.5 %).
    max_parity_damage_diff: float = Field(0.10, ge=0)
    # Each decoder layer's RMS error on transformers' own input, over its floor (the output's move
    # when the input rounds the other way in the last bit; adapt/layerwise.py).
    max_parity_layer_ratio: float = Field(4.0, ge=0)
    # Each linear on transformers' own input for it, over its output's rounding step: a kernel
    # difference stays below 1 (0.003 measured for a layer in fp32), a 5 % scaled o_proj gives 8.7.
    max_parity_linear_ratio: float = Field(2.0, ge=0)


class Deployment(_Strict):
    """Where `onboard run` sends the stages that generate when the model is over the memory
    budget: a server of the artifact (with its speculator) and one of the unquantized reference."""

    endpoint: str | None = None
    served_model: str | None = None
    reference_endpoint: str | None = None
    reference_model: str | None = None


class Recipe(_Strict):
    name: str = "default"
    description: str = ""
    # transformers architecture class names this recipe is written for (config.architectures).
    architectures: list[str] = []
    quantize: Quantize = Quantize()
    eval: Eval = Eval()
    speculator: SpeculatorSettings = SpeculatorSettings()
    adapt: Adapt = Adapt()
    smoke: Smoke = Smoke()
    gate: Gate = Gate()
    deployment: Deployment = Deployment()


def describe(err: ValidationError) -> str:
    """One line naming each bad key of a recipe (or of a section of one)."""
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
        raise OnboardError(f"recipe {path}: {describe(err)}") from err


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
        where = ".".join(str(part) for part in problem["loc"])
        # the flag that set the key, or a key inside it (--method's gptq_dampening=x)
        dotted = next((d for d in flags if where == d or where.startswith(d + ".")), None)
        if dotted is None:  # a rule across keys (a model validator): its message says it all
            raise OnboardError(problem["msg"].removeprefix("Value error, ")) from err
        inside = str(problem["loc"][-1]) if where != dotted else ""  # (the loc may name a union's branch)
        given = f"{inside}={problem.get('input')!r}" if inside else repr(problem.get("input"))
        raise OnboardError(f"{flags[dotted]} {given}: {problem['msg']}") from err


def shipped_recipes() -> list[Path]:
    return sorted(RECIPES_DIR.glob("*.yaml"))


def recipe_for(architectures: list[str]) -> tuple[Recipe, Path | None]:
    """The shipped recipe written for this architecture, else the schema's defaults."""
    for path in shipped_recipes():
        recipe = load_recipe(path)
        if set(recipe.architectures) & set(architectures):
            return recipe, path
    return Recipe(), None
