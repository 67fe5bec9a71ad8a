"""`onboard smoke RUN_DIR --endpoint URL`: the smoke detectors on what a server generates.

The artifact side is the server; the reference side is the local reference engine on the original
checkpoint, or a second server (`--reference-endpoint`). Every request is sent with the prompt's
token ids (both sides see identical inputs), many in flight at once, greedy and with seeded
sampling. Answers are kept on disk as they arrive, so an interrupted run resumes without asking
again.

Entropy: a server returns only its top-k log-probabilities, so both sides' per-step entropy is the
entropy of the distribution coarsened to {top k, the rest} (a lower bound of the true entropy),
computed the same way for the local engine, so that their ratio compares like with like.

Batch invariance is measured the way production breaks it: each checked greedy request alone,
then the same requests among many concurrent sampled ones, then alone again; the first position
where the tokens part is reported.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from onboard import atomic
from onboard.console import console
from onboard.data import ChatPrompt
from onboard.endpoint import Endpoint, EndpointSpec
from onboard.endpoint.cache import RequestCache
from onboard.endpoint.pool import in_flight
from onboard.hashing import fingerprint
from onboard.models import inspect_checkpoint, load_tokenizer
from onboard.paths import CALIBRATION_DIR
from onboard.recipes import Smoke
from onboard.smoke.analysis import Side, compare, smoke_table, worst_cases
from onboard.smoke.detectors import first_divergence
from onboard.smoke.passes import MODES, Output, generate
from onboard.smoke.prompts import smoke_prompts
from onboard.workspace import CACHE, SMOKE, at_endpoint, folder

TOP_LOGPROBS = 5  # per generated step: enough for the entropy estimate, small on the wire
CONCURRENCY = 16


def coarse_entropy(top_logprobs: Sequence[float]) -> float:
    """Entropy of {the returned tokens, the rest}: a lower bound of the step's entropy."""
    probs = [math.exp(lp) for lp in top_logprobs]
    rest = max(0.0, 1.0 - sum(probs))
    return -sum(p * math.log(p) for p in [*probs, rest] if p > 0)


def request_body(prompt: list[int], mode: str, config: Smoke, seed: int, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "logprobs": TOP_LOGPROBS,
        "return_token_ids": True,  # vLLM's and onboard's extension; otherwise the text is re-tokenized
    }
    if mode == "greedy":
        return {**body, "temperature": 0.0}
    return {**body, "temperature": config.temperature, "top_p": config.top_p, "seed": seed}


class EndpointGenerator:
    """Completions from one server, as smoke `Output`s; answers cached under `cache` by request."""

    def __init__(self, endpoint: Endpoint, cache: RequestCache, tokenizer: Any) -> None:
        self.endpoint = endpoint
        self.cache = cache
        self.tokenizer = tokenizer

    def complete(self, body: dict[str, Any], phase: str) -> Output:
        key = self.cache.key({"url": self.endpoint.spec.base, "model": self.endpoint.model, "phase": phase, **body})
        answer = self.cache.get_json(key)
        if answer is None:
            choice = self.endpoint.post("/v1/completions", body)["choices"][0]
            token_ids = choice.get("token_ids")
            if token_ids is None:
                token_ids = self.tokenizer.encode(choice["text"], add_special_tokens=False)
            logprobs = choice.get("logprobs") or {}
            tops = [list((top or {}).values()) for top in logprobs.get("top_logprobs") or []]
            answer = {
                "token_ids": list(token_ids),
                "text": choice["text"],
                "finish_reason": choice.get("finish_reason"),
            }
            answer["entropies"] = [coarse_entropy(top) for top in tops]
            self.cache.put_json(key, answer)
        return Output(answer["token_ids"], answer["text"], answer["finish_reason"], answer["entropies"])

    def run(self, bodies: list[dict[str, Any]], phase: str, label: str, concurrency: int = CONCURRENCY) -> list[Output]:
        return in_flight(bodies, lambda body: self.complete(body, phase), concurrency, label)


