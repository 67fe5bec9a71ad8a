"""KLStats against hand-computed statistics, and logit_chunks against a full forward."""

import itertools
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from onboard.evaluate.kl import KLStats
from onboard.evaluate.logits import logit_chunks
from onboard.models import inspect_checkpoint, load_model, load_tokenizer

# Three positions over a vocabulary of three: reference P and quantized Q, as probabilities.
P = [[0.7, 0.2, 0.1], [0.1, 0.6, 0.3], [0.25, 0.25, 0.5]]
Q = [[0.5, 0.3, 0.2], [0.2, 0.3, 0.5], [0.25, 0.25, 0.5]]
TARGETS = [1, 2, 0]


def as_logits(probs: list[list[float]], shift: list[float]) -> torch.Tensor:
    """log p plus an arbitrary per-row constant: softmax must not care about the shift."""
    return torch.tensor([[math.log(p) + s for p in row] for row, s in zip(probs, shift, strict=True)])


def hand_kl(p: list[float], q: list[float]) -> float:
    return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True) if pi > 0)


def linear_percentile(values: list[float], pct: float) -> float:
    """numpy's default ('linear') percentile, written out."""
    ordered = sorted(values)
    pos = pct / 100 * (len(ordered) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (pos - low) * (ordered[high] - ordered[low])


def test_hand_computed_example() -> None:
    stats = KLStats()
    kl = stats.update(as_logits(P, [0.0, 3.0, -1.5]), as_logits(Q, [2.0, -4.0, 0.5]), torch.tensor(TARGETS))
    expected_kl = [hand_kl(p, q) for p, q in zip(P, Q, strict=True)]
    assert expected_kl[2] == 0.0
    assert kl.tolist() == pytest.approx(expected_kl, abs=1e-6)

    summary = stats.summary()
    assert summary["num_tokens"] == 3 == stats.num_tokens
    assert summary["mean_kld"] == pytest.approx(sum(expected_kl) / 3, abs=1e-6)
    assert summary["median_kld"] == pytest.approx(sorted(expected_kl)[1], abs=1e-6)
    assert summary["max_kld"] == pytest.approx(max(expected_kl), abs=1e-6)
    assert summary["p90_kld"] == pytest.approx(linear_percentile(expected_kl, 90), abs=1e-6)
    assert summary["p99_kld"] == pytest.approx(linear_percentile(expected_kl, 99), abs=1e-6)

    # Reference top tokens are 0, 1, 2; the quantized model's are 0, 2, 2: two of three agree.
    assert summary["top1_agreement"] == pytest.approx(2 / 3)

    # Δp is the quantized probability of the reference's top token minus the reference's.
    deltas = [Q[0][0] - P[0][0], Q[1][1] - P[1][1], Q[2][2] - P[2][2]]
    rms = math.sqrt(sum(d * d for d in deltas) / len(deltas))
    assert summary["rms_delta_p"] == pytest.approx(rms, abs=1e-6)

    ppl_ref = math.exp(-sum(math.log(P[i][t]) for i, t in enumerate(TARGETS)) / 3)
    ppl_quant = math.exp(-sum(math.log(Q[i][t]) for i, t in enumerate(TARGETS)) / 3)
    assert summary["ppl_reference"] == pytest.approx(ppl_ref, rel=1e-6)
    assert summary["ppl_quantized"] == pytest.approx(ppl_quant, rel=1e-6)


def test_kl_is_not_symmetric() -> None:
    """The direction is KL(reference || quantized), not the reverse."""
    p, q = [[0.9, 0.05, 0.05]], [[0.4, 0.3, 0.3]]
    stats = KLStats()
    kl = stats.update(as_logits(p, [0.0]), as_logits(q, [0.0]), torch.tensor([0]))
    assert kl.item() == pytest.approx(hand_kl(p[0], q[0]), abs=1e-6)
    assert abs(hand_kl(p[0], q[0]) - hand_kl(q[0], p[0])) > 0.05


def reference_kl(ref: np.ndarray, quant: np.ndarray) -> np.ndarray:
    """KL(softmax(ref) || softmax(quant)) per row in float64 with numpy alone."""

    def log_softmax(x: np.ndarray) -> np.ndarray:
        x = x - x.max(axis=-1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))

    lp, lq = log_softmax(ref.astype(np.float64)), log_softmax(quant.astype(np.float64))
    return (np.exp(lp) * (lp - lq)).sum(-1)


