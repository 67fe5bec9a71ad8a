"""Request bodies of the OpenAI API (and vLLM's extensions), and their translation to engine inputs.

Unknown fields are ignored, as OpenAI does; known ones are type-checked strictly (a string where a
number belongs is a 400, not a silent conversion). Range checks live in `SamplingParams.validate`.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from onboard.engine import MAX_LOGPROBS, GrammarSpec, SamplingParams, check_num_logprobs
from onboard.server.errors import APIError

SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts
MAX_TOP_K = 2**31 - 1
SAMPLING_FIELDS = {f for f in SamplingParams.__dataclass_fields__}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False, populate_by_name=True)


class StreamOptions(_Body):
    include_usage: bool = False


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs`: exactly one of these constraints."""

    json_: dict | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None


class GenerationRequest(_Body):
    """Fields both endpoints share: model, sampling, stop, streaming, structured outputs."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, le=MAX_TOP_K)
    min_p: float | None = None
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False  # vLLM's: the prompt's and the output's token ids on the choice
    prompt_logprobs: int | None = None  # vLLM: top-N logprobs at every prompt position (-1: all)
    n: int | None = None
    best_of: int | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's older names for the same thing
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check_unsupported(self) -> None:
        if self.n not in (None, 1):
            raise APIError("only n=1 is supported", param="n")
        if self.best_of not in (None, 1):
            raise APIError("only best_of=1 is supported", param="best_of")
        if self.logit_bias:
            raise APIError("logit_bias is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed with stream=true", param="stream_options")
        plp = self.prompt_logprobs
        if self.stream and plp is not None and (plp > 0 or plp == -1):  # vLLM's check and message
            raise APIError("`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs")

    def sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        *,
        max_logprobs: int = MAX_LOGPROBS,
        vocab_size: int | None = None,
    ) -> SamplingParams:
        """Engine sampling parameters (OpenAI defaults where unset); ValueError names a bad field.
        `logprobs` and `prompt_logprobs` may not exceed `max_logprobs` (the server's --max-logprobs)."""
        given = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "max_tokens": max_tokens,
            "stop": [self.stop] if isinstance(self.stop, str) else self.stop,
            "stop_token_ids": self.stop_token_ids,
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
        }
        params = SamplingParams(**{k: v for k, v in given.items() if v is not None}, ignore_eos=self.ignore_eos)
        params.validate(max_logprobs, vocab_size)
        return params

    def _structured(self) -> list[tuple[str, GrammarSpec]]:
        found: list[tuple[str, GrammarSpec]] = []
        so = self.structured_outputs
        if so is not None:
            if so.json_ is not None and so.json_ is not False:
                found.append(("structured_outputs.json", _json_spec(so.json_)))
            if so.regex is not None:
                found.append(("structured_outputs.regex", GrammarSpec("regex", so.regex)))
            if so.grammar is not None:
                found.append(("structured_outputs.grammar", GrammarSpec("grammar", so.grammar)))
            if so.choice is not None:
                found.append(("structured_outputs.choice", choice_grammar(so.choice)))
            if so.json_object:
                found.append(("structured_outputs.json_object", GrammarSpec("json_object")))
        if self.guided_json is not None:
            found.append(("guided_json", _json_spec(self.guided_json)))
        if self.guided_regex is not None:
            found.append(("guided_regex", GrammarSpec("regex", self.guided_regex)))
        if self.guided_choice is not None:
            found.append(("guided_choice", choice_grammar(self.guided_choice)))
        if self.guided_grammar is not None:
            found.append(("guided_grammar", GrammarSpec("grammar", self.guided_grammar)))
        return found

    def grammar(self) -> GrammarSpec | None:
        found = self._structured()
        if len(found) > 1:
            names = ", ".join(name for name, _ in found)
            raise APIError(f"give one structured-output constraint, not several ({names})", param=found[1][0])
        return found[0][1] if found else None


def _json_spec(schema: dict | bool | str) -> GrammarSpec:
    if schema is True:
        return GrammarSpec("json_object")
    return GrammarSpec("json_schema", schema if isinstance(schema, str) else json.dumps(schema))


def choice_grammar(choices: list[str]) -> GrammarSpec:
    """An EBNF grammar matching exactly one of `choices`."""
    if not choices:
        raise APIError("choice needs at least one option", param="structured_outputs.choice")
    return GrammarSpec("grammar", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.suffix:
            raise APIError("suffix is not supported", param="suffix")

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt alone comes back (scored when logprobs are asked for)."""
        return self.echo and self.max_tokens == 0

    def engine_max_tokens(self) -> int | None:
        # vLLM runs an echo-only request for one token and shows none of it.
        return 1 if self.echo_only else self.max_tokens

    def num_prompt_logprobs(self) -> int | None:
        """vLLM: `prompt_logprobs`, else with echo the prompt is scored like the completion (`logprobs`)."""
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs

    def single_prompt(self) -> str | list[int]:
        """The one prompt (a string or token ids); batches of several prompts are refused."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            if len(p) != 1:
                raise APIError("only one prompt per request is supported", param="prompt")
            return p[0]
        return p


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None

    def text(self, index: int) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise APIError(f"content parts of type {part.type!r} are not supported", param=f"messages.{index}")
            parts.append(part.text)
        return "".join(parts)


class JsonSchemaFormat(_Body):
    name: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    response_format: ResponseFormat | None = None

    def chat_messages(self) -> list[dict[str, Any]]:
        return [{"role": m.role, "content": m.text(i)} for i, m in enumerate(self.messages)]

    def num_logprobs(self, max_logprobs: int = MAX_LOGPROBS, vocab_size: int | None = None) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
        try:
            check_num_logprobs("top_logprobs", self.top_logprobs, max_logprobs, vocab_size)
        except ValueError as err:
            raise APIError(str(err), param="top_logprobs") from None
        return (self.top_logprobs or 0) if self.logprobs else None

    def grammar(self) -> GrammarSpec | None:
        spec = super().grammar()
        rf = self.response_format
        if rf is None or rf.type == "text":
            return spec
        if spec is not None:
            raise APIError("give either response_format or a structured-output constraint", param="response_format")
        if rf.type == "json_object":
            return GrammarSpec("json_object")
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise APIError("response_format json_schema needs json_schema.schema", param="response_format.json_schema")
        return GrammarSpec("json_schema", json.dumps(rf.json_schema.schema_))
