"""Fast numerics' kernel choice: measured per shape, invariance probed, cached per machine."""

import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from onboard.engine.kernel_measure import (
    TILE_ROWS,
    KernelCache,
    choose_kernels,
    machine,
    measure_shape,
    order_probe,
)
from onboard.engine.kernels import PROBE_ROWS, TIE, BoundKernels, KernelChoice, ShapeMeasure, candidates
from onboard.engine.linear import EngineLinear


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_probe_exposes_any_change_of_summation_order(dtype: torch.dtype) -> None:
    """The same sum taken in another column order gives other bits in most outputs of the probe,
    and in almost none on plain Gaussian data (why a Gaussian probe would miss a kernel)."""
    weight, x, _ = order_probe(576, 1536, dtype, torch.device("cpu"), bias=False)
    perm = torch.randperm(1536, generator=torch.Generator().manual_seed(3))
    probe = (F.linear(x, weight) != F.linear(x[:, perm], weight[:, perm])).float().mean()
    gen = torch.Generator().manual_seed(1)
    xg, wg = torch.randn(x.shape, generator=gen).to(dtype), torch.randn(weight.shape, generator=gen).to(dtype)
    gaussian = (F.linear(xg, wg) != F.linear(xg[:, perm], wg[:, perm])).float().mean()
    assert probe > 0.9
    if dtype == torch.bfloat16:
        assert gaussian < 0.01
    assert torch.isfinite(F.linear(x, weight)).all()


def test_a_pair_called_invariant_gives_a_row_the_same_bits_alone_and_batched() -> None:
    """Checked again on other inputs than the probe's: every pair the measurement calls invariant
    is, and `per_row` is offered with every one-row kernel."""
    gen = torch.Generator().manual_seed(2)
    weight = (torch.randn(96, 160, generator=gen) * 0.1).to(torch.bfloat16)
    measured = measure_shape([weight], bias=False)
    one_row, rows = candidates(weight)
    assert set(measured.one_row_us) == set(one_row) and set(measured.rows_us) == set(rows)
    x = (torch.randn(8, 160, generator=gen) * torch.randn(8, 160, generator=gen).exp()).to(torch.bfloat16)
    for k, r in measured.invariant:
        kernels = BoundKernels(weight, KernelChoice(k, r))
        alone = torch.cat([kernels(x[i : i + 1], None) for i in range(8)])
        assert torch.equal(kernels(x, None), alone), (k, r)
    for k in one_row:
        kernels = BoundKernels(weight, KernelChoice(k, "per_row"))
        assert torch.equal(kernels(x, None), torch.cat([kernels(x[i : i + 1], None) for i in range(8)]))


def _measure(
    one_row: dict, rows: dict, invariant: list, exact_one_row: tuple = ("plain",), tiles: tuple = ()
) -> ShapeMeasure:
    return ShapeMeasure(one_row, rows, invariant, exact_one_row=list(exact_one_row), tiles=list(tiles))


def _tile(rows: int, invariant: bool, agreement: float, us: float) -> dict:
    return {"rows": rows, "invariant": invariant, "prefill_agreement": agreement, "one_row_us": us}


def test_without_invariance_each_regime_takes_its_fastest_kernel() -> None:
    m = _measure({"plain": 50, "pytorch": 20, "onednn": 30}, {"plain": 100, "pytorch": 900, "onednn": 60}, [])
    assert m.choose(batch_invariant=False) == KernelChoice("pytorch", "onednn")


def test_exact_kernel_is_kept_without_a_measured_gain() -> None:
    near = _measure({"plain": 21, "pytorch": 20}, {"plain": 100, "pytorch": 95}, [["plain", "plain"]])
    assert near.choose(batch_invariant=False) == KernelChoice("plain", "plain")
    assert near.choose(batch_invariant=True) == KernelChoice("plain", "plain")
    faster = _measure({"plain": 30, "pytorch": 20}, {"plain": 100, "pytorch": 60}, [["pytorch", "pytorch"]])
    assert faster.choose(batch_invariant=False) == KernelChoice("pytorch", "pytorch")