def random_case(n: int = 300, vocab: int = 40, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ref = torch.randn(n, vocab, generator=gen) * 3
    quant = ref + 0.5 * torch.randn(n, vocab, generator=gen)
    targets = torch.randint(0, vocab, (n,), generator=gen)
    return ref, quant, targets


def test_summary_against_numpy_and_chunking() -> None:
    ref, quant, targets = random_case()
    chunked = KLStats()
    start = 0
    for size in (1, 37, 62, 100, 100):
        chunked.update(ref[start : start + size], quant[start : start + size], targets[start : start + size])
        start += size
    assert start == len(ref)
    single = KLStats()
    single.update(ref, quant, targets)

    a, b = chunked.summary(), single.summary()
    assert a.keys() == b.keys()
    assert a["num_tokens"] == b["num_tokens"] == len(ref)
    for key in a:
        assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), key

    expected = reference_kl(ref.numpy(), quant.numpy())
    assert chunked.kl_values() == pytest.approx(expected, rel=1e-4, abs=1e-6)
    assert a["mean_kld"] == pytest.approx(expected.mean(), rel=1e-4)
    assert a["median_kld"] == pytest.approx(np.median(expected), rel=1e-4)
    assert a["p90_kld"] == pytest.approx(np.percentile(expected, 90), rel=1e-4)
    assert a["p99_kld"] == pytest.approx(np.percentile(expected, 99), rel=1e-4)
    assert a["max_kld"] == pytest.approx(expected.max(), rel=1e-4)
    assert a["median_kld"] <= a["p90_kld"] <= a["p99_kld"] <= a["max_kld"]

    same_top = (ref.argmax(-1) == quant.argmax(-1)).double().mean().item()
    assert a["top1_agreement"] == pytest.approx(same_top)
    assert 0 < same_top < 1  # the case exercises both outcomes


def test_identical_logits() -> None:
    ref, _, targets = random_case(seed=1)
    stats = KLStats()
    kl = stats.update(ref, ref.clone(), targets)
    assert torch.equal(kl, torch.zeros(len(ref)))
    summary = stats.summary()
    assert summary["mean_kld"] == summary["max_kld"] == 0.0
    assert summary["top1_agreement"] == 1.0
    assert summary["rms_delta_p"] == 0.0
    assert summary["ppl_reference"] == summary["ppl_quantized"]


def test_tied_top_tokens_agree_in_any_order_a_server_lists_them() -> None:
    """A server lists tied tokens in its sort's order; scored from that list, the candidate's top
    token is the lowest id among the tied, as argmax over the whole vocabulary picks in process."""
    quant = torch.tensor([[0.0, 2.0, 1.0, 2.0], [3.0, 1.0, 3.0, 3.0]])
    ref = torch.tensor([[0.0, 2.5, 1.0, 2.0], [3.0, 1.0, 2.0, 2.5]])
    targets = torch.tensor([1, 0])
    in_process = KLStats()
    in_process.update(ref, quant, targets)
    logp = torch.log_softmax(quant, -1)
    for order in ([3, 1, 2, 0], [3, 2, 0, 1]), ([1, 3, 0, -1], [2, 3, 0, -1]):
        ids = torch.tensor(order)
        cand = torch.where(ids >= 0, logp.gather(-1, ids.clamp(min=0)), -torch.inf)
        scored = KLStats()
        scored.update_scored(ref, ids, cand, logp.gather(-1, targets[:, None])[:, 0], targets)
        assert scored.summary()["top1_agreement"] == in_process.summary()["top1_agreement"] == 1.0


