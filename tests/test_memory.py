"""Eval keeps a few numbers per position, never a window's logits: its memory is bounded by one
window whatever the data size (the allocator's part is `onboard.memory`'s)."""

from pathlib import Path

import torch

from onboard.evaluate.kl import KLStats
from onboard.evaluate.stage import eval_windows, measure_kl
from onboard.models import inspect_checkpoint, load_model, load_tokenizer
from onboard.recipes import Eval


def _kept(stats: KLStats) -> int:
    lists = (stats._kl, stats._same_top, stats._delta_p, stats._nll_ref, stats._nll_quant)
    return sum(t.numel() for values in lists for t in values)


def _no_views(stats: KLStats) -> bool:
    """Each kept tensor owns storage of its own size: none is a view into a [positions x vocab] block."""
    lists = (stats._kl, stats._same_top, stats._delta_p, stats._nll_ref, stats._nll_quant)
    return all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for values in lists for t in values)


def test_eval_keeps_five_numbers_per_position(tiny_llama: Path) -> None:
    checkpoint = inspect_checkpoint(tiny_llama)
    windows = eval_windows(load_tokenizer(checkpoint), Eval(max_tokens=600, window=64), None)
    model = load_model(checkpoint)
    stats = measure_kl(model, model, windows)
    positions = sum(len(w) - 1 for _, w in windows)
    assert stats["all"].num_tokens == positions
    for part in stats.values():
        assert _kept(part) == 5 * part.num_tokens
        assert _no_views(part)
    assert stats["all"].summary()["mean_kld"] < 1e-6  # the same model on both sides


def test_kl_stats_from_server_scores_keep_as_little() -> None:
    torch.manual_seed(0)
    stats = KLStats()
    ref = torch.randn(32, 500)
    ids = torch.topk(torch.randn(32, 500), 6).indices
    logp = torch.log_softmax(torch.randn(32, 500), -1).gather(-1, ids)
    stats.update_scored(ref, ids, logp, logp[:, 0], ids[:, 0])
    assert _kept(stats) == 5 * 32 and _no_views(stats)
