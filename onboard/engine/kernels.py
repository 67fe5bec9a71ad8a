"""Fast numerics' linear kernels, chosen per weight shape by measuring them on this machine.

PyTorch has several ways to multiply bf16 rows by a weight on a CPU, and which is fastest, and
which gives a row the same bits alone and among other rows (batch invariance), depends on the
CPU (AMX, AVX-512, AVX2), the oneDNN build and the shape: on one machine oneDNN's one-row
kernel sums like its several-row one, on another it does not.  So fast numerics measures rather
than assumes.  At engine start, for each distinct weight shape, every candidate is timed on one
row and on `PROBE_ROWS` rows, and every pair (one-row kernel, several-row kernel) is checked for
invariance on an order probe: a product whose fp32 sum depends on the summation order (large
terms that cancel in pairs, placed apart, among small ones), so that any kernel that sums a row
in another order alone than in a batch gives other bits.  The measurements are cached per
machine (CPU model and flags, the oneDNN ISA cap, PyTorch, threads) and shape
(`kernel_measure.py`).

Candidates (one row / several rows):
  plain    `F.linear` on the plain weight: what exact numerics and transformers call
  onednn   oneDNN's matmul on the weight reordered once into its blocked layout (as PyTorch's
           inductor freezing pass does): no per-call reorder
  onednn2  (one row) the row padded to two: oneDNN runs one row through another kernel
  pytorch  PyTorch's own kernels, oneDNN off for the call (its one-row GEMV streams the weight
           fastest on some CPUs)
  per_row  (several rows) each row on its own through the one-row kernel: invariant by
           construction

A linear that quantizes its input (W4A4, FP8 W8A8) re-quantizes every last-bit difference
upstream into other 4- or 8-bit values, and a W4A4 model amplifies them into other tokens and
another damage.  So in a model with such linears, every linear whose output reaches a quantizer
(all but the output head: `feeds_quantizer`) is chosen for its rounding first, and none is fused
(`weights.py`).  Which order a CPU kernel sums a row in depends on how many rows the call has: on
an AMX Xeon, `F.linear` rounds a row as its one-row kernel does below about 40 rows, otherwise
from there to a few hundred, and a probe at a few row counts proves nothing for the others.  So
no kernel that takes a step's rows as they come is batch invariant there, and one more candidate
is offered to these linears:

  tiled    (one row and several) `F.linear` over `tile_rows` rows at a time, the last tile padded
           with zeros: every call has the same row count, so a row gets the same bits alone,
           batched, after a prefix-cache hit or in a speculative verification

With batch invariance, a feeds-quantizer linear runs `tiled`, among the tile sizes the probe
found invariant (a row's bits the same at any place in a tile, beside any other rows), the one
that most often rounds as `F.linear` does at a prefill's row counts (what transformers runs for a
prompt), then the fastest on one row.  On the AMX Xeon, tiles of 16 or 32 rows round as one row
does and served 19 % more damage than transformers on the quick demo's artifact, tiles of 48 or
more 3 % (transformers itself on inputs moved by one ulp: 3-7 %).  A lone row then costs a tile:
there, batch-invariant fast numerics decodes that artifact more slowly than exact numerics at
concurrency 1 (and several times faster at 16; `docs/benchmarks.md`).  Without batch invariance:
`plain` on several rows (exact's rounding at any count) and, on one row, a kernel that gave
`plain`'s bits on the probe, a single row being a single case.

For the other linears (`ShapeMeasure.choose`): without batch invariance, the fastest kernel for
one row and the fastest for several; with it, the invariant pair (`per_row` pairs with any
one-row kernel) with the least time per token at one row plus at `PROBE_ROWS` rows, among pairs
no slower than exact numerics' `F.linear` one row at a time.  A candidate within `TIE` of exact's
own kernel is no measured gain: then exact's kernel is kept, and fast rounds as exact does.  So
fast numerics is never slower than exact numerics, and dropping invariance never slower than
keeping it, up to the timing's noise.  Not a CPU (or not bf16): the same measurement over the
candidates there are.
"""

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from onboard import cpu_bf16