def test_a_linear_that_feeds_a_quantizer_is_chosen_for_its_rounding() -> None:
    """Without invariance: several rows through `plain` itself (exact's rounding at any count), one
    row through a kernel that gave plain's bits.  With it: `tiled`, the invariant tile size that
    rounds most often as a prefill's `plain`, then the fastest; none invariant: as without."""
    one_row, rows = {"plain": 50, "pytorch": 20, "onednn": 30}, {"plain": 100, "pytorch": 900, "onednn": 60}
    same_as_plain = ("plain", "onednn")
    tiles = (_tile(16, True, 0.2, 40), _tile(32, False, 1.0, 45), _tile(64, True, 0.9, 80), _tile(128, True, 0.9, 90))
    invariant = [["onednn", "onednn"], ["onednn", "plain"], ["pytorch", "pytorch"]]
    m = _measure(one_row, rows, invariant, same_as_plain, tiles)
    assert m.choose(False) == KernelChoice("pytorch", "onednn")  # any rounding, fastest
    assert m.choose(False, feeds_quantizer=True) == KernelChoice("onednn", "plain")
    assert m.choose(True, feeds_quantizer=True) == KernelChoice("tiled", "tiled", 64)
    assert m.choose(True) == KernelChoice("onednn", "onednn")  # other linears: the fastest invariant pair
    untiled = _measure(one_row, rows, invariant, same_as_plain, [_tile(16, False, 1.0, 40)])
    assert untiled.tile() == 0
    assert untiled.choose(True, feeds_quantizer=True) == KernelChoice("onednn", "plain")


@pytest.mark.parametrize("shape", [(96, 160), (576, 1536)])
def test_a_tile_called_invariant_gives_a_row_its_bits_alone_batched_and_anywhere(shape: tuple[int, int]) -> None:
    """Checked on other inputs than the probe's, at row counts and places the probe did not use."""
    gen = torch.Generator().manual_seed(6)
    weight = (torch.randn(*shape, generator=gen) * 0.05).to(torch.bfloat16)
    measured = measure_shape([weight], bias=False)
    assert [t["rows"] for t in measured.tiles] == list(TILE_ROWS)
    x = (torch.randn(300, shape[1], generator=gen) * torch.randn(300, shape[1], generator=gen).exp()).to(torch.bfloat16)
    for tile in measured.tiles:
        kernels = BoundKernels(weight, KernelChoice("tiled", "tiled", tile["rows"]))
        alone = torch.cat([kernels(x[i : i + 1], None) for i in range(24)])
        outputs = [kernels(x[start : start + count], None)[:24] for start, count in ((0, 24), (0, 300), (0, 77))]
        outputs.append(kernels(x[: 24 + 41], None)[:24])
        if tile["invariant"]:
            assert all(torch.equal(out, alone) for out in outputs), tile
        assert torch.allclose(alone.float(), F.linear(x[:24].float(), weight.float()), atol=0.05, rtol=0.02)
    assert measured.tile() in {0, *(t["rows"] for t in measured.tiles if t["invariant"])}


def test_the_probe_finds_which_one_row_kernels_round_as_plain() -> None:
    gen = torch.Generator().manual_seed(5)
    weight = (torch.randn(96, 160, generator=gen) * 0.1).to(torch.bfloat16)
    measured = measure_shape([weight], bias=False)
    assert "plain" in measured.exact_one_row
    x = torch.randn(1, 160, generator=gen).to(torch.bfloat16)
    for kernel in measured.exact_one_row:
        bound = BoundKernels(weight, KernelChoice(kernel, "plain"))
        assert torch.equal(bound.run(kernel, x, None), F.linear(x, weight)), kernel


def test_every_linear_upstream_of_a_quantizer_feeds_it() -> None:
    """Once one linear quantizes its input, all but the output head feed a quantizer: exact's
    rounding without invariance, a tile where invariance is asked and a tile size is invariant."""
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Module()
    model.quantized = EngineLinear(torch.randn(64, 64, generator=gen).bfloat16(), act_quant=lambda x: x)
    model.plain = EngineLinear(torch.randn(96, 64, generator=gen).bfloat16())
    model.lm_head = EngineLinear(torch.randn(128, 64, generator=gen).bfloat16(), name="lm_head")
    report = {row["shape"]: row["feeds_quantizer"] for row in choose_kernels(model, batch_invariant=False)}
    assert report == {
        "cpu:bfloat16:64x64:nobias": True,
        "cpu:bfloat16:96x64:nobias": True,
        "cpu:bfloat16:128x64:nobias": False,
    }
    for linear in (model.quantized, model.plain):
        assert linear.kernels.choice.rows == "plain"
    for row in choose_kernels(model, batch_invariant=True):
        tiled = row["feeds_quantizer"] and any(t["invariant"] for t in row["tiles"])
        assert (row["one_row"], row["rows"]) == ("tiled", "tiled") if tiled else row["rows"] != "tiled"
    del model.quantized
    report = choose_kernels(model, batch_invariant=False)
    assert not any(row["feeds_quantizer"] for row in report)