def test_kl_never_negative() -> None:
    """Rounding can make a near-zero KL come out slightly negative; it must not."""
    gen = torch.Generator().manual_seed(2)
    ref = torch.randn(500, 64, generator=gen) * 8
    stats = KLStats()
    for noise in (0.0, 1e-7, 1e-5, 1e-3, 1.0):
        kl = stats.update(
            ref,
            ref + noise * torch.randn(ref.shape, generator=gen),
            torch.zeros(500, dtype=torch.long),
        )
        assert (kl >= 0).all()
        assert torch.isfinite(kl).all()
    assert (stats.kl_values() >= 0).all()


def test_bf16_inputs_are_upcast() -> None:
    ref, quant, targets = random_case(n=20, seed=3)
    stats = KLStats()
    kl = stats.update(ref.bfloat16(), quant.bfloat16(), targets)
    assert kl.dtype == torch.float32
    expected = reference_kl(ref.bfloat16().float().numpy(), quant.bfloat16().float().numpy())
    assert kl.numpy() == pytest.approx(expected, rel=1e-4, abs=1e-6)


def test_empty_summary_raises() -> None:
    stats = KLStats()
    assert stats.num_tokens == 0
    assert stats.kl_values().shape == (0,)
    with pytest.raises(ValueError, match="no positions"):
        stats.summary()


def test_zero_probability_reference_tokens() -> None:
    p, q = [0.5, 0.5, 0.0], [0.4, 0.4, 0.2]
    ref = torch.tensor([[math.log(0.5), math.log(0.5), float("-inf")]])
    quant = torch.tensor([[math.log(x) for x in q]])
    kl = KLStats().update(ref, quant, torch.tensor([0]))
    assert kl.item() == pytest.approx(hand_kl(p, q), abs=1e-6)


# ---------------------------------------------------------------------------------------------
# logit_chunks
# ---------------------------------------------------------------------------------------------

TEXT = (
    "The quick brown fox jumps over the lazy dog. def mean(values): return sum(values) / "
    "len(values). The capital of France is Paris."
)


@pytest.fixture(scope="module")
def llama_and_ids(tiny_llama: Path):
    checkpoint = inspect_checkpoint(tiny_llama)
    model = load_model(checkpoint)
    ids = torch.tensor([load_tokenizer(checkpoint)(TEXT)["input_ids"]])
    assert ids.shape[1] > 20
    return model, ids


@pytest.mark.parametrize("chunk", [7, 16, 1000])
def test_logit_chunks_match_the_full_forward(llama_and_ids, chunk: int) -> None:
    model, ids = llama_and_ids
    length = ids.shape[1]
    chunks = list(logit_chunks(model, ids, chunk))

    sizes = [len(c) for c in chunks]
    assert all(0 < s <= chunk for s in sizes)
    assert sum(sizes) == length
    assert len(chunks) == math.ceil(length / chunk)
    assert all(c.dtype == torch.float32 and c.shape[1] == model.config.vocab_size for c in chunks)

    logits = torch.cat(chunks)
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    # The full forward rounds its logits to bf16 (8 significant bits): within that rounding.
    full = out.logits[0].float()
    assert full.abs().max() > 1  # the comparison below is not vacuous
    torch.testing.assert_close(logits, full, rtol=2**-7, atol=1e-3)
    # And exactly the float32 projection of the final hidden state.
    hidden = out.hidden_states[-1][0].float()
    expected = hidden @ model.get_output_embeddings().weight.float().T
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    # float32 logits carry information bf16 ones would have rounded away.
    assert not torch.equal(logits, logits.bfloat16().float())


def test_histogram_counts_every_position_in_log_bins() -> None:
    ref, quant, targets = random_case()
    stats = KLStats()
    stats.update(ref, quant, targets)
    kl = stats.kl_values()
    hist = stats.histogram(bins_per_decade=4)
    edges, counts = hist["edges"], hist["counts"]
    assert len(edges) == len(counts) + 1 and sum(counts) == len(kl)
    assert edges[0] == 0.0 and edges[-1] >= kl.max() and all(a < b for a, b in itertools.pairwise(edges))
    assert edges[2] / edges[1] == pytest.approx(10**0.25)  # four bins a decade
    for (low, high), count in zip(itertools.pairwise(edges), counts, strict=True):
        inside = ((kl >= low) & (kl < high)) | ((kl == high) & (high == edges[-1]))
        assert int(inside.sum()) == count