# PyTorch's CPU addmm hands a bf16 product to oneDNN only when m*n*k exceeds 16**3 (`checksize` in
# aten/src/ATen/native/mkldnn/Matmul.cpp); smaller ones run its own kernel.
_ONEDNN_MIN_SIZE = 16**3
PROBE_ROWS = 16  # rows of the several-row timing and of the invariance probe
TIE = 1.1  # a gain within this factor is timing noise: exact's own kernel is kept


def onednn_packs(weight: torch.Tensor) -> bool:
    """Whether oneDNN can hold `weight` pre-reordered (a CPU bf16 matrix PyTorch would give it)."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.dim() != 2:
        return False
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    mkldnn = torch.ops.mkldnn
    if not (hasattr(mkldnn, "_reorder_linear_weight") and mkldnn._is_mkldnn_bf16_supported()):
        return False
    return weight.shape[0] * weight.shape[1] > _ONEDNN_MIN_SIZE  # then m*n*k > 16**3 for every m


def pytorch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear` through PyTorch's own kernels rather than oneDNN.  PyTorch has no public switch
    for one call; the flag is restored even on error."""
    enabled = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        return F.linear(x, weight, bias)
    finally:
        torch._C._set_mkldnn_enabled(enabled)


@dataclass(frozen=True)
class KernelChoice:
    one_row: str
    rows: str
    tile_rows: int = 0  # `tiled`'s rows per call


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tile_rows: int) -> torch.Tensor:
    """`F.linear` over `tile_rows` rows at a time, the last tile padded with zeros: one row count
    for every call, so a row's bits do not depend on the rows beside it (where the probe found
    the kernel gives every place in a tile the same bits)."""
    rows = x.shape[0]
    padded = torch.cat([x, x.new_zeros(-rows % tile_rows, x.shape[1])]) if rows % tile_rows else x
    tiles = [F.linear(padded[i : i + tile_rows], weight, bias) for i in range(0, padded.shape[0], tile_rows)]
    return (tiles[0] if len(tiles) == 1 else torch.cat(tiles))[:rows]


