"""`eval --endpoint` against `onboard serve` on loopback: with the full vocabulary it is the
in-process KL of the served model; with top-k it bounds it from below, token by token; an
interrupted run resumes without asking again for what it had."""

import json
from pathlib import Path

import pytest
import torch
from artifacts import quantize_into
from server_thread import ServerThread

from onboard.endpoint import Endpoint, EndpointError, EndpointSpec
from onboard.endpoint.cache import RequestCache
from onboard.engine import EngineConfig, LLMEngine
from onboard.evaluate.endpoint import endpoint_kl, fetch_scores, run_endpoint_eval
from onboard.evaluate.kl import KLStats
from onboard.evaluate.logits import logit_chunks
from onboard.evaluate.stage import eval_windows, run_eval
from onboard.models import inspect_checkpoint, load_model, load_tokenizer
from onboard.recipes import Eval, Quantize
from onboard.server import build_app
from onboard.workspace import RunDir

EVAL = Eval(max_tokens=384, window=64, per_layer_tokens=0)
MODEL = "served"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Path:
    root = tmp_path_factory.mktemp("endpoint-eval")
    quantize_into(root, tiny_llama, Quantize(scheme="nvfp4a16"))
    with RunDir(root) as run:
        run_eval(run, EVAL, None)
    return root


@pytest.fixture(scope="module")
def served(run_dir: Path):
    engine = LLMEngine(run_dir / "artifact", EngineConfig(max_logprobs=-1, num_blocks=256))
    app = build_app(engine, MODEL)
    with ServerThread(app) as url:
        yield url, engine


@pytest.fixture(scope="module")
def windows(run_dir: Path):
    return eval_windows(load_tokenizer(inspect_checkpoint(run_dir / "artifact")), EVAL, None)


@pytest.fixture(scope="module")
def reference(run_dir: Path):
    quantize = json.loads((run_dir / "manifest.json").read_text())["stages"]["quantize"]
    return load_model(inspect_checkpoint(Path(quantize["inputs"]["model_path"])))


def _endpoint_stats(url: str, k: int, windows, reference, root: Path) -> KLStats:
    cache = RequestCache(root / f"cache-{k}")
    with Endpoint(EndpointSpec(url)) as endpoint:
        # One request at a time: batched with others, a CPU engine rounds differently (smoke's
        # batch-invariance check measures that), and this compares the estimators alone.
        keys = fetch_scores(endpoint, [w for _, w in windows], k, cache, concurrency=1)
    return endpoint_kl(reference, windows, keys, cache)["all"]


def _engine_stats(engine: LLMEngine, windows, reference) -> KLStats:
    """In process: the same served model's logits, scored by eval's own statistics."""
    stats = KLStats()
    for _, window in windows:
        ids = torch.tensor([window])
        ref = torch.cat(list(logit_chunks(reference, ids[:, :-1], 128)))
        # The whole window, as the server prefills it: a bf16 GEMM over 63 rows may round otherwise than over 64.
        stats.update(ref, engine.score(window)[:-1], ids[0, 1:])
    return stats


def test_full_vocabulary_equals_in_process_and_top_k_bounds_it(
    run_dir: Path, served, windows, reference, tmp_path: Path
) -> None:
    url, _ = served
    engine = LLMEngine(run_dir / "artifact", EngineConfig(num_blocks=256))  # the served engine is the server's
    in_process = _engine_stats(engine, windows, reference)
    full = _endpoint_stats(url, -1, windows, reference, tmp_path)
    top5 = _endpoint_stats(url, 5, windows, reference, tmp_path)
    exact, bound = in_process.kl_values(), top5.kl_values()
    assert exact.mean() > 1e-4  # a real difference to measure
    assert full.kl_values() == pytest.approx(exact, rel=1e-4, abs=1e-7)
    assert full.summary()["top1_agreement"] == in_process.summary()["top1_agreement"]
    assert full.summary()["ppl_quantized"] == pytest.approx(in_process.summary()["ppl_quantized"], rel=1e-5)
    assert (bound <= exact + 1e-6).all()  # the data-processing inequality, token by token
    assert bound.mean() < exact.mean()
    assert top5.summary()["ppl_quantized"] == pytest.approx(in_process.summary()["ppl_quantized"], rel=1e-5)


def test_endpoint_eval_writes_kl_json_and_matches_in_process_eval(run_dir: Path, served) -> None:
    url, _ = served
    spec = EndpointSpec(url)
    with RunDir(run_dir) as run:
        run_endpoint_eval(run, EVAL, None, spec, -1)
    result = json.loads((run_dir / f"endpoints/{spec.slug}/eval/kl.json").read_text())
    assert result["estimator"] == "full" and result["k"] == -1 and result["served_model"] == MODEL
    in_process = json.loads((run_dir / "eval/kl.json").read_text())
    assert result["num_tokens"] == in_process["num_tokens"]
    # The engine serving the artifact against transformers running it: the same KL up to the
    # engine's own rounding (its parity is adapt's business).
    assert result["mean_kld"] == pytest.approx(in_process["mean_kld"], rel=0.1)
    assert not (run_dir / ".cache" / "endpoints" / spec.slug / "eval").exists()  # removed when done
    with RunDir(run_dir) as run:
        run_endpoint_eval(run, EVAL, None, spec, 5)
    bounded = json.loads((run_dir / f"endpoints/{spec.slug}/eval/kl.json").read_text())
    assert bounded["estimator"] == "top_k_bucket" and bounded["k"] == 5
    assert bounded["mean_kld"] <= result["mean_kld"]


class _FailAfter:
    """ASGI wrapper: counts completion requests and refuses those after the first `limit`."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit, self.calls = app, limit, 0

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] == "/v1/completions":
            self.calls += 1
            if self.calls > self.limit:
                body = b'{"error": {"message": "interrupted"}}'
                await send(
                    {"type": "http.response.start", "status": 400, "headers": [(b"content-type", b"application/json")]}
                )
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def test_an_interrupted_run_resumes_without_asking_again(run_dir: Path, windows, tmp_path: Path) -> None:
    engine = LLMEngine(run_dir / "artifact", EngineConfig(max_logprobs=20, num_blocks=256))
    app = _FailAfter(build_app(engine, MODEL), limit=3)
    cache = RequestCache(tmp_path / "cache")
    token_windows = [w for _, w in windows]
    assert len(token_windows) > 4
    with ServerThread(app) as url, Endpoint(EndpointSpec(url)) as endpoint:
        with pytest.raises(EndpointError, match="interrupted"):
            fetch_scores(endpoint, token_windows, 5, cache)
        kept = sum(1 for _ in cache.root.rglob("*.npz"))
        assert 1 <= kept <= 3
        app.limit, app.calls = 10**6, 0
        fetch_scores(endpoint, token_windows, 5, cache)
        assert app.calls == len(token_windows) - kept
