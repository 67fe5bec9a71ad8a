"""`onboard eval RUN_DIR --endpoint URL`: the KL of the model a server actually serves.

Two phases, so that the server and the local reference never compete for the same cores: first
every held-out window is scored by the server (many requests in flight; each answer kept on disk
as it arrives, so an interrupted run resumes without asking again), then the reference runs
locally in transformers, as in-process eval does, and each window's statistics are added.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from onboard import atomic
from onboard.console import console
from onboard.endpoint import Endpoint, EndpointSpec
from onboard.endpoint.cache import RequestCache
from onboard.endpoint.pool import in_flight
from onboard.endpoint.scores import FULL_VOCAB, PromptScores, score_body, score_prompt
from onboard.evaluate.kl import KLStats
from onboard.evaluate.logits import logit_chunks
from onboard.evaluate.stage import CHUNK, eval_windows, kl_table
from onboard.hashing import fingerprint
from onboard.memory import release_freed_memory
from onboard.models import inspect_checkpoint, load_model, load_tokenizer
from onboard.paths import CALIBRATION_DIR
from onboard.recipes import Eval
from onboard.workspace import CACHE, KL, RunDir, Stage, at_endpoint, folder

CONCURRENCY = 4  # requests in flight while scoring: enough to keep a server's batch full


def fetch_scores(
    endpoint: Endpoint, windows: list[list[int]], k: int, cache: RequestCache, concurrency: int = CONCURRENCY
) -> list[str]:
    """Every window scored by the server, kept in `cache`; returns each window's cache key."""
    keys = [cache.key({"model": endpoint.model, "url": endpoint.spec.base, **score_body(w, k)}) for w in windows]
    missing = [(key, w) for key, w in zip(keys, windows, strict=True) if cache.get_arrays(key) is None]
    if len(missing) < len(windows):
        console.print(f"eval: {len(windows) - len(missing)} of {len(windows)} windows already scored; resuming")

    def fetch(item: tuple[str, list[int]]) -> None:
        key, window = item
        cache.put_arrays(key, score_prompt(endpoint, window, k).to_arrays())

    in_flight(missing, fetch, concurrency, f"scoring on {endpoint.spec.base}")
    return keys


@torch.inference_mode()
def endpoint_kl(
    reference, windows: list[tuple[str, list[int]]], keys: list[str], cache: RequestCache
) -> dict[str, KLStats]:
    stats: dict[str, KLStats] = {"all": KLStats()}
    for (traffic, window), key in zip(windows, keys, strict=True):
        arrays = cache.get_arrays(key)
        if arrays is None:
            raise RuntimeError(f"window {key} was scored but its answer is gone from {cache.root}")
        scores = PromptScores(**arrays)
        ids = torch.tensor([window])
        targets = ids[0, 1:]
        start = 0
        for ref_chunk in logit_chunks(reference, ids[:, :-1], CHUNK):
            rows = slice(start, start + len(ref_chunk))
            for name in ("all", traffic):
                stats.setdefault(name, KLStats()).update_scored(
                    ref_chunk,
                    torch.from_numpy(scores.token_ids[rows]),
                    torch.from_numpy(scores.logprobs[rows]),
                    torch.from_numpy(scores.target_logprobs[rows]),
                    targets[rows],
                )
            start += len(ref_chunk)
        release_freed_memory()
    return stats


def run_endpoint_eval(
    run: RunDir, settings: Eval, data: Path | None, spec: EndpointSpec, k: int, out: Path | None = None
) -> dict[str, Any]:
    quantize = run.require("quantize")
    reference_path = run.source
    cache = RequestCache(run.path(CACHE) / at_endpoint(spec.slug, folder(KL)))
    endpoint = Endpoint(spec)
    name = f"eval@{spec.slug}"
    result_file = at_endpoint(spec.slug, KL)

    def body(stage: Stage) -> dict[str, Any]:
        torch.manual_seed(0)
        tokenizer = load_tokenizer(inspect_checkpoint(run.artifact))
        windows = eval_windows(tokenizer, settings, data)
        # A whole-vocabulary answer is vocab x window numbers (SmolLM2: 6M for 128 tokens): one at a time.
        concurrency = 1 if k == FULL_VOCAB else CONCURRENCY
        keys = fetch_scores(endpoint, [w for _, w in windows], k, cache, concurrency)
        reference = load_model(inspect_checkpoint(reference_path))
        stats = endpoint_kl(reference, windows, keys, cache)
        overall = stats.pop("all")
        result = {
            **overall.summary(),
            "effective_bits": quantize["metrics"]["effective_bits"],
            "estimator": "full" if k == FULL_VOCAB else "top_k_bucket",
            "k": k,
            "endpoint": spec.base,
            "served_model": endpoint.model,
            "histogram": overall.histogram(),
            "data": str(data) if data else "builtin:eval",
            "by_traffic": {traffic: s.summary() for traffic, s in stats.items()},
        }
        atomic.write_json(stage.path(result_file), result)
        return {key: result[key] for key in ("mean_kld", "top1_agreement", "num_tokens", "estimator", "k")}

    inputs = {
        "reference": fingerprint(reference_path),
        "endpoint": spec.base,
        "served_model": endpoint.model,
        "k": k,
        "eval": settings.model_dump(),
        "data": fingerprint(data) if data else f"builtin:{fingerprint(CALIBRATION_DIR)}",
        "session": cache.session,  # a finished check is redone next time; an interrupted one resumes
    }
    try:
        entry = run.run_stage(name, inputs, outputs=[at_endpoint(spec.slug, folder(KL))], body=body)
    finally:
        endpoint.close()
    cache.clear()
    result = json.loads(run.path(result_file).read_text())
    label = "full vocabulary" if k == FULL_VOCAB else f"top-{k} + rest (a lower bound)"
    console.print(kl_table(result, f"KL divergence served by {spec.base} ({endpoint.model}), {label}"))
    if out:
        atomic.write_json(out, result)
    return entry
