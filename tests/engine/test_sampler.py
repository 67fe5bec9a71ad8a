"""Sampler: greedy, seeded draws, filters, penalties, raw logprobs and entropy, validation."""

import pytest
import torch

from onboard.engine.sampler import Sampler, SamplingParams, apply_filters, apply_penalties

V = 64


def _logits(batch: int, seed: int = 0, vocab: int = V) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _sample(logits: torch.Tensor, params: list[SamplingParams], generators=None, histories=None, masks=None):
    batch = logits.shape[0]
    return Sampler().sample(
        logits,
        params,
        histories or [([], [])] * batch,
        generators or [p.make_generator() for p in params],
        masks or [None] * batch,
    )


def test_greedy_is_argmax_and_leaves_logits_untouched() -> None:
    logits = _logits(8)
    before = logits.clone()
    out = _sample(logits, [SamplingParams(temperature=0.0)] * 8)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert torch.equal(logits, before)
    assert out.logprobs == [None] * 8 and out.top_logprobs == [None] * 8


@pytest.mark.parametrize(
    "params",
    [SamplingParams(top_k=1), SamplingParams(top_p=1e-6), SamplingParams(min_p=1.0), SamplingParams(temperature=1e-6)],
    ids=["top_k=1", "top_p=tiny", "min_p=1", "temperature=tiny"],
)
def test_degenerate_filters_equal_greedy(params: SamplingParams) -> None:
    logits = _logits(16, seed=1)
    out = _sample(logits, [params] * 16, generators=[torch.Generator().manual_seed(i) for i in range(16)])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_seeded_sampling_is_reproducible_and_seed_dependent() -> None:
    logits = _logits(1, seed=2).expand(40, V).contiguous()

    def run(seed: int) -> list[int]:
        p = SamplingParams(seed=seed)
        g = p.make_generator()
        # One generator per request, continued across steps: 40 successive one-row calls.
        return [_sample(logits[i : i + 1], [p], generators=[g]).token_ids[0] for i in range(40)]

    assert run(7) == run(7)
    assert run(7) != run(8)
    # Within one batch, rows with their own equal seeds draw the same token.
    p = SamplingParams(seed=3)
    out = _sample(logits[:4], [p] * 4, generators=[p.make_generator() for _ in range(4)])
    assert len(set(out.token_ids)) == 1


def test_temperature_frequencies_match_softmax() -> None:
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    temperature, n = 0.7, 20000
    g = torch.Generator().manual_seed(0)
    out = _sample(base.expand(n, 5), [SamplingParams(temperature=temperature)] * n, generators=[g] * n)
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=5).float() / n
    expected = torch.softmax(base / temperature, dim=-1)
    sigma = (expected * (1 - expected) / n).sqrt()
    assert torch.all((freq - expected).abs() < 5 * sigma + 1e-3), (freq, expected)


