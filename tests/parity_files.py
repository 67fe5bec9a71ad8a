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