def test_with_invariance_only_measured_pairs_or_per_row() -> None:
    one_row, rows = {"plain": 50, "pytorch": 20, "onednn": 30}, {"plain": 100, "pytorch": 900, "onednn": 60}
    # nothing invariant: each row on its own, through the fastest one-row kernel
    assert _measure(one_row, rows, []).choose(True) == KernelChoice("pytorch", "per_row")
    # oneDNN's one row sums like its several rows: 30 + 60/16 per token beats 20 + 20
    assert _measure(one_row, rows, [["onednn", "onednn"]]).choose(True) == KernelChoice("onednn", "onednn")
    # never slower than exact numerics' F.linear one row at a time (plain: 50 per row)
    slow = _measure({"plain": 50, "onednn": 90}, {"plain": 100, "onednn": 60}, [["onednn", "onednn"]])
    assert slow.choose(True) == KernelChoice("plain", "per_row")


def test_dropping_invariance_is_never_slower_in_either_regime() -> None:
    gen = torch.Generator().manual_seed(0)
    names = ("plain", "pytorch", "onednn", "onednn2")
    for _ in range(200):
        one_row = {k: float(torch.randint(10, 100, (1,), generator=gen)) for k in names}
        rows = {k: float(torch.randint(20, 2000, (1,), generator=gen)) for k in names[:3]}
        invariant = [[k, r] for k in names for r in rows if torch.rand(1, generator=gen) < 0.3]
        m = _measure(one_row, rows, invariant)
        keep, drop = m.choose(True), m.choose(False)
        assert m.one_row_us[drop.one_row] <= m.one_row_us[keep.one_row] * TIE
        assert m.rows_time(drop.one_row, drop.rows) <= m.rows_time(keep.one_row, keep.rows) * TIE
        exact = m.one_row_us["plain"]
        assert m.one_row_us[keep.one_row] <= exact * TIE and m.rows_time(keep.one_row, keep.rows) <= exact * TIE * 16
        assert keep.rows == "per_row" or [keep.one_row, keep.rows] in invariant


def test_measurements_are_cached_per_machine(onboard_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    weight = torch.randn(80, 48).to(torch.bfloat16)
    first = KernelCache()
    key, measured, cached = first.measure([weight], bias=True)
    assert not cached and key == "cpu:bfloat16:80x48:bias"
    stored = json.loads(first.path.read_text())
    assert stored["machine"] == machine() and key in stored["shapes"]
    assert KernelCache().measure([weight], bias=True)[1:] == (measured, True)
    other = "AVX512_CORE" if os.environ.get("ONEDNN_MAX_CPU_ISA") == "AVX2" else "AVX2"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", other)  # another ISA: another machine to measure
    assert KernelCache().path != first.path


def test_choose_kernels_binds_every_linear_of_a_shape_alike() -> None:
    gen = torch.Generator().manual_seed(4)
    model = torch.nn.ModuleList(
        [EngineLinear(torch.randn(64, 32, generator=gen).to(torch.bfloat16)) for _ in range(3)]
        + [EngineLinear(torch.randn(32, 64, generator=gen).to(torch.bfloat16))]
    )
    report = choose_kernels(model, batch_invariant=True)
    assert sorted((r["shape"], r["count"]) for r in report) == [
        ("cpu:bfloat16:32x64:nobias", 1),
        ("cpu:bfloat16:64x32:nobias", 3),
    ]
    assert all(m.kernels is not None for m in model)
    assert len({m.kernels.choice for m in model[:3]}) == 1
    x = torch.randn(PROBE_ROWS, 32, generator=gen).to(torch.bfloat16)
    assert torch.equal(model[0](x)[:1], model[0](x[:1]))  # batch invariant as chosen
