"""vLLM's dialect for scoring prompts on `onboard serve`: `prompt_logprobs`, legacy `echo` with
logprobs (and `max_tokens: 0`), the `max_logprobs` cap, and seeded sampling under concurrency.

A real uvicorn on loopback over the tiny llama in float32, so the served values can be checked
against the engine's own logits (`LLMEngine.score`, log-softmaxed).
"""

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
from server_thread import ServerThread

from onboard.engine.config import EngineConfig
from onboard.engine.llm_engine import LLMEngine
from onboard.server import build_app

MODEL = "tiny-llama"
CHUNK = 16  # max_num_batched_tokens: longer prompts prefill in several chunks
SHORT = "The quick brown fox"
LONG = "The quick brown fox jumps over the lazy dog, and then it runs all the way back home again."
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def _serve(tiny_llama: Path, **config) -> Iterator[tuple[httpx.Client, object]]:
    engine = LLMEngine(tiny_llama, EngineConfig(max_model_len=256, num_blocks=128, **config), dtype=torch.float32)
    app = build_app(engine, MODEL)
    with ServerThread(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        yield http, app.state.server


@pytest.fixture(scope="module")
def served(tiny_llama: Path) -> Iterator[tuple[httpx.Client, object]]:
    yield from _serve(tiny_llama, max_num_batched_tokens=CHUNK)


@pytest.fixture(scope="module")
def http(served) -> httpx.Client:
    return served[0]


@pytest.fixture(scope="module")
def state(served):
    return served[1]


@pytest.fixture(scope="module")
def unlimited(tiny_llama: Path) -> Iterator[tuple[httpx.Client, object]]:
    yield from _serve(tiny_llama, max_logprobs=-1)


def _on_engine(state, fn):
    return state.loop.call(fn).result(60)


def reference(state, ids: list[int]) -> torch.Tensor:
    """float32 log_softmax of the engine's logits at every position of `ids` (one teacher-forced pass)."""
    return _on_engine(state, lambda engine: engine.score(ids)).log_softmax(dim=-1)


def _ok(http: httpx.Client, path: str, body: dict) -> dict:
    response = http.post(path, json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return response.json()


def check_prompt_logprobs(state, plp: list, ids: list[int], n: int, exact: bool) -> None:
    """vLLM's shape, and the values of the engine's own logits."""
    ref = reference(state, ids)
    assert len(plp) == len(ids) and plp[0] is None
    for i in range(1, len(ids)):
        row, token, position = ref[i - 1], ids[i], plp[i]
        keys = list(position)
        assert keys[0] == str(token)  # the prompt token first, then the top n
        assert all(set(v) == {"logprob", "rank", "decoded_token"} for v in position.values())
        want = row[token].item()
        got = position[str(token)]
        if exact:
            assert got["logprob"] == want
        else:
            assert got["logprob"] == pytest.approx(want, abs=1e-5)
        assert got["rank"] == int((row >= row[token]).sum())
        assert got["decoded_token"] == state.tokenizer.decode([token])
        top_ids = row.topk(n).indices.tolist()
        assert set(keys) == {str(token), *map(str, top_ids)} and len(keys) in (n, n + 1)
        assert [position[str(t)]["rank"] for t in top_ids] == list(range(1, n + 1))
        for t in top_ids:
            assert position[str(t)]["logprob"] == (row[t].item() if exact else pytest.approx(row[t].item(), abs=1e-5))


def test_completion_prompt_logprobs_are_the_engine_logits(http: httpx.Client, state) -> None:
    ids = list(state.tokenizer.encode(SHORT))
    assert len(ids) < CHUNK
    r = _ok(http, COMPLETIONS, {"prompt": SHORT, "max_tokens": 3, "temperature": 0, "prompt_logprobs": 3})
    choice = r["choices"][0]
    assert r["usage"]["prompt_tokens"] == len(ids) and choice["logprobs"] is None
    check_prompt_logprobs(state, choice["prompt_logprobs"], ids, 3, exact=True)
    # Token ids as the prompt give the same; prompt_logprobs 0 gives the prompt tokens alone.
    same = _ok(http, COMPLETIONS, {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 3})
    assert same["choices"][0]["prompt_logprobs"] == choice["prompt_logprobs"]
    only = _ok(http, COMPLETIONS, {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 0})["choices"][0]
    assert [list(p) for p in only["prompt_logprobs"][1:]] == [[str(t)] for t in ids[1:]]
    # Not asked for: null, as vLLM sends it.
    plain = _ok(http, COMPLETIONS, {"prompt": SHORT, "max_tokens": 1})
    assert plain["choices"][0]["prompt_logprobs"] is None


def test_chunked_prefill_scores_every_position(http: httpx.Client, state) -> None:
    ids = list(state.tokenizer.encode(LONG))
    assert len(ids) > 2 * CHUNK
    r = _ok(http, COMPLETIONS, {"prompt": ids, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 4})
    # Chunks run other row counts through the GEMMs than one teacher-forced pass: float32 rounding apart.
    check_prompt_logprobs(state, r["choices"][0]["prompt_logprobs"], ids, 4, exact=False)


def test_a_cached_prompt_is_computed_afresh(http: httpx.Client, state) -> None:
    ids = list(state.tokenizer.encode(LONG + " Twice."))
    scored = {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 2}
    first = _ok(http, COMPLETIONS, scored)["choices"][0]["prompt_logprobs"]
    before = _on_engine(state, lambda engine: engine.stats()["prefix_cache_hits"])
    for _ in range(2):  # the second of these finds the prompt's blocks in the prefix cache
        _ok(http, COMPLETIONS, {"prompt": ids, "max_tokens": 1})
    hits = _on_engine(state, lambda engine: engine.stats()["prefix_cache_hits"])
    assert hits - before >= 2 * 16  # two full blocks of 16 tokens
    again = _ok(http, COMPLETIONS, scored)["choices"][0]["prompt_logprobs"]
    assert again == first and len(again) == len(ids)
    assert _on_engine(state, lambda engine: engine.stats()["prefix_cache_hits"]) == hits  # no reuse for it


def test_chat_prompt_logprobs_are_top_level(http: httpx.Client, state) -> None:
    r = _ok(http, CHAT, {"messages": MESSAGES, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2})
    ids = state.encode_chat(MESSAGES)
    assert "prompt_logprobs" not in r["choices"][0]
    assert r["usage"]["prompt_tokens"] == len(ids)
    check_prompt_logprobs(state, r["prompt_logprobs"], ids, 2, exact=len(ids) <= CHUNK)
    plain = _ok(http, CHAT, {"messages": MESSAGES, "max_tokens": 1})
    assert plain["prompt_logprobs"] is None


def test_minus_one_is_the_whole_vocabulary(unlimited) -> None:
    http, server = unlimited
    ids = list(server.tokenizer.encode(SHORT))
    r = _ok(http, COMPLETIONS, {"prompt": ids, "max_tokens": 1, "prompt_logprobs": -1, "logprobs": -1})
    vocab = server.model_vocab_size
    plp = r["choices"][0]["prompt_logprobs"]
    assert all(len(p) == vocab for p in plp[1:])
    check_prompt_logprobs(server, plp, ids, vocab, exact=True)
    assert len(r["choices"][0]["logprobs"]["top_logprobs"][0]) > 20  # keyed by text: some tokens share one
    # Without a cap, more than 20 is fine too.
    chat = _ok(http, CHAT, {"messages": MESSAGES, "max_tokens": 1, "logprobs": True, "top_logprobs": 50})
    assert len(chat["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 50


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (COMPLETIONS, {"prompt": SHORT, "prompt_logprobs": 21}, "prompt_logprobs"),
        (COMPLETIONS, {"prompt": SHORT, "prompt_logprobs": -1}, "prompt_logprobs"),
        (COMPLETIONS, {"prompt": SHORT, "logprobs": 21}, "logprobs"),
        (COMPLETIONS, {"prompt": SHORT, "echo": True, "logprobs": 21, "max_tokens": 0}, "logprobs"),
        (CHAT, {"messages": MESSAGES, "prompt_logprobs": 25}, "prompt_logprobs"),
        (CHAT, {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_above_max_logprobs_is_a_400_naming_the_flag(http: httpx.Client, path: str, body: dict, param: str) -> None:
    response = http.post(path, json={"model": MODEL, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert "--max-logprobs" in error["message"] and "max allowed: 20" in error["message"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (COMPLETIONS, {"prompt": SHORT, "prompt_logprobs": "3"}, "prompt_logprobs"),
        (COMPLETIONS, {"prompt": SHORT, "prompt_logprobs": 2.5}, "prompt_logprobs"),
        (COMPLETIONS, {"prompt": SHORT, "prompt_logprobs": True}, "prompt_logprobs"),
        (COMPLETIONS, {"prompt": SHORT, "prompt_logprobs": -2}, "prompt_logprobs"),
        (COMPLETIONS, {"prompt": SHORT, "prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
        (COMPLETIONS, {"prompt": SHORT, "logprobs": -3}, "logprobs"),
        (COMPLETIONS, {"prompt": SHORT, "max_tokens": 0}, "max_tokens"),
        (COMPLETIONS, {"prompt": SHORT, "echo": "yes"}, "echo"),
        (CHAT, {"messages": MESSAGES, "prompt_logprobs": -5}, "prompt_logprobs"),
        (CHAT, {"messages": MESSAGES, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        (CHAT, {"messages": MESSAGES, "max_tokens": 0, "prompt_logprobs": 1}, "max_tokens"),
    ],
)
def test_bad_values_are_one_line_400s(http: httpx.Client, path: str, body: dict, param: str) -> None:
    response = http.post(path, json={"model": MODEL, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"] and "\n" not in error["message"]


def test_echo_with_max_tokens_0_scores_the_prompt(http: httpx.Client, state) -> None:
    ids = list(state.tokenizer.encode(SHORT))
    r = _ok(http, COMPLETIONS, {"prompt": SHORT, "echo": True, "logprobs": 2, "max_tokens": 0})
    choice = r["choices"][0]
    assert choice["text"] == SHORT and choice["finish_reason"] == "length"
    assert r["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    lp, plp = choice["logprobs"], choice["prompt_logprobs"]  # echo scores the prompt like the completion
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["tokens"] == [state.tokenizer.decode([t]) for t in ids]
    ref = reference(state, ids)
    assert lp["token_logprobs"][1:] == [ref[i - 1, t].item() for i, t in enumerate(ids) if i]
    for i in range(1, len(ids)):
        assert lp["token_logprobs"][i] == plp[i][str(ids[i])]["logprob"]
        top = lp["top_logprobs"][i]  # the prompt token, then the top 2
        assert next(iter(top)) == lp["tokens"][i] and len(top) in (2, 3)
    # The official client sends and reads it too.
    client = openai.OpenAI(base_url=f"{str(http.base_url).rstrip('/')}/v1", api_key="none", max_retries=0)
    again = client.completions.create(model=MODEL, prompt=SHORT, echo=True, logprobs=2, max_tokens=0)
    assert again.choices[0].text == SHORT and again.choices[0].logprobs.token_logprobs == lp["token_logprobs"]


def test_echo_prepends_the_prompt_to_the_completion(http: httpx.Client, state) -> None:
    ids = list(state.tokenizer.encode(SHORT))
    body = {"prompt": SHORT, "max_tokens": 4, "temperature": 0, "logprobs": 1, "ignore_eos": True}
    plain = _ok(http, COMPLETIONS, body)["choices"][0]
    echoed = _ok(http, COMPLETIONS, {**body, "echo": True})["choices"][0]
    assert echoed["text"] == SHORT + plain["text"]
    lp = echoed["logprobs"]
    assert len(lp["tokens"]) == len(ids) + len(plain["logprobs"]["tokens"])
    # The same tokens; their logprobs float32 rounding apart (the logits GEMM runs over other rows).
    assert lp["token_logprobs"][len(ids) :] == pytest.approx(plain["logprobs"]["token_logprobs"], abs=1e-5)
    assert lp["token_logprobs"][0] is None and all(x is not None for x in lp["token_logprobs"][1:])
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    # Echo without logprobs: only the text; streamed: the prompt comes with the first chunk.
    assert _ok(http, COMPLETIONS, {**body, "echo": True, "logprobs": None})["choices"][0]["logprobs"] is None
    with http.stream("POST", COMPLETIONS, json={"model": MODEL, **body, "echo": True, "stream": True}) as response:
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(line) for line in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == echoed["text"]
    assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks) == len(lp["tokens"])
    assert chunks[0]["choices"][0]["logprobs"]["token_logprobs"][: len(ids)] == lp["token_logprobs"][: len(ids)]


def test_a_seeded_request_repeats_alone_and_among_others(http: httpx.Client) -> None:
    seeded = {"prompt": SHORT, "max_tokens": 16, "temperature": 1.0, "top_p": 0.95, "seed": 1234, "ignore_eos": True}
    alone = [_ok(http, COMPLETIONS, seeded)["choices"][0]["text"] for _ in range(2)]
    assert alone[0] == alone[1]
    others = [{"prompt": f"{LONG} {i}", "max_tokens": 24, "temperature": 1.0, "ignore_eos": True} for i in range(3)] + [
        {**seeded, "seed": 99}
    ]
    with ThreadPoolExecutor(max_workers=len(others) + 1) as pool:
        futures = [pool.submit(_ok, http, COMPLETIONS, body) for body in [*others, seeded]]
        results = [f.result() for f in futures]
    assert results[-1]["choices"][0]["text"] == alone[0]
    assert results[-2]["choices"][0]["text"] != alone[0]  # the seed matters


def test_preemption_and_speculative_decoding_keep_every_position(tiny_llama: Path) -> None:
    """Engine level: a prompt recomputed after preemption is scored once, and a draft changes nothing."""
    from transformers import AutoConfig

    from onboard.engine.sampler import SamplingParams
    from onboard.speculator.draft import Eagle3Draft, draft_layer_config

    def run(engine: LLMEngine) -> list[list]:
        prompts = [list(engine.tokenizer.encode(text)) for text in (LONG, SHORT, f"{SHORT} {LONG}", f"{SHORT} jumps")]
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=2)
        outs = engine.generate(prompts, params)
        assert [len(o.prompt_logprobs) for o in outs] == [len(p) for p in prompts]
        return [
            [o.token_ids, [e and (e["token"], e["rank"], [t for t, _ in e["top"]]) for e in o.prompt_logprobs]]
            for o in outs
        ]

    def engine(**config) -> LLMEngine:
        return LLMEngine(tiny_llama, EngineConfig(max_model_len=128, **config), dtype=torch.float32)

    chunked = engine(num_blocks=64, max_num_batched_tokens=24)
    want = run(chunked)
    tight = engine(num_blocks=8, max_num_batched_tokens=24)  # too few for all four: preemption
    assert run(tight) == want and tight.stats()["num_preemptions"] > 0
    tight._block_manager.check_invariants([])

    spec = engine(num_blocks=64, max_num_batched_tokens=24)
    torch.manual_seed(0)
    draft = Eagle3Draft(draft_layer_config(AutoConfig.from_pretrained(tiny_llama)), spec.vocab_size, [0, 1])
    draft.set_vocab(torch.arange(spec.vocab_size))
    target = spec.target_tensors()
    draft.init_from_target(target["embed_tokens"], target["lm_head"], target["norm"])
    spec.set_speculator(draft, 3)
    assert run(spec) == want and spec.speculator.stats.num_drafts > 0
