"""onboard's checks against vLLM itself (its CPU build, from `make interop`), on the demo
checkpoint: the same greedy tokens as onboard's engine (or parted at a near-tie), and prompt
log-probabilities that onboard's endpoint scoring reads and that agree with the engine's. Skipped
unless `.venv-vllm` and the demo checkpoint are on the machine (`make interop`, `make demo`)."""

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
    port = _free_port()
    subprocess.run([str(SERVE), str(_demo()), str(port), "--served-model-name", "demo"], check=True, timeout=900)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        subprocess.run([str(SERVE), "stop", str(port)], check=False, timeout=120)


@needs_vllm
def test_vllm_and_onboard_agree_on_the_demo_checkpoint(vllm_url: str) -> None:
    engine = LLMEngine(_demo(), EngineConfig())
    prompts = chat_prompts(builtin_records("eval", stdlib_files=0), engine.tokenizer, max_tokens=256, limit=3)
    with Endpoint(EndpointSpec(vllm_url)) as endpoint:
        assert endpoint.model == "demo"
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
