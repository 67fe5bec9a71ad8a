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
machine (CPU model and flags, the oneDNN ISA cap, PyTorch, threads) and shape.

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

import hashlib
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from onboard import atomic
from onboard.paths import cache_dir

# PyTorch's CPU addmm hands a bf16 product to oneDNN only when m*n*k exceeds 16**3 (`checksize` in
# aten/src/ATen/native/mkldnn/Matmul.cpp); smaller ones run its own kernel.
_ONEDNN_MIN_SIZE = 16**3
PROBE_ROWS = 16  # rows of the several-row timing and of the invariance probe
TIE = 1.1  # a gain within this factor is timing noise: exact's own kernel is kept
_TIMED_WEIGHTS = 8  # distinct weights of a shape cycled through per timing pass (not all cache-hot)
_REPEATS = 7
TILE_ROWS = (16, 32, 64, 128)  # the tile sizes `tiled` is probed with
PREFILL_ROWS = (64, 256)  # row counts of a prefill, whose rounding a tile is compared with
_CACHE_VERSION = 4


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
            return torch.cat([self.run(self.choice.one_row, x[i : i + 1], bias) for i in range(x.shape[0])])
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


def order_probe(
    out_features: int, in_features: int, dtype: torch.dtype, device: torch.device, bias: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(weight, `PROBE_ROWS` rows, bias) whose products' fp32 sums depend on the summation order:
    half the columns are pairs of equal large inputs against opposite weights, scattered among
    small terms, so what survives of the small terms depends on where the pairs' partial sums
    meet them.  A kernel summing a row in another order gives other bits in most outputs."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    x = torch.randn(PROBE_ROWS, in_features, generator=gen)
    order = torch.randperm(in_features, generator=gen)
    pairs = in_features // 4
    first, second = order[:pairs], order[pairs : 2 * pairs]
    weight[:, second] = -weight[:, first]
    signs = torch.randint(0, 2, (PROBE_ROWS, pairs), generator=gen) * 2 - 1
    top = 22 if torch.finfo(dtype).max > 1e30 else 12  # float16 would overflow
    large = signs * 2.0 ** torch.randint(top - 8, top, (PROBE_ROWS, pairs), generator=gen)
    x[:, first] = large.float()
    x[:, second] = large.float()
    b = torch.randn(out_features, generator=gen).to(dtype).to(device) if bias else None
    return weight.to(device), x.to(dtype).to(device), b


def _probe(
    out_features: int, in_features: int, dtype: torch.dtype, device: torch.device, bias: bool
) -> tuple[list[list[str]], list[str]]:
    """On the order probe: the invariant (one-row, several-row) pairs, and the one-row kernels
    that give `plain`'s bits (exact numerics' rounding)."""
    weight, x, b = order_probe(out_features, in_features, dtype, device, bias)
    one_row, rows = candidates(weight)
    kernels = BoundKernels(weight, KernelChoice("onednn" if "onednn" in one_row else "plain", "plain"))
    alone = {k: torch.cat([kernels.run(k, x[i : i + 1], b) for i in range(PROBE_ROWS)]) for k in one_row}
    batched = {r: [kernels.run(r, x[:m], b) for m in (2, 3, PROBE_ROWS)] for r in rows}
    invariant = [
        [k, r] for k in one_row for r in rows if all(torch.equal(out, alone[k][: out.shape[0]]) for out in batched[r])
    ]
    exact_one_row = [k for k in one_row if torch.equal(alone[k], alone["plain"])]
    return invariant, exact_one_row


def _probe_tiles(weight: torch.Tensor, x: torch.Tensor, b: torch.Tensor | None) -> list[dict[str, Any]]:
    """Per tile size, on the order probe: whether every row gets its bits alone at any place in a
    tile beside other rows (at the start, one row in, and across a tile boundary), and the share of
    outputs that match `plain` on a prefill of `PREFILL_ROWS` rows (the probe's rows among others)."""
    gen = torch.Generator().manual_seed(2)
    filler = torch.randn(max(*PREFILL_ROWS, 2 * max(TILE_ROWS)) + PROBE_ROWS, x.shape[1], generator=gen)
    filler = filler.to(x.dtype).to(x.device)
    prefill = [F.linear(torch.cat([x, filler[: m - PROBE_ROWS]]), weight, b)[:PROBE_ROWS] for m in PREFILL_ROWS]
    tiles = []
    for tile_rows in TILE_ROWS:
        kernels = BoundKernels(weight, KernelChoice("tiled", "tiled", tile_rows))
        alone = torch.cat([kernels(x[i : i + 1], b) for i in range(PROBE_ROWS)])
        invariant = True
        for offset in (0, 1, tile_rows - PROBE_ROWS // 2):
            rows = torch.cat([filler[:offset], x, filler[offset : offset + tile_rows]])
            invariant &= torch.equal(kernels(rows, b)[offset : offset + PROBE_ROWS], alone)
        agreement = float(torch.stack([(alone == out).float().mean() for out in prefill]).mean())
        one_row_us = _time_us([lambda k=kernels: k(x[:1], b)], weight.device)
        tiles.append(
            {"rows": tile_rows, "invariant": invariant, "prefill_agreement": agreement, "one_row_us": one_row_us}
        )
    return tiles


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_us(calls: list, device: torch.device) -> float:
    """Microseconds per call: the fastest of `_REPEATS` passes through `calls` (after one warm-up).
    The minimum, as `timeit` takes it: another process on the machine only ever adds time."""
    for call in calls:
        call()
    samples = []
    for _ in range(_REPEATS):
        _sync(device)
        start = time.perf_counter()
        for call in calls:
            call()
        _sync(device)
        samples.append((time.perf_counter() - start) / len(calls) * 1e6)
    return min(samples)


@torch.inference_mode()
def measure_shape(weights: list[torch.Tensor], bias: bool) -> ShapeMeasure:
    """Time every candidate on the given weights of one shape and probe the pairs' invariance."""
    weights = weights[:_TIMED_WEIGHTS]
    first = weights[0]
    out_features, in_features = first.shape
    one_row, rows = candidates(first)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(PROBE_ROWS, in_features, generator=gen).to(first.dtype).to(first.device)
    b = torch.zeros(out_features, dtype=first.dtype, device=first.device) if bias else None
    bound = [BoundKernels(w, KernelChoice("onednn" if "onednn" in one_row else "plain", "plain")) for w in weights]
    one_row_us = {k: _time_us([lambda h=h, k=k: h.run(k, x[:1], b) for h in bound], first.device) for k in one_row}
    rows_us = {r: _time_us([lambda h=h, r=r: h.run(r, x, b) for h in bound], first.device) for r in rows}
    invariant, exact_one_row = _probe(out_features, in_features, first.dtype, first.device, bias)
    tiles = _probe_tiles(*order_probe(out_features, in_features, first.dtype, first.device, bias))
    return ShapeMeasure(one_row_us, rows_us, invariant, exact_one_row, tiles)


def machine() -> dict[str, Any]:
    """What a kernel measurement depends on besides the shape."""
    info: dict[str, Any] = {
        "arch": platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "onednn_isa_cap": os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "",
        "mkldnn": bool(torch.backends.mkldnn.enabled),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        cpuinfo = platform.processor()
    fields = dict(line.split(":", 1) for line in cpuinfo.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    info["cpu"] = fields.get("model name", platform.processor())
    info["cpu_flags"] = hashlib.sha256(fields.get("flags", "").encode()).hexdigest()[:16]
    if torch.cuda.is_available():
        info["cuda"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def _shape_key(weight: torch.Tensor, bias: bool) -> str:
    dtype = str(weight.dtype).removeprefix("torch.")
    return f"{weight.device.type}:{dtype}:{weight.shape[0]}x{weight.shape[1]}:{'bias' if bias else 'nobias'}"


_MEMO: dict[str, dict[str, ShapeMeasure]] = {}


class KernelCache:
    """The measurements of this machine, on disk under the user's cache (`kernels/<machine>.json`)."""

    def __init__(self) -> None:
        self.machine = machine()
        digest = hashlib.sha256(json.dumps(self.machine, sort_keys=True).encode()).hexdigest()[:16]
        self.path = cache_dir() / "kernels" / f"{digest}.json"
        self.shapes = _MEMO.setdefault(str(self.path), self._load())

    def _load(self) -> dict[str, ShapeMeasure]:
        try:
            data = json.loads(self.path.read_text())
            if data.get("version") != _CACHE_VERSION:
                return {}
            return {key: ShapeMeasure(**value) for key, value in data["shapes"].items()}
        except (OSError, ValueError, KeyError, TypeError):
            return {}  # absent or unreadable: measured again

    def measure(self, weights: list[torch.Tensor], bias: bool) -> tuple[str, ShapeMeasure, bool]:
        """(shape key, its measurement, whether it was cached)."""
        key = _shape_key(weights[0], bias)
        if key in self.shapes:
            return key, self.shapes[key], True
        self.shapes[key] = measure_shape(weights, bias)
        data = {"version": _CACHE_VERSION, "machine": self.machine}
        data["shapes"] = {k: asdict(v) for k, v in sorted(self.shapes.items())}
        atomic.write_json(self.path, data)
        return key, self.shapes[key], False


def choose_kernels(model: torch.nn.Module, batch_invariant: bool) -> list[dict[str, Any]]:
    """Bind every `EngineLinear` of `model` to the kernels measured fastest for its shape here;
    returns one row per shape: what was chosen and the timings it was chosen by."""
    from onboard.engine.linear import EngineLinear

    linears = [module for module in model.modules() if isinstance(module, EngineLinear)]
    # once any linear quantizes its input, every product but the head's reaches a quantizer
    quantized = any(module.act_quant is not None for module in linears)
    head = getattr(model, "lm_head", None)
    groups: dict[tuple, list[EngineLinear]] = {}
    for module in linears:
        w, bias, feeds = module.weight, module.bias is not None, quantized and module is not head
        groups.setdefault((tuple(w.shape), w.dtype, w.device, bias, feeds), []).append(module)
    cache = KernelCache()
    report = []
    for (_, _, _, bias, feeds), linears in groups.items():
        key, measured, cached = cache.measure([m.weight for m in linears], bias)
        choice = measured.choose(batch_invariant, feeds_quantizer=feeds)
        for module in linears:
            module.use_kernels(choice)
        report.append(
            {
                "shape": key,
                "count": len(linears),
                "feeds_quantizer": feeds,
                "one_row": choice.one_row,
                "rows": choice.rows,
                "tile_rows": choice.tile_rows,
                "one_row_us": measured.one_row_us,
                "rows_us": measured.rows_us,
                "invariant_pairs": measured.invariant,
                "exact_one_row": measured.exact_one_row,
                "tiles": measured.tiles,
                "cached": cached,
            }
        )
    return report
