"""Measuring fast numerics' kernels on this machine (`kernels.py` says what and why): each
candidate timed per weight shape, the order probe's invariance and rounding checks, the
measurements cached per machine, and every `EngineLinear` of a model bound to its choice."""

import hashlib
import json
import os
import platform
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from onboard import atomic
from onboard.engine.kernels import PROBE_ROWS, BoundKernels, KernelChoice, ShapeMeasure, candidates
from onboard.paths import cache_dir

_TIMED_WEIGHTS = 8  # distinct weights of a shape cycled through per timing pass (not all cache-hot)
_REPEATS = 7
TILE_ROWS = (16, 32, 64, 128)  # the tile sizes `tiled` is probed with
PREFILL_ROWS = (64, 256)  # row counts of a prefill, whose rounding a tile is compared with
_CACHE_VERSION = 4


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


def _probe(weight: torch.Tensor, x: torch.Tensor, b: torch.Tensor | None) -> tuple[list[list[str]], list[str]]:
    """On the order probe: the invariant (one-row, several-row) pairs, and the one-row kernels
    that give `plain`'s bits (exact numerics' rounding)."""
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
    probe = order_probe(out_features, in_features, first.dtype, first.device, bias)
    invariant, exact_one_row = _probe(*probe)
    tiles = _probe_tiles(*probe)
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