class EngineGenerator:
    """The local reference engine behind the same interface (entropies estimated alike)."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def run(self, bodies: list[dict[str, Any]], phase: str, label: str, concurrency: int = CONCURRENCY) -> list[Output]:
        from onboard.engine import SamplingParams

        params = []
        for body in bodies:
            fields = {k: body[k] for k in ("temperature", "top_p", "seed", "max_tokens") if k in body}
            params.append(SamplingParams(**fields, logprobs=TOP_LOGPROBS))
        prompts = [list(body["prompt"]) for body in bodies]
        coarse = lambda entry: coarse_entropy([lp for _, lp in entry["top"]])  # noqa: E731
        return generate(self.engine, prompts, params, label, entropy=coarse).outputs


def _passes(generator, prompts: list[ChatPrompt], config: Smoke, label: str) -> dict[str, list[Output]]:
    by_mode = {}
    for mode in MODES:
        bodies = [
            request_body(p.token_ids, mode, config, config.seed + i, config.max_tokens) for i, p in enumerate(prompts)
        ]
        by_mode[mode] = generator.run(bodies, mode, f"{label}, {mode}")
    return by_mode


def batch_invariance(generator: EndpointGenerator, prompts: list[ChatPrompt], config: Smoke) -> dict[str, Any]:
    """Greedy alone, among concurrent sampled requests, alone again; the first divergences."""
    chosen = [p.token_ids for p in prompts[: config.invariance_prompts]]
    if not chosen:
        return {"prompts": 0, "compositions": [], "diverged": []}
    greedy = [request_body(p, "greedy", config, 0, config.invariance_max_tokens) for p in chosen]
    alone = generator.run(greedy, "alone", "invariance: alone", concurrency=1)
    others = [p.token_ids for p in prompts[len(chosen) :]] or chosen
    sampled = [
        request_body(others[i % len(others)], "sampled", config, config.seed + 1000 + i, config.invariance_max_tokens)
        for i in range(max(3 * len(chosen), CONCURRENCY - len(chosen)))
    ]
    crowd = generator.run(greedy + sampled, "crowd", "invariance: among others", concurrency=len(greedy + sampled))
    again = generator.run(greedy, "again", "invariance: alone again", concurrency=1)
    runs = {"among concurrent sampled requests": crowd[: len(chosen)], "alone again": again}
    diverged = []
    for composition, outputs in runs.items():
        for i, output in enumerate(outputs):
            position = first_divergence(alone[i].token_ids, output.token_ids)
            if position is not None:
                diverged.append({"prompt": i, "composition": composition, "first_divergence": position})
    return {"prompts": len(chosen), "compositions": ["alone", *runs], "diverged": diverged}


def measure_endpoint_smoke(
    artifact: EndpointGenerator,
    reference,
    prompts: list[ChatPrompt],
    config: Smoke,
    decode: Callable[[list[int]], str],
) -> dict[str, Any]:
    reference_outputs = _passes(reference, prompts, config, "reference")
    invariance = batch_invariance(artifact, prompts, config)
    artifact_outputs = _passes(artifact, prompts, config, "endpoint")
    mine, theirs = Side(artifact_outputs, config), Side(reference_outputs, config)
    return {
        "num_prompts": len(prompts),
        "max_tokens": config.max_tokens,
        "modes": list(MODES),
        "entropy_estimator": f"top-{TOP_LOGPROBS} + rest (a lower bound), both sides",
        **compare(mine, theirs, MODES),
        "batch_invariant": not invariance["diverged"],
        "invariance": invariance,
        "cases": worst_cases(mine, theirs, prompts, decode, config.num_examples),
    }


def run_endpoint_smoke(
    run,
    config: Smoke,
    data: Path | None,
    spec: EndpointSpec,
    reference_spec: EndpointSpec | None,
    device: str,
    numerics: str = "fast",
) -> dict[str, Any]:
    """`device`/`numerics`: the local reference engine's, when no reference endpoint is given."""
    run.require("quantize")
    reference_path = run.source
    cache = RequestCache(run.path(CACHE) / at_endpoint(spec.slug, folder(SMOKE)))
    endpoint = Endpoint(spec)
    reference_endpoint = Endpoint(reference_spec) if reference_spec else None
    result_file = at_endpoint(spec.slug, SMOKE)

    def body(stage) -> dict[str, Any]:
        tokenizer = load_tokenizer(inspect_checkpoint(run.artifact))
        prompts = smoke_prompts(tokenizer, config, data)
        artifact = EndpointGenerator(endpoint, cache, tokenizer)
        if reference_endpoint is not None:
            reference = EndpointGenerator(reference_endpoint, cache, tokenizer)
        else:
            from onboard.engine import EngineConfig, LLMEngine

            engine_config = EngineConfig(device=device, numerics=numerics, num_blocks=8192)
            reference = EngineGenerator(LLMEngine(reference_path, engine_config))
        decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        result = measure_endpoint_smoke(artifact, reference, prompts, config, decode)
        result["endpoint"] = spec.base
        result["served_model"] = endpoint.model
        result["reference"] = reference_spec.base if reference_spec else str(reference_path)
        atomic.write_json(stage.path(result_file), result)
        keys = ("loop_rate", "reference_loop_rate", "no_eos_rate", "distinct_2", "entropy_ratio", "batch_invariant")
        return {k: result[k] for k in keys}

    inputs = {
        "endpoint": spec.base,
        "served_model": endpoint.model,
        "reference": reference_spec.base if reference_spec else [fingerprint(reference_path), numerics],
        "smoke": config.model_dump(),
        "data": fingerprint(data) if data else f"builtin:{fingerprint(CALIBRATION_DIR)}",
        "session": cache.session,
    }
    try:
        entry = run.run_stage(f"smoke@{spec.slug}", inputs, outputs=[at_endpoint(spec.slug, folder(SMOKE))], body=body)
    finally:
        endpoint.close()
        if reference_endpoint is not None:
            reference_endpoint.close()
    cache.clear()
    console.print(smoke_table(json.loads(run.path(result_file).read_text())))
    return entry
