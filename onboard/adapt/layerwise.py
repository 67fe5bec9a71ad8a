"""Layerwise parity: the engine's and transformers' decoder layers compared one at a time.

For a checkpoint larger than memory, whole-model parity cannot hold both models at once.  Here
only the embeddings, the head and ONE decoder layer of each side are resident at a time: the
reference stream starts at the embeddings of the parity prompts, and for each layer i both sides
run layer i (built from the checkpoint's tensors for that layer only) on transformers' recorded
input of layer i, the outputs are compared, and transformers' output becomes layer i+1's input.
A layer that computes something else is caught and named, whatever the layers around it do.
Finally the engine's norm and lm_head run on transformers' last hidden states.

Plain (unquantized) checkpoints only: compressed-tensors decompresses a model as a whole.
transformers 5 holds MoE experts as fused 3-D tensors that checkpoints store per expert; the
per-layer load stacks them as its conversion mapping does (gate and up concatenated).
"""

import copy
import re
from pathlib import Path
from typing import Any

import torch
from rich.progress import Progress
from safetensors import safe_open

from onboard.console import console
from onboard.errors import OnboardError

# Per-layer tolerance on max |Δ| relative to the reference's largest magnitude (at least 1):
# the engine's prefill kernels are transformers' own, so agreement is usually exact.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1 / 64}
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _layer_tensors(path: Path, prefix: str) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (a safe_open handle is not a mapping)
                if name.startswith(prefix):
                    out[name[len(prefix) :]] = handle.get_tensor(name)
    return out


def _fuse_experts(tensors: dict[str, torch.Tensor], wanted: set[str]) -> dict[str, torch.Tensor]:
    """Per-expert `mlp.experts.E.{gate,up,down}_proj.weight` as transformers' fused parameters."""
    experts: dict[str, dict[int, torch.Tensor]] = {}
    out = {}
    for name, value in tensors.items():
        match = _EXPERT.match(name)
        if match and "mlp.experts.gate_up_proj" in wanted:
            experts.setdefault(match.group(2), {})[int(match.group(1))] = value
        else:
            out[name] = value
    if experts:
        count = len(experts["gate_proj"])
        out["mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([experts["gate_proj"][e], experts["up_proj"][e]]) for e in range(count)]
        )
        out["mlp.experts.down_proj"] = torch.stack([experts["down_proj"][e] for e in range(count)])
    return out


class _Reference:
    """transformers' pieces of the model, built one decoder layer at a time."""

    def __init__(self, path: Path, config: Any, dtype: torch.dtype, device: torch.device):
        from transformers import AutoModelForCausalLM

        config = copy.deepcopy(config)  # the engine keeps its own
        config._attn_implementation = "sdpa"
        self.path, self.config, self.dtype, self.device = path, config, dtype, device
        with torch.device("meta"):
            shell = AutoModelForCausalLM.from_config(config, dtype=dtype)
        self.layer_cls = type(shell.model.layers[0])
        self.norm_cls = type(shell.model.norm)
        self.rotary = type(shell.model.rotary_emb)(config).to(device)
        self.keep_fp32 = set(getattr(shell, "_keep_in_fp32_modules_strict", None) or [])

    def layer(self, index: int) -> torch.nn.Module:
        module = self.layer_cls(self.config, index).to(self.dtype)
        for name, buffer in list(module.named_buffers()):
            if any(key in name for key in self.keep_fp32):
                owner, _, leaf = name.rpartition(".")
                setattr(module.get_submodule(owner) if owner else module, leaf, buffer.float())
        wanted = set(module.state_dict())
        tensors = _fuse_experts(_layer_tensors(self.path, f"model.layers.{index}."), wanted)
        missing = sorted(wanted - set(tensors))
        if missing:
            raise OnboardError(f"layerwise parity: model.layers.{index} has no stored {missing[0]}")
        module.load_state_dict({k: tensors[k] for k in wanted}, strict=True)
        return module.to(self.device).eval()

    def mask(self, embeds: torch.Tensor, position_ids: torch.Tensor):
        from transformers.masking_utils import create_causal_mask

        sparse = getattr(self.config, "index_topk", None) is not None  # DSA layers always get a mask
        return create_causal_mask(
            config=self.config,
            inputs_embeds=embeds,
            attention_mask=None,
            past_key_values=None,
            position_ids=position_ids,
            allow_is_causal_skip=not sparse,
        )


