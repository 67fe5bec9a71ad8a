"""A checkpoint's weights as the engine needs them: plain tensors, and linears built for serving.

`CheckpointWeights` reads a plain checkpoint or a compressed-tensors artifact (NVFP4 W4A4, NVFP4
W4A16, FP8 W8A8 with dynamic per-token activations, FP8 weight-only, BF16, and any mixture of
them: per-group formats, ignored layers) straight from its safetensors files, lazily, tensor by
tensor. Each linear comes out as an `EngineLinear`: the weight dequantized bit for bit as
compressed-tensors decompresses it, and the activation fake-quantization compressed-tensors'
forward applies, so the engine computes what the transformers model loaded by
`onboard.models.load_model` computes.

A module's format is read from the tensors stored for it; the config group that
compressed-tensors matches to it (targets and ignore as compressed-tensors resolves them) says how
its activations are quantized, and must agree with what is stored.
"""

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from onboard.engine.linear import EngineLinear
from onboard.engine.quant import (
    dequantize_fp8,
    dequantize_nvfp4,
    fp8_dynamic_activation_quant,
    nvfp4_activation_quant,
)
from onboard.errors import OnboardError
from onboard.models.vlm import checkpoint_name, text_name, wrapper_of

_PLAIN_FORMATS = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}
_FP8_DTYPES = (torch.float8_e4m3fn,)
_SAFETENSORS_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
}


class NotFusable(ValueError):
    """The linears are not served as one matrix: different formats, activation quantization (a
    fused product would round otherwise, and quantized inputs amplify that), bias on some but not
    all, or fusing is off (exact numerics). The caller keeps them separate."""


@dataclass(frozen=True)
class _Spec:
    """What is stored for one linear and how it runs."""

    fmt: str  # "nvfp4" | "nvfp4a16" | "fp8" | "fp8a16" | "bf16" | "f16" | "f32"
    act: str | None  # activation fake-quantization: "nvfp4" | "fp8_dynamic" | None