class BoundKernels:
    """A weight held as `choice` needs it, called on `[T, in]` rows."""

    def __init__(self, weight: torch.Tensor, choice: KernelChoice):
        self.choice = choice
        used = {choice.one_row, choice.rows}
        self.packed = None
        if used & {"onednn", "onednn2"}:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)
        self.reads_plain = bool(used & {"plain", "pytorch", "tiled"})
        self.plain = weight if self.reads_plain else None

    def dense_weight(self) -> torch.Tensor:
        return self.plain if self.plain is not None else self.packed.to_dense()

    def run(self, kernel: str, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # The kernels measured are PyTorch's own: the float32 route (cpu_bf16.py) switches kernels
        # at a row count the invariance probe does not reach.
        with cpu_bf16.bf16_kernels():
            return self._run(kernel, x, bias)

    def _run(self, kernel: str, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if kernel == "plain":
            return F.linear(x, self.plain, bias)
        if kernel == "pytorch":
            return pytorch_linear(x, self.plain, bias)
        if kernel == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
        if kernel == "onednn2":
            return torch.ops.mkldnn._linear_pointwise(x.expand(2, -1), self.packed, bias, "none", [], "")[:1]
        if kernel == "tiled":
            return tiled_linear(x, self.plain, bias, self.choice.tile_rows)
        if kernel == "per_row":
            return torch.cat([self._run(self.choice.one_row, x[i : i + 1], bias) for i in range(x.shape[0])])
        raise ValueError(f"unknown linear kernel {kernel!r}")

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.run(self.choice.one_row if x.shape[0] == 1 else self.choice.rows, x, bias)


@dataclass
class ShapeMeasure:
    """One weight shape on this machine: microseconds per call of each candidate (one row, and
    `PROBE_ROWS` rows), the (one-row, several-row) pairs that gave every row the same bits, the
    one-row kernels that round as `plain` (exact numerics) does, and per tile size of `tiled`
    (`{"rows", "invariant", "prefill_agreement", "one_row_us"}`): whether the probe found it
    invariant, the share of the probe's outputs it rounds as `plain` at `PREFILL_ROWS` rows, and
    its time on one row."""

    one_row_us: dict[str, float]
    rows_us: dict[str, float]
    invariant: list[list[str]]
    exact_one_row: list[str]
    tiles: list[dict[str, Any]]

    def rows_time(self, one_row: str, rows: str) -> float:
        return self.one_row_us[one_row] * PROBE_ROWS if rows == "per_row" else self.rows_us[rows]

    def tile(self) -> int:
        """The invariant tile size that rounds most often as a prefill's `plain`, then the
        fastest on one row; 0 where no size is invariant."""
        invariant = [t for t in self.tiles if t["invariant"]]
        if not invariant:
            return 0
        return min(invariant, key=lambda t: (-t["prefill_agreement"], t["one_row_us"]))["rows"]

    def choose(self, batch_invariant: bool, feeds_quantizer: bool = False) -> KernelChoice:
        """Without batch invariance, the fastest kernel for one row and for several.  With it, the
        invariant pair with the least time per token over one row and over `PROBE_ROWS` rows,
        among those no slower than exact numerics' `F.linear` one row at a time.  Either way,
        exact's own kernel (`plain`) where it is within `TIE` of the fastest: another rounding
        only for a measured gain.  `feeds_quantizer` (a linear whose output reaches a quantizer,
        where a last-bit difference is amplified into other quantized values): with invariance,
        `tiled` (`tile`); without, `plain` on several rows and a one-row kernel that rounds as
        `plain`.  Where no tile is invariant, the same as without: not batch invariant."""
        one_row_us, rows_us = self.one_row_us, self.rows_us
        if feeds_quantizer:
            if batch_invariant and self.tile():
                return KernelChoice("tiled", "tiled", self.tile())
            one_row = _preferred({k: t for k, t in one_row_us.items() if k in self.exact_one_row})
            return KernelChoice(one_row, "plain")
        if not batch_invariant:
            one_row = _preferred(one_row_us)
            rows = [*rows_us, "per_row"]
            return KernelChoice(one_row, _preferred({r: self.rows_time(one_row, r) for r in rows}))
        exact = self.one_row_us["plain"] * TIE
        cost = {
            (k, r): self.one_row_us[k] + self.rows_time(k, r) / PROBE_ROWS
            for k in self.one_row_us
            for r in [*rows_us, "per_row"]
            if (r == "per_row" or [k, r] in self.invariant)
            and self.one_row_us[k] <= exact
            and self.rows_time(k, r) <= exact * PROBE_ROWS
        }
        best = min(cost.values())
        if cost.get(("plain", "plain"), float("inf")) <= best * TIE:
            return KernelChoice("plain", "plain")
        return KernelChoice(*min(cost, key=cost.__getitem__))


def _preferred(times: dict[str, float]) -> str:
    """`plain` where it is within `TIE` of the fastest, else the fastest."""
    fastest = min(times, key=times.__getitem__)
    return "plain" if times.get("plain", float("inf")) <= times[fastest] * TIE else fastest


def candidates(weight: torch.Tensor) -> tuple[list[str], list[str]]:
    """The one-row and several-row kernels (per_row aside) that can run `weight` here."""
    names = ["plain"]
    if weight.device.type == "cpu":
        names.append("pytorch")
    one_row, rows = list(names), list(names)
    if onednn_packs(weight):
        one_row += ["onednn", "onednn2"]
        rows.append("onednn")
    return one_row, rows