def _engine_step(engine_model, length: int, device: torch.device):
    """A StepContext for one prefill of `length` tokens over a private cache holding every layer."""
    from onboard.engine.attention import attention_backend
    from onboard.engine.batch import ForwardBatch
    from onboard.engine.context import StepContext
    from onboard.engine.kv_cache import KVCache

    block = 16
    blocks = -(-length // block)
    cache = KVCache(engine_model.kv_layout, blocks, block, device)
    positions = torch.arange(length, device=device)
    batch = ForwardBatch(
        input_ids=torch.zeros(length, dtype=torch.long, device=device),
        positions=positions,
        slot_mapping=positions,
        query_lens=[length],
        context_lens=[length],
        block_tables=[list(range(blocks))],
        logits_indices=torch.tensor([length - 1], device=device),
        block_size=block,
        decoding=[False],
    )
    backend = attention_backend(device)
    ctx = StepContext(cache, backend, backend.build_metadata(batch), positions, trace={})
    engine_model.prepare(batch, ctx)
    return ctx


def check_layerwise(path: Path) -> Any:
    """The checkpoint's config, or a one-line refusal of what layerwise parity cannot compare."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    if getattr(config, "quantization_config", None):
        raise OnboardError("layerwise parity runs on plain checkpoints; this one is quantized (compressed-tensors)")
    if any(t == "sliding_attention" for t in getattr(config, "layer_types", None) or []):
        raise OnboardError("layerwise parity does not build sliding-window masks yet; run whole-model adapt")
    return config


def _diff(mine: torch.Tensor, theirs: torch.Tensor, dtype: torch.dtype) -> dict[str, Any]:
    mine, theirs = mine.float(), theirs.float()
    scale = max(1.0, float(theirs.abs().max()))
    worst = float((mine - theirs).abs().max())
    return {"max_abs_diff": worst, "relative_diff": worst / scale, "passed": worst / scale <= TOLERANCE[dtype]}


@torch.inference_mode()
def measure_layerwise(path: Path, prompts: list[list[int]], dtype: torch.dtype, device: str = "cpu") -> dict[str, Any]:
    """Per decoder layer (and the head), the engine's output against transformers' on transformers' input."""
    from onboard.engine.models import model_class
    from onboard.engine.weights import CheckpointWeights

    device_ = torch.device(device)
    config = check_layerwise(path)
    weights = CheckpointWeights(path, dtype=dtype, device=device_)
    engine_model = model_class(config)(config, weights, layer_ids=())
    reference = _Reference(path, config, dtype, device_)
    streams = [engine_model.embed_tokens[torch.tensor(p, device=device_)] for p in prompts]
    contexts = [_engine_step(engine_model, len(p), device_) for p in prompts]
    topk: list[torch.Tensor | None] = [None] * len(prompts)
    layers = []
    with Progress(console=console) as progress:
        task = progress.add_task("layerwise parity", total=config.num_hidden_layers)
        for index in range(config.num_hidden_layers):
            theirs_layer = reference.layer(index)
            mine_layer = engine_model.make_layer(config, weights, f"model.layers.{index}", index)
            entry = {"layer": f"model.layers.{index}", "max_abs_diff": 0.0, "relative_diff": 0.0, "passed": True}
            for p, x in enumerate(streams):
                position_ids = torch.arange(x.shape[0], device=device_)[None]
                embeds = x[None]
                kwargs = {
                    "attention_mask": reference.mask(embeds, position_ids),
                    "position_ids": position_ids,
                    "position_embeddings": reference.rotary(embeds, position_ids),
                }
                if getattr(config, "indexer_types", None) is not None:
                    kwargs["prev_topk_indices"] = topk[p]
                out = theirs_layer(embeds, **kwargs)
                if isinstance(out, tuple):  # GLM-5 layers hand their top-k to the next layer
                    out, topk[p] = out
                want = out[0]
                got = mine_layer.forward(x, contexts[p])
                diff = _diff(got, want, dtype)
                entry["max_abs_diff"] = max(entry["max_abs_diff"], diff["max_abs_diff"])
                entry["relative_diff"] = max(entry["relative_diff"], diff["relative_diff"])
                entry["passed"] = entry["passed"] and diff["passed"]
                streams[p] = want
            layers.append(entry)
            del theirs_layer, mine_layer
            progress.advance(task)
    head = _head(path, config, engine_model, reference, streams, dtype, device_)
    failing = [e["layer"] for e in layers if not e["passed"]] + ([] if head["passed"] else ["head"])
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "num_prompts": len(prompts),
        "num_tokens": sum(len(p) for p in prompts),
        "layers": layers,
        "head": head,
        "max_abs_diff": max([e["max_abs_diff"] for e in layers] + [head["max_abs_diff"]]),
        "passed": not failing,
        "first_failing_layer": failing[0] if failing else None,
    }


def _head(path, config, engine_model, reference: _Reference, streams, dtype, device) -> dict[str, Any]:
    """The final norm and lm_head of both sides on transformers' last hidden states."""
    norm = reference.norm_cls(config.hidden_size, eps=config.rms_norm_eps)
    tensors = {"weight": _layer_tensors(path, "model.norm.")["weight"]}
    norm.load_state_dict(tensors)
    norm = norm.to(device=device, dtype=dtype)
    if getattr(config, "tie_word_embeddings", False):
        head_weight = engine_model.embed_tokens
    else:
        head_weight = _layer_tensors(path, "lm_head.")["weight"].to(device=device, dtype=dtype)
    result = {"layer": "head", "max_abs_diff": 0.0, "relative_diff": 0.0, "passed": True}
    for x in streams:
        want = torch.nn.functional.linear(norm(x[None])[0], head_weight).float()
        got = engine_model.compute_logits(engine_model.norm.forward(x))
        diff = _diff(got, want, dtype)
        result["max_abs_diff"] = max(result["max_abs_diff"], diff["max_abs_diff"])
        result["relative_diff"] = max(result["relative_diff"], diff["relative_diff"])
        result["passed"] = result["passed"] and diff["passed"]
    return result
