"""Shared test helpers for hand-made `adapt/parity.json` files."""

from typing import Any

from onboard.recipes import Gate


def layer_entry(index: int, floor_ratio: float, linear_ratio: float, worst_linear: str) -> dict[str, Any]:
    """One decoder layer of a `layerwise` block, judged by the default Gate's ratios."""
    gate = Gate()
    return {
        "layer": f"model.layers.{index}",
        "max_abs_diff": 0.0625,
        "relative_diff": 0.004,
        "error_rms": 0.002 * floor_ratio,
        "floor_rms": 0.002,
        "floor_ratio": floor_ratio,
        "passed": floor_ratio <= gate.max_parity_layer_ratio and linear_ratio <= gate.max_parity_linear_ratio,
        "linear_ratio": linear_ratio,
        "worst_linear": f"model.layers.{index}.{worst_linear}",
    }


def distribution(
    kl_transformers_engine: float, kl_source_engine: float, kl_ratio: float, damage_diff: float, damage_diff_se: float
) -> dict[str, Any]:
    """A `distribution` block against a source 0.05 nats away from transformers and a one-ulp floor
    0.05 nats away, 512 positions."""
    return {
        "kl_transformers_engine": kl_transformers_engine,
        "kl_transformers_floor": 0.05,
        "kl_source_transformers": 0.05,
        "kl_source_engine": kl_source_engine,
        "kl_ratio": kl_ratio,
        "damage_diff": damage_diff,
        "damage_diff_se": damage_diff_se,
        "num_positions": 512,
    }


EXACT_DISTRIBUTION = distribution(1e-4, 0.05105, 0.002, 0.021, 0.011)
FAST_DISTRIBUTION = distribution(0.015, 0.0504, 0.3, 0.008, 0.012)


def layerwise_block(layers: list[dict[str, Any]]) -> dict[str, Any]:
    """A passing-or-not `layerwise` block over `layers` (from `layer_entry`) and a head at 0.83."""
    gate = Gate()
    head = {
        k: v
        for k, v in layer_entry(len(layers), 0.83, 0, "lm_head").items()
        if k not in ("linear_ratio", "worst_linear")
    }
    failing = [entry["layer"] for entry in layers if not entry["passed"]]
    return {
        "num_tokens": 512,
        "max_layer_ratio": gate.max_parity_layer_ratio,
        "layers": layers,
        "head": {**head, "layer": "head"},
        "max_abs_diff": 0.0625,
        "max_floor_ratio": max(entry["floor_ratio"] for entry in [*layers, head]),
        "max_linear_ratio": max(entry["linear_ratio"] for entry in layers),
        "max_linear_ratio_allowed": gate.max_parity_linear_ratio,
        "passed": not failing,
        "first_failing_layer": failing[0] if failing else None,
        "first_failing_module": None,
    }