class CheckpointWeights:
    """The tensors of the checkpoint directory `path` (config.json and *.safetensors), by the text
    model's names: a VLM's `model.language_model.*` are read as `model.*`, its vision tower is
    not served (`onboard.models.vlm`)."""

    def __init__(
        self,
        path: Path,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
        fuse_linears: bool = True,
    ):
        self.path = Path(path)
        self.dtype = dtype
        self.device = torch.device(device)
        # False in exact numerics: transformers runs q/k/v (gate/up) as separate products, and a
        # fused one is another shape, for which a kernel may sum in another order.
        self.fuse_linears = fuse_linears
        try:
            config = json.loads((self.path / "config.json").read_text())
        except (OSError, ValueError) as err:
            raise OnboardError(f"{self.path}: no readable config.json ({err})") from err
        self.wrapper = wrapper_of(config)
        self.quantization_config: dict[str, Any] | None = config.get("quantization_config") or None
        self._quant = _QuantizationConfig(self.quantization_config) if self.quantization_config else None
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise OnboardError(f"{self.path}: no *.safetensors files")
        self._file_of: dict[str, Path] = {}
        self._dtype: dict[str, str] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (a safe_open handle is not a mapping)
                    self._file_of[name] = file
                    self._dtype[name] = handle.get_slice(name).get_dtype()
        self._handles: dict[Path, Any] = {}

    # -- plain tensors --------------------------------------------------------------------------

    def names(self) -> list[str]:
        """The text model's tensors."""
        return sorted(name for name in (text_name(n, self.wrapper) for n in self._file_of) if name is not None)

    def has(self, name: str) -> bool:
        return checkpoint_name(name, self.wrapper) in self._file_of

    def raw(self, name: str) -> torch.Tensor:
        """The tensor as stored (dtype included), on the device."""
        name = checkpoint_name(name, self.wrapper)
        file = self._file_of.get(name)
        if file is None:
            raise KeyError(f"{self.path}: no tensor {name!r}")
        handle = self._handles.get(file)
        if handle is None:
            handle = self._handles[file] = safe_open(str(file), framework="pt", device=str(self.device))
        return handle.get_tensor(name).to(self.device)

    def tensor(self, name: str) -> torch.Tensor:
        """A plain tensor (norm, embedding, router, bias, ...): floating point in the compute dtype,
        integers as stored. Quantized parts (fp8 weights, packed fp4) are for linear()."""
        value = self.raw(name)
        if value.dtype in _FP8_DTYPES or value.dtype == torch.uint8:
            raise ValueError(f"{name} is stored as {value.dtype}: a quantized weight, read it with linear()")
        return value.to(self.dtype) if value.is_floating_point() else value

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> "CheckpointWeights":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- linears --------------------------------------------------------------------------------

    def effective_format(self, prefix: str) -> str:
        """How module `prefix` is stored and served: "nvfp4" (W4A4), "nvfp4a16", "fp8" (W8A8,
        dynamic per-token activations), "fp8a16", or the plain dtype ("bf16", "f16", "f32")."""
        return self._spec(prefix).fmt

    def linear(self, prefix: str) -> EngineLinear:
        spec = self._spec(prefix)
        act_quant = self._act_quant(prefix, spec)
        return EngineLinear(self._weight(prefix, spec), self._bias(prefix), act_quant, spec.fmt, name=prefix)

    def fused_linear(self, prefixes: list[str]) -> EngineLinear:
        """The linears `prefixes` (q/k/v, gate/up) as one, outputs concatenated in that order; exact
        only when they share format and activation quantization, else NotFusable."""
        if not prefixes:
            raise ValueError("fused_linear needs at least one module")
        if not self.fuse_linears:
            raise NotFusable(f"{prefixes}: fusing is off (exact numerics)")
        specs = [self._spec(p) for p in prefixes]
        if len(set(specs)) != 1:
            raise NotFusable(f"{prefixes}: formats differ ({', '.join(s.fmt for s in specs)})")
        spec = specs[0]
        if self.quantizes_activations:
            # A fused product is another shape, whose kernel may round otherwise, and a linear that
            # quantizes its input amplifies any rounding upstream (`kernels.py`): kept apart, in a
            # model that quantizes any activations.
            raise NotFusable(f"{prefixes}: the checkpoint quantizes activations")
        biases = [self._bias(p) for p in prefixes]
        if any(b is None for b in biases) and any(b is not None for b in biases):
            raise NotFusable(f"{prefixes}: some have a bias and some do not")
        weight = torch.cat([self._weight(p, spec) for p in prefixes], dim=0)
        bias = None if biases[0] is None else torch.cat(biases, dim=0)
        return EngineLinear(weight, bias, self._act_quant(prefixes[0], spec), spec.fmt, name="+".join(prefixes))

    @property
    def quantizes_activations(self) -> bool:
        """Whether any config group quantizes its linears' inputs (W4A4, W8A8)."""
        groups = (self.quantization_config or {}).get("config_groups") or {}
        return any(group.get("input_activations") for group in groups.values())

    def _spec(self, prefix: str) -> _Spec:
        # the config groups name modules as the checkpoint stores them
        scheme = self._quant.scheme_for(checkpoint_name(prefix, self.wrapper)) if self._quant else None
        if self.has(f"{prefix}.weight_packed"):
            return _Spec(*self._nvfp4_spec(prefix, scheme))
        if not self.has(f"{prefix}.weight"):
            raise KeyError(f"{self.path}: no weight stored for module {prefix!r}")
        dtype = self._dtype_of(f"{prefix}.weight")
        if dtype in _FP8_DTYPES:
            return _Spec(*self._fp8_spec(prefix, scheme))
        if dtype not in _PLAIN_FORMATS:
            raise OnboardError(f"{prefix}: weight stored as {dtype}, not a format the engine serves")
        if scheme is not None and scheme.weights is not None:
            raise OnboardError(
                f"{prefix}: the quantization config quantizes it but its weight is stored unpacked "
                f"({dtype}); only compressed checkpoints (save_compressed=True) are served"
            )
        return _Spec(_PLAIN_FORMATS[dtype], None)

    def _nvfp4_spec(self, prefix: str, scheme) -> tuple[str, str | None]:
        for part in ("weight_scale", "weight_global_scale"):
            if not self.has(f"{prefix}.{part}"):
                raise OnboardError(f"{prefix}: packed weight without {part}")
        packed, block = self._dtype_of(f"{prefix}.weight_packed"), self._dtype_of(f"{prefix}.weight_scale")
        if packed != torch.uint8 or block != torch.float8_e4m3fn:
            raise OnboardError(f"{prefix}: packed weight ({packed}, scales {block}) is not NVFP4")
        if scheme is not None:
            weights = scheme.weights
            if weights is None or (weights.num_bits, weights.type, weights.group_size) != (4, "float", 16):
                raise OnboardError(f"{prefix}: stored as NVFP4 but its config group says {weights}")
        stored_input_scale = self.has(f"{prefix}.input_global_scale")
        if scheme is None:  # no config to go by: the tensors say it all
            return ("nvfp4", "nvfp4") if stored_input_scale else ("nvfp4a16", None)
        inputs = scheme.input_activations
        if inputs is None:
            return "nvfp4a16", None
        if not (
            (inputs.num_bits, inputs.type, inputs.strategy, inputs.group_size) == (4, "float", "tensor_group", 16)
            and inputs.dynamic == "local"
            and inputs.symmetric
        ):
            raise OnboardError(f"{prefix}: NVFP4 weights with unsupported activation quantization {inputs}")
        if not stored_input_scale:
            raise OnboardError(f"{prefix}: W4A4 config group but no input_global_scale stored")
        return "nvfp4", "nvfp4"

    def _fp8_spec(self, prefix: str, scheme) -> tuple[str, str | None]:
        if not self.has(f"{prefix}.weight_scale"):
            raise OnboardError(f"{prefix}: FP8 weight without weight_scale")
        if scheme is None:
            raise OnboardError(f"{prefix}: FP8 weight but no quantization config group for it")
        inputs = scheme.input_activations
        if inputs is None:
            return "fp8a16", None
        if (inputs.num_bits, inputs.type, inputs.strategy) == (8, "float", "token") and (
            inputs.dynamic is True and inputs.symmetric
        ):
            return "fp8", "fp8_dynamic"
        raise OnboardError(f"{prefix}: FP8 weights with unsupported activation quantization {inputs}")

    def _dtype_of(self, name: str) -> torch.dtype | str:
        """The stored dtype, read from the file header (the string itself if torch has no such dtype)."""
        stored = self._dtype[checkpoint_name(name, self.wrapper)]
        return _SAFETENSORS_DTYPES.get(stored, stored)

    def _weight(self, prefix: str, spec: _Spec) -> torch.Tensor:
        if spec.fmt.startswith("nvfp4"):
            return dequantize_nvfp4(
                self.raw(f"{prefix}.weight_packed"),
                self.raw(f"{prefix}.weight_scale"),
                self.raw(f"{prefix}.weight_global_scale"),
                self.dtype,
            )
        if spec.fmt.startswith("fp8"):
            return dequantize_fp8(self.raw(f"{prefix}.weight"), self.raw(f"{prefix}.weight_scale"), self.dtype)
        return self.tensor(f"{prefix}.weight")

    def _bias(self, prefix: str) -> torch.Tensor | None:
        return self.tensor(f"{prefix}.bias") if self.has(f"{prefix}.bias") else None

    def _act_quant(self, prefix: str, spec: _Spec) -> Callable[[torch.Tensor], torch.Tensor] | None:
        if spec.act == "nvfp4":
            return nvfp4_activation_quant(self.raw(f"{prefix}.input_global_scale"))
        if spec.act == "fp8_dynamic":
            return fp8_dynamic_activation_quant()
        return None


class _QuantizationConfig:
    """A compressed-tensors quantization_config, resolving module names to config groups the way
    compressed-tensors' `apply_quantization_config` does (exact names, then regexes, then the
    class name "Linear"; `ignore` wins)."""

    def __init__(self, raw: dict[str, Any]):
        method = raw.get("quant_method")
        if method != "compressed-tensors":
            raise OnboardError(f"quantization method {method!r} is not served (only compressed-tensors)")
        from compressed_tensors.quantization import QuantizationConfig

        self.config = QuantizationConfig.model_validate(raw)
        self.target_to_scheme: dict[str, Any] = {}
        for scheme in self.config.config_groups.values():
            for target in scheme.targets:
                self.target_to_scheme[target] = scheme
        self._linear = torch.nn.Linear(1, 1, bias=False, device="meta")

    def scheme_for(self, name: str):
        """The QuantizationScheme compressed-tensors gives Linear module `name`, or None."""
        from compressed_tensors.utils.match import is_match, match_targets

        if not is_match(name, self._linear, list(self.target_to_scheme), self.config.ignore or []):
            return None
        return self.target_to_scheme[match_targets(name, self._linear, list(self.target_to_scheme))[0]]
