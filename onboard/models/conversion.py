"""A family's stored tensors as transformers' model holds them: its conversion mapping's renamings
and concatenations (transformers applies them in `from_pretrained`; a layer loaded alone or a model
built by `from_config` and filled by hand must apply them itself), and the parameters it keeps in
float32."""

import torch


def renamed(name: str, model_type: str) -> str:
    """Stored tensor `name` under transformers' module names: its conversion mapping's renamings
    (GLM-5.3-Flash: `self_attn.f_a_proj.weight` is `self_attn.forget_gate.f_a_proj.weight`)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    for renaming in get_checkpoint_conversion_mapping(model_type) or []:
        if type(renaming) is WeightRenaming:
            name, _ = renaming.rename_source_key(name)
    return name


def convert_names(tensors: dict[str, torch.Tensor], model_type: str) -> dict[str, torch.Tensor]:
    """Stored tensors (one layer's, names relative to it, or a whole model's) under transformers' module names:
    its conversion mapping's renamings and whole-tensor concatenations (experts: `fuse_experts`)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import Concatenate, WeightConverter

    mapping = get_checkpoint_conversion_mapping(model_type) or []
    out = {renamed(name, model_type): value for name, value in tensors.items()}
    for converter in mapping:
        ops = getattr(converter, "operations", [])
        if not (isinstance(converter, WeightConverter) and len(ops) == 1 and isinstance(ops[0], Concatenate)):
            continue
        sources, target = converter._original_source_patterns, converter._original_target_patterns[0]
        # each layer's (names relative to one layer, or the whole model's under their prefixes)
        for prefix in [name.removesuffix(sources[0]) for name in out if name.endswith(sources[0])]:
            if all(prefix + source in out for source in sources):
                out[prefix + target] = torch.cat([out.pop(prefix + s) for s in sources], dim=ops[0].dim)
    return out


def keep_in_fp32(module: torch.nn.Module, keys: set[str]) -> None:
    """Make the parameters and buffers the family keeps in float32 (`_keep_in_fp32_modules_strict`:
    names containing one of `keys`) float32 before anything is loaded into them, as `from_pretrained`
    does: the stored values, not their bf16 rounding (GLM-5.3-Flash's convs, `A_log`, router bias)."""
    for name, buffer in list(module.named_buffers()):
        if any(key in name for key in keys):
            owner, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(owner) if owner else module, leaf, buffer.float())
    for name, param in module.named_parameters():
        if any(key in name for key in keys):
            param.data = param.data.float()
