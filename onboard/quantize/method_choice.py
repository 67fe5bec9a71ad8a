"""`method: auto`: the candidate methods measured on calibration text by end-to-end KL.

From round-to-nearest, each candidate in the recipe's order is quantized uniformly in the run's
format and scored on the search's calibration tokens; it replaces the best so far only when its
per-token KL sits more than MIN_Z standard errors below the best's (the layer search's rule), so
a lever that buys nothing measurable is not kept.  A candidate's gain is paired per token with
the best's, which removes the text's own variation from the comparison.
"""

import time
from typing import Any

import torch
from datasets import Dataset

from onboard.console import console
from onboard.evaluate.replay import LayerReplay
from onboard.quantize.auto import search_windows
from onboard.quantize.modifiers import quantized_copy
from onboard.quantize.search import MIN_Z, gain_z
from onboard.recipes import Method, Quantize


def method_of(name: str) -> Method:
    return Method(**Method.parse(name))


def choose_method(model, tokenizer, settings: Quantize, fmt: str, dataset: Dataset) -> tuple[Method, dict[str, Any]]:
    """The kept method and the trace: each candidate's mean KL, its gain in standard errors over
    the best before it, and whether it was kept."""
    replay = LayerReplay(model, search_windows(dataset, settings.search.tokens))
    candidates = [name for name in settings.candidates if method_of(name) != Method()]
    if fmt != "nvfp4":  # auto-round's NVFP4 preset is W4A4: elsewhere it would round to nearest
        candidates = [name for name in candidates if method_of(name).algorithm != "autoround"]
    console.print(f"method auto: rtn and {len(candidates)} candidates in {fmt} on {replay.num_tokens} tokens")

    def measure(method: Method) -> tuple[torch.Tensor, float]:
        clock = time.perf_counter()
        copy = quantized_copy(model, tokenizer, settings.model_copy(update={"method": method}), fmt, dataset)
        kl = replay.model_kl(copy)
        del copy
        return kl, time.perf_counter() - clock

    best = Method()
    best_kl, seconds = measure(best)
    trace = [{"method": best.name, "mean_kld": float(best_kl.mean()), "gain_z": None, "kept": True, "seconds": seconds}]
    for name in candidates:
        method = method_of(name)
        kl, seconds = measure(method)
        z = gain_z(best_kl, kl)
        kept = z > MIN_Z
        trace.append({"method": method.name, "mean_kld": float(kl.mean()), "gain_z": round(z, 2), "kept": kept})
        trace[-1]["seconds"] = round(seconds, 1)
        verdict = "kept" if kept else "not kept"
        console.print(f"  {method.name}: KL {float(kl.mean()):.4f}, {z:+.1f} SE against {best.name}: {verdict}")
        if kept:
            best, best_kl = method, kl
    record = {
        "chosen": best.name,
        "format": fmt,
        "tokens": replay.num_tokens,
        "min_z": MIN_Z,
        "trace": trace,
    }
    return best, record
