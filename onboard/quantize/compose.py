"""Candidate selections assembled in place from per-format quantized copies of the model."""

import torch
from torch import nn

from onboard.quantize.groups import Group


class Composer:
    """Puts each group's modules of the chosen format into `model`; BF16 is the model's own.

    Every format's copy was quantized whole by llmcompressor, so a module taken from it holds
    exactly what a mixed recipe gives that module (a test checks the equality): weight scales
    are per module and activation scales are calibrated on reference activations.
    """

    def __init__(self, model: nn.Module, sources: dict[str, nn.Module], groups: list[Group]) -> None:
        self.model = model
        self.sources = sources
        self.groups = groups
        self.originals = {unit: model.get_submodule(unit) for g in groups for unit in g.units}

    def _put(self, unit: str, module: nn.Module) -> None:
        parent, _, child = unit.rpartition(".")
        setattr(self.model.get_submodule(parent), child, module)

    def apply(self, assignment: dict[str, str]) -> None:
        """Groups missing from `assignment` go back to BF16."""
        for group in self.groups:
            fmt = assignment.get(group.name, "bf16")
            for unit in group.units:
                self._put(unit, self.originals[unit] if fmt == "bf16" else self.sources[fmt].get_submodule(unit))

    def reset(self) -> None:
        self.apply({})

    @torch.no_grad()
    def weight_error(self, group: Group, fmt: str) -> dict[str, torch.Tensor] | None:
        """Quantized minus original weight per module, None when the module structure differs
        (MoE experts, fused in the original and unfused by llmcompressor)."""
        errors = {}
        for name in group.modules:
            original = self.originals.get(name)
            if original is None:
                return None
            errors[name] = self.sources[fmt].get_submodule(name).weight.float() - original.weight.float()
        return errors
