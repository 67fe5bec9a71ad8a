"""How the speculator stage is sized and keyed: its engine's config, the key its captured data is
reused under, and the memory plan that picks the in-memory path (the engine generates, captures
and measures) or the streamed one (teacher-forced text, one decoder layer at a time)."""

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from onboard.budget import ModelShape, StagePlan, draft_training, estimate, plan_stage
from onboard.hashing import code_version, hash_json
from onboard.recipes import SpeculatorSettings
from onboard.speculator.capture import PACK_TOKENS

DATA_SETTINGS = {  # the settings the captured data depends on
    "draft",  # which states: EAGLE-3's auxiliary layers or the final ones MTP reads
    "traffic",
    "num_prompts",
    "max_prompt_tokens",
    "max_new_tokens",
    "responses_per_prompt",
    "response_temperature",
    "generation_concurrency",  # the batch compositions: how non-batch-invariant kernels round
    "stdlib_files",
    "teacher_forced_max_sequences",
    "max_seq_len",
}


def engine_config(settings: SpeculatorSettings, device: str = "cpu", numerics: str = "fast"):
    """The stage's one engine (generation, capture, measurement): `generation_concurrency`
    sequences at once, a KV cache that holds that many whole prompts and responses (and a capture
    pack), and a context length that fits the longest training sequence."""
    from onboard.engine import EngineConfig

    defaults = EngineConfig()
    block = defaults.block_size
    response = settings.max_prompt_tokens + settings.max_new_tokens
    max_model_len = max(defaults.max_model_len, response, settings.max_seq_len + 1)
    num_blocks = max(
        defaults.num_blocks,
        settings.generation_concurrency * -(-response // block),
        -(-max_model_len // block) + PACK_TOKENS // block,
    )
    return EngineConfig(
        device=device,
        numerics=numerics,
        max_num_seqs=settings.generation_concurrency,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        enable_prefix_caching=False,
    )


def capture_key(
    artifact_key: str,
    settings: SpeculatorSettings,
    data: Path | None,
    states_from: Path | None,
    numerics: str,
    answers_key: list[list[str]],
    path: str = "in-memory",
) -> str:
    """What the captured data depends on: reused only while this is unchanged. `path`: the
    memory plan's (generated responses in memory, teacher-forced text streamed)."""
    return hash_json(
        {
            "artifact": artifact_key,
            "states_from": str(Path(states_from).resolve()) if states_from else None,
            "data": str(Path(data).resolve()) if data else None,
            "numerics": numerics,  # exact and fast data are never mixed
            "teacher_forced_data": answers_key,
            "settings": settings.model_dump(include=DATA_SETTINGS),
            "aux_layers": settings.aux_layers,
            "path": path,
            "code": code_version(),
        }
    )


def _extra_sequences(settings: SpeculatorSettings) -> int:
    """Teacher-forced sequences either path adds: standard-library files and DATA answers."""
    code = settings.stdlib_files if settings.traffic in ("code", "mixed") else 0
    return code + (settings.teacher_forced_max_sequences if settings.teacher_forced_data else 0)


def generated_tokens(settings: SpeculatorSettings) -> int:
    """The most tokens of the in-memory path's data, every sequence at its longest: the generated
    responses and the teacher-forced text. Training loads the states of all of them at once."""
    response = settings.max_prompt_tokens + settings.max_new_tokens
    generated = settings.num_prompts * settings.responses_per_prompt * response
    return generated + _extra_sequences(settings) * settings.max_seq_len


def streamed_tokens_bound(settings: SpeculatorSettings) -> int:
    """The most tokens of the streamed path's data (`streamed_sequences`), each at `max_seq_len`."""
    return (settings.num_prompts + _extra_sequences(settings)) * settings.max_seq_len


def speculator_peaks(shape: ModelShape, settings: SpeculatorSettings, tokens: int) -> tuple[int, int]:
    """(in memory, streamed) bytes: the data of `tokens` tokens and its capture, then the draft's
    training on it (batches of `batch_sequences` x `max_seq_len`)."""
    in_memory, streamed = estimate("speculator", shape, tokens)
    batch_tokens = settings.batch_sequences * settings.max_seq_len
    training = draft_training(shape, batch_tokens, settings.num_speculative_tokens, settings.draft_vocab_size)
    return in_memory + training, (streamed or 0) + training


def speculator_plan(
    shape: ModelShape,
    settings: SpeculatorSettings,
    budget: int,
    endpoint: bool,
    streamed_tokens: Callable[[], int] | None = None,
) -> StagePlan:
    """In memory (the engine generates, captures and measures) where its data's bound fits
    `budget`, else streamed over `streamed_tokens()` tokens (the teacher-forced data, tokenized
    only when it comes to that; None: `streamed_tokens_bound`); a one-line OnboardError when
    neither fits (`budget.plan_stage`). The paths hold different data, so each is estimated on its
    own tokens."""
    options = "--endpoint URL"

    def peaks(tokens: int) -> tuple[int, int]:
        return speculator_peaks(shape, settings, tokens)

    # endpoint=True: never a refusal here, that is for the streamed estimate below to make
    generated = generated_tokens(settings)
    whole = plan_stage("speculator", shape, budget, generated, endpoint=True, options=options, peaks=peaks(generated))
    if whole.path == "in-memory":
        return whole
    tokens = streamed_tokens() if streamed_tokens is not None else streamed_tokens_bound(settings)
    plan = plan_stage("speculator", shape, budget, tokens, endpoint=endpoint, options=options, peaks=peaks(tokens))
    if plan.path == "in-memory":  # its own, smaller data would fit whole: streaming holds less still
        plan = replace(plan, path="streamed", bound="embeddings, head, one layer and the data's states")
    return replace(plan, in_memory=whole.in_memory)
