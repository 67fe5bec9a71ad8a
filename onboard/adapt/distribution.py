"""The end-to-end parity rule for artifacts whose linears quantize their inputs to 4 bits.

Every linear of a W4A4 artifact re-quantizes its input to FP4, so a last-bit difference in any
kernel upstream grows to the size of the quantization noise within a few layers: two correct
implementations (transformers on two CPUs, the engine's exact and fast numerics) pick other
tokens, and no token-level rule passes them.  Nor does "the engine stays much closer to
transformers than the quantization moved it": on the demo's mixed artifact, transformers against
itself with oneDNN switched off, or on inputs moved by one ulp, is 0.87 and 0.86 of the
quantization's own KL.  What a correct engine still shows, on the
same teacher-forced tokens on every side:

  kl_ratio     KL(transformers || engine) / KL(transformers || transformers on inputs moved by one
               ulp): the engine is no further from transformers than transformers is from itself
               under a last-bit difference (the floor, measured in the same run on any device);
  damage_diff  |KL(source || engine) - KL(source || transformers)| / KL(source || transformers),
               less how far the same one-ulp move shifts transformers' own damage (`damage_floor`,
               0 when under it): the damage the engine serves is the damage transformers measures,
               to within what a last-bit difference changes it by.  On the quick demo's artifact
               fast numerics on an AVX-512 CPU without avx512_bf16 or AMX served 16.7 % more damage (5 standard errors),
               while a one-ulp move moved transformers itself by 0.95 of the quantization's KL.

`source` is the unquantized model the artifact was made from.  A layer that computes something
else may still hide in these averages (a 5 % scaled o_proj gives kl_ratio below 1): the layerwise
rule (`layerwise.py`) names it.
"""

from typing import Any

import torch

_NO_DAMAGE = 1e-9  # nats: below this the artifact is its source


def quantizes_activations_to_4_bits(config: dict[str, Any]) -> bool:
    """Whether any config group of the checkpoint's compressed-tensors config quantizes its
    linears' inputs to 4 bits (NVFP4 W4A4)."""
    groups = (config.get("quantization_config") or {}).get("config_groups") or {}
    return any((group.get("input_activations") or {}).get("num_bits") == 4 for group in groups.values())


@torch.inference_mode()
def moved_input_logits(model: torch.nn.Module, input_ids: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The floor's side: a transformers model's `[T, V]` logits for one `[1, T]` sequence whose input
    embeddings are moved by one ulp, as the layerwise rule moves each layer's input."""
    from onboard.adapt.layerwise import last_bit_perturbed

    inputs = model.get_input_embeddings()(input_ids)
    return model(inputs_embeds=last_bit_perturbed(inputs, generator)).logits[0].float()


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """Per-position KL(p || q) in float64 over `[T, V]` logits."""
    p = p_logits.double().log_softmax(-1)
    q = q_logits.double().log_softmax(-1)
    return (p.exp() * (p - q)).sum(-1).clamp_min(0)


class DistributionParity:
    """The rule's statistics for one or more engine sides against one transformers reference."""

    def __init__(self) -> None:
        self.damage: list[torch.Tensor] = []  # KL(source || transformers) per position
        self.floor: list[torch.Tensor] = []  # KL(transformers || transformers on moved inputs)
        self.moved_damage: list[torch.Tensor] = []  # KL(source || transformers on moved inputs)
        self.sides: dict[str, dict[str, list[torch.Tensor]]] = {}

    def update(
        self, source: torch.Tensor, reference: torch.Tensor, moved: torch.Tensor, engines: dict[str, torch.Tensor]
    ) -> None:
        """One prompt's `[T, V]` logits on the same positions: the source model's, transformers' on
        the artifact, transformers' on inputs moved by one ulp (`moved_input_logits`), and each
        engine side's."""
        self.damage.append(_kl(source, reference))
        self.floor.append(_kl(reference, moved))
        self.moved_damage.append(_kl(source, moved))
        for side, logits in engines.items():
            parts = self.sides.setdefault(side, {"implementation": [], "engine_damage": []})
            parts["implementation"].append(_kl(reference, logits))
            parts["engine_damage"].append(_kl(source, logits))

    def summary(self, side: str) -> dict[str, Any]:
        damage = torch.cat(self.damage)
        implementation = torch.cat(self.sides[side]["implementation"])
        engine_damage = torch.cat(self.sides[side]["engine_damage"])
        mean_damage, floor = float(damage.mean()), float(torch.cat(self.floor).mean())
        scale = max(mean_damage, _NO_DAMAGE)  # an artifact equal to its source: any difference counts whole
        damage_floor = abs(float(torch.cat(self.moved_damage).mean()) - mean_damage) / scale
        return {
            "kl_transformers_engine": float(implementation.mean()),
            "kl_transformers_floor": floor,
            "kl_source_transformers": mean_damage,
            "kl_source_engine": float(engine_damage.mean()),
            "kl_ratio": float(implementation.mean()) / max(floor, _NO_DAMAGE),
            "damage_diff": max(0.0, abs(float(engine_damage.mean()) - mean_damage) / scale - damage_floor),
            "damage_floor": damage_floor,
            # the paired difference's standard error, relative: what chance alone moves damage_diff by
            "damage_diff_se": float((engine_damage - damage).std() / len(damage) ** 0.5) / scale,
            "num_positions": len(damage),
        }
