"""`smoke --endpoint` against `onboard serve` on loopback: the same loops as in-process smoke on a
model made to loop, a second server as the reference, batch invariance measured alone / among
concurrent requests / alone again, and a resumed run that does not ask again."""

import json
from pathlib import Path

import pytest
from server_thread import ServerThread

from onboard.endpoint import Endpoint, EndpointError, EndpointSpec
from onboard.endpoint.cache import RequestCache
from onboard.engine import EngineConfig, LLMEngine
from onboard.models import inspect_checkpoint, load_tokenizer
from onboard.server import build_app
from onboard.smoke.endpoint import EndpointGenerator, coarse_entropy, request_body, run_endpoint_smoke
from onboard.smoke.stage import run_smoke
from onboard.workspace import RunDir

from . import test_stage
from .test_stage import CONFIG, PROMPTS, make_run_dir

looping_checkpoint = test_stage.looping_checkpoint  # the fixtures, shared
prompts_file = test_stage.prompts_file


def _serve(path: Path, name: str):
    return ServerThread(build_app(LLMEngine(path, EngineConfig(num_blocks=1024)), name))


def test_coarse_entropy_is_a_lower_bound() -> None:
    import math

    probs = [0.5, 0.2, 0.1, 0.1, 0.1]
    exact = -sum(p * math.log(p) for p in probs)
    assert coarse_entropy([math.log(p) for p in probs]) == pytest.approx(exact)
    assert coarse_entropy([math.log(p) for p in probs[:2]]) < exact


def test_endpoint_smoke_finds_the_loops_in_process_smoke_finds(
    tiny_llama: Path, looping_checkpoint: Path, prompts_file: Path, tmp_path: Path
) -> None:
    local = make_run_dir(tmp_path / "local", looping_checkpoint, tiny_llama)
    with RunDir(local) as run:
        run_smoke(run, CONFIG, prompts_file)
    in_process = json.loads((local / "smoke/smoke.json").read_text())

    remote = make_run_dir(tmp_path / "remote", looping_checkpoint, tiny_llama)
    with _serve(looping_checkpoint, "looping") as url, RunDir(remote) as run:
        spec = EndpointSpec(url)
        run_endpoint_smoke(run, CONFIG, prompts_file, spec, None, "cpu")
    result = json.loads((remote / f"endpoints/{spec.slug}/smoke/smoke.json").read_text())
    assert result["served_model"] == "looping" and result["num_prompts"] == len(PROMPTS)
    assert result["loop_rate"] >= 0.9
    assert result["loop_rate"] - result["reference_loop_rate"] >= 0.5
    # Greedy decoding is the same model on both paths: the same loops, prompt by prompt.
    assert result["by_mode"]["greedy"]["loop_rate"] == in_process["by_mode"]["greedy"]["loop_rate"]
    assert result["by_mode"]["greedy"]["reference_loop_rate"] == in_process["by_mode"]["greedy"]["reference_loop_rate"]
    assert result["invariance"]["compositions"] == ["alone", "among concurrent sampled requests", "alone again"]
    assert result["invariance"]["prompts"] == CONFIG.invariance_prompts
    assert isinstance(result["batch_invariant"], bool)
    assert any(case["kind"] == "loop" for case in result["cases"])


def test_a_second_server_as_the_reference(
    tiny_llama: Path, looping_checkpoint: Path, prompts_file: Path, tmp_path: Path
) -> None:
    run_dir = make_run_dir(tmp_path / "run", looping_checkpoint, tiny_llama)
    config = CONFIG.model_copy(update={"num_prompts": 4, "invariance_prompts": 1})
    with _serve(looping_checkpoint, "looping") as url, _serve(tiny_llama, "reference") as ref_url:
        spec = EndpointSpec(url)
        with RunDir(run_dir) as run:
            run_endpoint_smoke(run, config, prompts_file, spec, EndpointSpec(ref_url), "cpu")
    result = json.loads((run_dir / f"endpoints/{spec.slug}/smoke/smoke.json").read_text())
    assert result["reference"] == EndpointSpec(ref_url).base
    assert result["loop_rate"] - result["reference_loop_rate"] >= 0.5


def test_token_ids_come_from_the_server_and_answers_are_kept(tiny_llama: Path, tmp_path: Path) -> None:
    tokenizer = load_tokenizer(inspect_checkpoint(tiny_llama))
    prompt = tokenizer.encode("Why is the sky blue?")
    cache = RequestCache(tmp_path / "cache")
    body = request_body(prompt, "greedy", CONFIG, 0, 12)
    with _serve(tiny_llama, "tiny") as url, Endpoint(EndpointSpec(url)) as endpoint:
        generator = EndpointGenerator(endpoint, cache, tokenizer)
        first = generator.complete(body, "greedy")
        assert len(first.token_ids) == len(first.entropies) > 0
        assert tokenizer.decode(first.token_ids) == first.text
    # The server is gone: the kept answer is all a resumed run needs.
    with Endpoint(EndpointSpec(url, served_model="tiny"), retries=0) as endpoint:
        again = EndpointGenerator(endpoint, cache, tokenizer)
        endpoint._model = "tiny"  # the server that named it is gone
        assert again.complete(body, "greedy") == first
        with pytest.raises(EndpointError, match="cannot reach"):
            again.complete({**body, "max_tokens": 13}, "greedy")