def test_top_k_top_p_min_p_keep_the_right_tokens() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    one = torch.ones(1)

    def kept(top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> list[int]:
        out = apply_filters(logits, one, torch.tensor([top_k]), torch.tensor([top_p]), torch.tensor([min_p]))
        return torch.isfinite(out[0]).nonzero().flatten().tolist()

    assert kept() == [0, 1, 2, 3]
    assert kept(top_k=2) == [0, 1]
    assert kept(top_k=-1) == [0, 1, 2, 3]
    assert kept(top_p=0.7) == [0, 1]  # 0.5 < 0.7, then 0.8 covers it
    assert kept(top_p=0.82) == [0, 1, 2]
    assert kept(top_k=3, top_p=0.82) == [0, 1]  # top-p over the renormalized top-3: 0.8 / 0.95 > 0.82
    assert kept(min_p=0.29) == [0, 1, 2]  # threshold 0.145
    assert kept(min_p=0.31) == [0, 1]
    assert kept(min_p=0.61) == [0]


def test_sampling_respects_filters_and_masks() -> None:
    logits = _logits(1, seed=4).expand(200, V).contiguous()
    top3 = set(logits[0].topk(3).indices.tolist())
    out = _sample(logits, [SamplingParams(top_k=3, seed=1)] * 200)
    assert set(out.token_ids) <= top3
    allowed = torch.zeros(V, dtype=torch.bool)
    allowed[[5, 9]] = True
    out = _sample(logits, [SamplingParams(temperature=0.0)] * 2 + [SamplingParams()] * 198, masks=[allowed] * 200)
    assert set(out.token_ids) <= {5, 9}
    assert out.token_ids[0] == (5 if logits[0, 5] > logits[0, 9] else 9)


def test_penalties_change_exactly_the_right_logits() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5, 3.0]])
    history = ([0, 1], [2, 2, 3])  # prompt, output

    x = logits.clone()
    apply_penalties(x, [SamplingParams(repetition_penalty=2.0)], [history])
    assert x.tolist() == [[1.0, -4.0, 0.5, -2.0, 0.5, 3.0]]

    x = logits.clone()
    apply_penalties(x, [SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)], [history])
    # Output tokens only: 2 twice (-(1.0 + 0.25)), 3 once (-(0.5 + 0.25)); prompt tokens untouched.
    assert x.tolist() == [[2.0, -2.0, -0.25, -1.75, 0.5, 3.0]]

    x = logits.clone()
    apply_penalties(x, [SamplingParams()], [history])
    assert torch.equal(x, logits)


def test_penalties_steer_greedy_per_row() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0]]).repeat(2, 1)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, presence_penalty=1.0)]
    out = _sample(logits, params, histories=[([], [0]), ([], [0])])
    assert out.token_ids == [0, 1]


def test_logprobs_are_raw_log_softmax() -> None:
    logits = _logits(3, seed=5)
    allowed = torch.zeros(V, dtype=torch.bool)
    allowed[:10] = True
    params = [
        SamplingParams(temperature=0.5, top_k=5, logprobs=3, repetition_penalty=1.5),
        SamplingParams(logprobs=0),
        SamplingParams(temperature=0.0),
    ]
    out = _sample(logits, params, histories=[([1, 2], [3])] * 3, masks=[allowed, None, None])
    raw = torch.log_softmax(logits, dim=-1)
    for row in (0, 1):
        assert out.logprobs[row] == pytest.approx(raw[row, out.token_ids[row]].item(), abs=1e-6)
    assert out.token_ids[0] < 10
    vals, ids = raw[0].topk(3)
    assert [t for t, _ in out.top_logprobs[0]] == ids.tolist()
    assert [lp for _, lp in out.top_logprobs[0]] == pytest.approx(vals.tolist(), abs=1e-6)
    assert out.top_logprobs[1] == []
    assert out.logprobs[2] is None and out.top_logprobs[2] is None
    entry = out.logprob_entry(1)
    assert entry == {"token": out.token_ids[1], "logprob": out.logprobs[1], "top": [], "entropy": entry["entropy"]}
    entropy = -(raw[1].exp() * raw[1]).sum().item()  # of the raw distribution, whatever the sampling settings
    assert out.entropies[0] == pytest.approx(-(raw[0].exp() * raw[0]).sum().item(), rel=1e-5)
    assert entry["entropy"] == pytest.approx(entropy, rel=1e-5) and entropy > 0
    assert out.logprob_entry(2) is None and out.entropies[2] is None


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_validate_rejects_bad_values(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field) as err:
        SamplingParams(**kwargs).validate()
    assert "\n" not in str(err.value)


def test_validate_accepts_edges() -> None:
    for p in [
        SamplingParams(),
        SamplingParams(temperature=0.0, top_k=-1, top_p=1.0, min_p=1.0, logprobs=20, presence_penalty=-2.0),
        SamplingParams(stop="###", seed=-5, frequency_penalty=2.0, repetition_penalty=0.5),
    ]:
        p.validate()
    assert SamplingParams(stop="###").stop == ["###"]
