"""A speculator's acceptance from a server's Prometheus counters: the same figures the server's engine
counts, and the in-process measurement reports, for the same greedy workload; a one-line error on a
server without a draft."""

import copy
import json
from pathlib import Path

import pytest
import torch
from cli_run import onboard, one_line_error
from server_thread import ServerThread
from transformers import AutoConfig

from onboard.endpoint import Endpoint, EndpointError, EndpointSpec
from onboard.endpoint.acceptance import measure_endpoint_acceptance
from onboard.endpoint.prometheus import parse, spec_counters, total
from onboard.engine.config import EngineConfig
from onboard.engine.llm_engine import LLMEngine
from onboard.recipes import Recipe
from onboard.server import build_app
from onboard.speculator.draft import Eagle3Draft, draft_layer_config
from onboard.speculator.measure import held_out_prompts, measure_acceptance

K = 3
MAX_TOKENS = 24
CONFIG = EngineConfig(max_model_len=512, num_blocks=256, enable_prefix_caching=False)

VLLM_METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 5.0
vllm:spec_decode_num_drafts_total{engine="0",model_name="other"} 99.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 45.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 12.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 7.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="0"} 1.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 1.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 3.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 4.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 2.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 6.0
weird{label="a \\"quoted\\" \\\\ value"} NaN
"""


def test_vllm_names_with_engines_and_models() -> None:
    samples = parse(VLLM_METRICS)
    counters = spec_counters(samples, "m")
    assert counters is not None
    assert (counters.num_drafts, counters.num_draft_tokens, counters.num_accepted_tokens) == (15.0, 45.0, 12.0)
    assert counters.accepted_per_position == (8.0, 3.0, 1.0)
    assert total(samples, "vllm:request_success_total", "m") == 6.0
    assert spec_counters(samples, "alias").num_drafts == 114.0  # no series of that name: all of them
    assert total(samples, "request_success", "m", finished_reason="stop") == 2.0
    assert [s.labels["label"] for s in samples if s.name == "weird"] == ['a "quoted" \\ value']
    # Without a namespace or the _total suffix, as a server might expose them.
    bare = parse("spec_decode_num_drafts 4\nspec_decode_num_accepted_tokens 2\n")
    assert spec_counters(bare) == spec_counters(parse("onboard_spec_decode_num_drafts_total 4\n")) + spec_counters(
        parse("onboard_spec_decode_num_accepted_tokens_total 2\nonboard_spec_decode_num_drafts_total 0\n")
    )
    assert spec_counters(parse("vllm:num_requests_running 0\n")) is None


def _draft(engine: LLMEngine, model: Path) -> Eagle3Draft:
    torch.manual_seed(0)
    draft = Eagle3Draft(draft_layer_config(AutoConfig.from_pretrained(model)), engine.vocab_size, [0, 1])
    draft.set_vocab(torch.arange(engine.vocab_size))
    target = engine.target_tensors()
    draft.init_from_target(target["embed_tokens"], target["lm_head"], target["norm"])
    return draft


@pytest.fixture(scope="module")
def prompts(tiny_llama: Path):
    from onboard.models import inspect_checkpoint, load_tokenizer

    tokenizer = load_tokenizer(inspect_checkpoint(tiny_llama))
    return held_out_prompts(tokenizer, ["chat", "code", "math"], None, 6)


def test_acceptance_from_counters_equals_the_engines_own(tiny_llama: Path, prompts) -> None:
    engine = LLMEngine(tiny_llama, CONFIG, dtype=torch.float32)
    draft = _draft(engine, tiny_llama)
    engine.set_speculator(draft, K)
    app = build_app(engine, "m")
    with ServerThread(app) as url, Endpoint(EndpointSpec(url)) as endpoint:
        result = measure_endpoint_acceptance(endpoint, prompts, MAX_TOKENS)
        stats = app.state.server.loop.call(lambda e: copy.deepcopy(e.speculator.stats)).result(30)
    # The server's engine counted exactly what /metrics said, over this workload only.
    assert result["num_drafts"] == stats.num_drafts > 0
    assert result["num_accepted_tokens"] == stats.num_accepted_tokens
    assert result["num_draft_tokens"] == stats.num_draft_tokens
    assert result["acceptance_length"] == pytest.approx(1 + stats.num_accepted_tokens / stats.num_drafts)
    assert result["per_position_acceptance"] == pytest.approx(
        [n / stats.num_drafts for n in stats.accepted_per_position]
    )
    assert result["num_speculative_tokens"] == K and result["num_prompts"] == len(prompts)
    by_traffic = result["by_traffic"]
    assert sorted(by_traffic) == ["chat", "code", "math"]
    assert sum(t["num_drafts"] for t in by_traffic.values()) == stats.num_drafts
    assert sum(t["num_prompts"] for t in by_traffic.values()) == len(prompts)

    # The in-process measurement on the same prompts, greedy, one at a time: the same figures.
    local = LLMEngine(tiny_llama, CONFIG, dtype=torch.float32)
    expected = measure_acceptance(local, _draft(local, tiny_llama), K, prompts, MAX_TOKENS)
    assert result["acceptance_length"] == pytest.approx(expected["acceptance_length"])
    assert result["per_position_acceptance"] == pytest.approx(expected["per_position_acceptance"])
    assert result["num_tokens"] == expected["num_tokens"]
    for traffic, row in expected["by_traffic"].items():
        assert by_traffic[traffic]["acceptance_length"] == pytest.approx(row["acceptance_length"])
        assert by_traffic[traffic]["num_drafts"] == row["num_drafts"]


def test_server_without_a_draft_is_aone_line_error(tiny_llama: Path, prompts) -> None:
    app = build_app(LLMEngine(tiny_llama, CONFIG, dtype=torch.float32), "m")
    wanted = "reports no speculative-decoding counters: was it started"
    with (
        ServerThread(app) as url,
        Endpoint(EndpointSpec(url)) as endpoint,
        pytest.raises(EndpointError, match=wanted) as err,
    ):
        measure_endpoint_acceptance(endpoint, prompts, MAX_TOKENS)
    assert "\n" not in str(err.value) and "--speculative-config" in str(err.value)


def _run_dir(root: Path, model: Path) -> Path:
    """A run directory whose quantize stage is done and whose artifact is `model`."""
    import shutil

    shutil.copytree(model, root / "artifact")
    recipe = Recipe().model_dump()
    recipe["speculator"].update(eval_prompts=4, eval_max_tokens=16)
    manifest = {"stages": {"quantize": {"status": "done", "metrics": {}}}, "recipe": recipe}
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


def test_cli_measures_the_served_speculator_without_training(
    tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    run_dir = _run_dir(tmp_path / "run", tiny_llama)
    engine = LLMEngine(tiny_llama, CONFIG, dtype=torch.float32)
    engine.set_speculator(_draft(engine, tiny_llama), K)
    with ServerThread(build_app(engine, "served")) as url:
        code, _, stderr = onboard(["speculator", str(run_dir), "--endpoint", url], capsys)
        assert code == 0, stderr
        spec = EndpointSpec(url)
        metrics = json.loads((run_dir / "endpoints" / spec.slug / "speculator" / "metrics.json").read_text())
        again, _, _ = onboard(["speculator", str(run_dir), "--endpoint", url], capsys)  # measured again
        second = json.loads((run_dir / "endpoints" / spec.slug / "speculator" / "metrics.json").read_text())
    assert again == 0 and second["num_drafts"] == metrics["num_drafts"]  # greedy: the same again, not cached
    assert metrics["num_speculative_tokens"] == K and metrics["num_prompts"] == 4 and metrics["max_tokens"] == 16
    assert metrics["acceptance_length"] >= 1 and len(metrics["per_position_acceptance"]) == K
    assert metrics["served_model"] == "served" and metrics["by_traffic"] and metrics["num_drafts"] > 0
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["stages"][f"speculator@{spec.slug}"]["status"] == "done"
    assert "speculator" not in manifest["stages"] and not (run_dir / "artifact" / "speculator").exists()
    assert "acceptance length" in stderr  # the table, on the console (stderr)

    code, _, stderr = onboard(["speculator", str(run_dir), "--endpoint", url, "--epochs", "2"], capsys)
    assert code == 2 and "--epochs" in one_line_error(stderr)


def test_cli_on_a_server_without_a_draft(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run_dir = _run_dir(tmp_path / "run", tiny_llama)
    with ServerThread(build_app(LLMEngine(tiny_llama, CONFIG, dtype=torch.float32), "m")) as url:
        code, _, stderr = onboard(["speculator", str(run_dir), "--endpoint", url], capsys)
    assert code == 2 and "no speculative-decoding counters" in one_line_error(stderr)
