"""onboard's checks against vLLM itself (its CPU build, from `make interop`), on the demo
checkpoint: the same greedy tokens as onboard's engine (or parted at a near-tie), and prompt
log-probabilities that onboard's endpoint scoring reads and that agree with the engine's. Skipped
unless `.venv-vllm` and the demo checkpoint are on the machine (`make interop`, `make demo`)."""

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest
import torch

from onboard.adapt.parity import compare_greedy
from onboard.data import builtin_records, chat_prompts
from onboard.endpoint import Endpoint, EndpointSpec
from onboard.endpoint.scores import score_prompt
from onboard.engine import EngineConfig, LLMEngine
from onboard.engine.sampler import SamplingParams
from onboard.models.demo import MODEL_NAME
from onboard.paths import cache_dir

ROOT = Path(__file__).resolve().parents[1]
SERVE = ROOT / "scripts" / "interop_serve.sh"

pytestmark = pytest.mark.interop


# Read at import, before the session fixture points the cache at a tmp dir: the user's demo copy.
DEMO = cache_dir() / "demo" / MODEL_NAME


def _demo() -> Path | None:
    return DEMO if (DEMO / "config.json").is_file() else None


needs_vllm = pytest.mark.skipif(
    not (ROOT / ".venv-vllm" / ".installed").is_file() or _demo() is None,
    reason="no .venv-vllm (make interop) or no demo checkpoint (make demo)",
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_url():
    """vLLM serving the demo checkpoint: the one `make interop` already runs ($INTEROP_VLLM_BF16,
    scripts/interop_checks.sh), else one of its own."""
    if served := os.environ.get("INTEROP_VLLM_BF16"):
        yield served
        return
    port = _free_port()
    subprocess.run([str(SERVE), str(_demo()), str(port), "--served-model-name", "bf16"], check=True, timeout=900)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        subprocess.run([str(SERVE), "stop", str(port)], check=False, timeout=120)


@needs_vllm
def test_vllm_and_onboard_agree_on_the_demo_checkpoint(vllm_url: str) -> None:
    engine = LLMEngine(_demo(), EngineConfig())
    prompts = chat_prompts(builtin_records("eval", stdlib_files=0), engine.tokenizer, max_tokens=256, limit=3)
    with Endpoint(EndpointSpec(vllm_url)) as endpoint:
        assert endpoint.model == "bf16"
        for prompt in prompts:
            body = {
                "prompt": prompt.token_ids,
                "max_tokens": 24,
                "temperature": 0.0,
                "logprobs": 5,
                "return_token_ids": True,
                "return_tokens_as_token_ids": True,  # top_logprobs keyed "token_id:N"
            }
            choice = endpoint.post("/v1/completions", body)["choices"][0]
            served_top = [[int(key.split(":")[1]) for key in top] for top in choice["logprobs"]["top_logprobs"]]
            (own,) = engine.generate([prompt.token_ids], SamplingParams(temperature=0.0, max_tokens=24, logprobs=5))
            own_top = [[token for token, _ in entry["top"]] for entry in own.logprobs]
            # Two bf16 engines: the same tokens, or parted first at a near-tie (adapt's rule).
            verdict = compare_greedy(choice["token_ids"], own.token_ids, served_top, own_top)
            assert verdict.matched or verdict.near_tie, verdict
        scores = score_prompt(endpoint, prompts[0].token_ids, 20)
    own_logp = torch.log_softmax(engine.score(prompts[0].token_ids), -1)[:-1]
    targets = torch.tensor(prompts[0].token_ids[1:])
    delta = (torch.from_numpy(scores.target_logprobs) - own_logp.gather(-1, targets[:, None])[:, 0].double()).abs()
    assert float(delta.mean()) < 0.1  # bf16 on both sides: rounding, not a different model
    assert (scores.token_ids >= 0).sum(-1).min() >= 20


needs_vllm_venv = pytest.mark.skipif(
    not (ROOT / ".venv-vllm" / ".installed").is_file(), reason="no .venv-vllm (make interop)"
)


@needs_vllm_venv
def test_vllm_serves_the_artifacts_mtp_layers_with_the_engines_acceptance(tmp_path: Path) -> None:
    """An FP8 DeepSeek-V3 artifact whose MTP layer `--draft mtp` fine-tuned and wrote back, served by
    vLLM with `{"method": "mtp"}`: its acceptance on the held-out prompts is the engine's. vLLM's
    CPU build has no FP8 fused-MoE kernel, so the routed experts stay BF16."""
    import tiny_models

    from onboard.models import inspect_checkpoint
    from onboard.quantize.stage import run_quantize
    from onboard.recipes import Calibration, Quantize, recipe_for
    from onboard.speculator.data import TRAFFIC
    from onboard.speculator.drafts import load_draft
    from onboard.speculator.endpoint import measure_endpoint
    from onboard.speculator.measure import held_out_prompts, measure_acceptance
    from onboard.speculator.stage import run_speculator
    from onboard.workspace import RunDir

    source = tiny_models.build_mtp_model(tmp_path / "source", "deepseek_v3", residual_scale=0.0, vllm_cpu_shapes=True)
    recipe, _ = recipe_for(["DeepseekV3ForCausalLM"])
    quantize = {**recipe.quantize.model_dump(), "scheme": "fp8", "calibration": Calibration(num_samples=4).model_dump()}
    quantize["ignore"] = [*quantize["ignore"], "re:.*mlp\\.experts\\..*"]
    settings = tiny_models.mtp_speculator_settings(
        traffic="mixed", max_prompt_tokens=256, max_seq_len=192, num_speculative_tokens=1, eval_prompts=8
    )
    root = tmp_path / "run"
    with RunDir(root) as run:
        run_quantize(run, inspect_checkpoint(source), Quantize.model_validate(quantize), None)
        run_speculator(run, settings, None, numerics="exact")
        assert json.loads((root / "speculator/metrics.json").read_text())["mtp"]["written_back"]
        engine = LLMEngine(run.artifact, EngineConfig(enable_prefix_caching=False))
        prompts = held_out_prompts(engine.tokenizer, TRAFFIC["mixed"], None, 8, 256)
        draft, k = load_draft(Path("mtp"), run.artifact, engine)
        ours = measure_acceptance(engine, draft, k, prompts, settings.eval_max_tokens)
        port = _free_port()
        extra = ["--served-model-name", "mtp", "--max-model-len", "512"]
        spec = json.dumps({"method": "mtp", "num_speculative_tokens": 1})
        subprocess.run([str(SERVE), str(run.artifact), str(port), *extra, "--speculative-config", spec], check=True)
        try:
            with Endpoint(EndpointSpec(f"http://127.0.0.1:{port}", "mtp")) as endpoint:
                theirs = measure_endpoint(run, settings, None, endpoint)
        finally:
            subprocess.run([str(SERVE), "stop", str(port)], check=False, timeout=120)
    assert ours["acceptance_length"] > 1.3  # the fine-tuned layer predicts the model
    assert abs(theirs["acceptance_length"] - ours["acceptance_length"]) <= 0.1
