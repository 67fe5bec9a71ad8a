"""The llmcompressor modifier of a quantize run and its oneshot application (the YAML schema is onboard.recipes)."""

import copy
import json
from contextlib import contextmanager
from pathlib import Path

import torch
from datasets import Dataset

from onboard import atomic, cpu_bf16
from onboard.models.conversion import renamed
from onboard.models.headers import safetensors_entries
from onboard.quantize.schemes import SCHEMES
from onboard.recipes import Method, Quantize

AUTOROUND_PRESETS = ("NVFP4",)  # the formats onboard runs that auto-round has a preset for


def modifier(settings: Quantize, scheme: str, pinned: dict[str, list[str]] | None = None) -> list:
    """The llmcompressor modifiers of `settings.method`, in llm-compressor's order: smoothing
    (SmoothQuant or AWQ), SpinQuant's offline rotations, then the quantizer (QuantizationModifier,
    GPTQModifier or AutoRoundModifier) putting `scheme` on `settings.targets` and pinned module
    patterns in their own formats.  compressed-tensors resolves a module matched by both a class
    target ("Linear") and a name pattern in favour of the pattern, so pins win; pinned BF16 modules
    join `ignore`.  AutoRound tunes `scheme` (NVFP4) and a second modifier rounds the pinned groups;
    in a format auto-round has no preset for (a search's FP8 copy) the method rounds to nearest."""
    from llmcompressor.modifiers.autoround import AutoRoundModifier
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform import AWQModifier, SmoothQuantModifier

    method = settings.method
    if not isinstance(method, Method):
        raise ValueError("method auto is chosen before modifiers are built")
    pinned = {fmt: list(patterns) for fmt, patterns in (pinned or {}).items() if patterns}
    ignore = list(settings.ignore) + pinned.pop("bf16", [])
    # Pinned groups first: compressed-tensors credits a module to the first target it matches, so
    # with "Linear" ahead every pinned pattern looked unmatched and it warned "Could not match"
    # for groups it applied all the same (it picks the scheme by the most specific target).
    groups = [*sorted(pinned.items()), (scheme, list(settings.targets))]
    stack: list = []
    if method.smoothing == "smoothquant":
        stack.append(SmoothQuantModifier(smoothing_strength=method.smoothing_strength, ignore=ignore))
    elif method.smoothing == "awq":
        stack.append(AWQModifier())
    stack += rotation(method)
    options: dict = {"ignore": ignore}
    if method.observer != "minmax":
        options["weight_observer"] = method.observer
    if method.algorithm == "autoround" and SCHEMES[scheme].preset in AUTOROUND_PRESETS:
        # AutoRoundModifier maps a preset name onto auto-round's own (NVFP4 -> nv_fp4); an explicit
        # scheme reaches auto-round as data_type "fp", which has no 4-bit kernel. So it tunes the
        # run's format on every target but the pinned ones, and a second modifier (llm-compressor
        # runs several in one calibrated pass) rounds the pinned groups to nearest.
        pins = [pattern for _, patterns in groups[:-1] for pattern in patterns]
        # torch.compile of the tuning loop costs more than it saves on a CPU-sized iteration count
        tuned = AutoRoundModifier(
            scheme=SCHEMES[scheme].preset,
            targets=list(settings.targets),
            ignore=ignore + pins,
            iters=method.autoround_iters,
            enable_torch_compile=False,
        )
        return [*stack, tuned, *([_quantizer(QuantizationModifier, groups[:-1], options)] if pins else [])]
    if method.algorithm == "gptq":
        return [
            *stack,
            _quantizer(
                GPTQModifier,
                groups,
                {**options, "actorder": method.gptq_actorder, "dampening_frac": method.gptq_dampening},
            ),
        ]
    # rtn, and autoround's formats auto-round has no preset for (FP8 copies of a search): to nearest
    return [*stack, _quantizer(QuantizationModifier, groups, options)]


def patterns_first(artifact: Path) -> None:
    """Rewrite the saved `config.json` with name-pattern config groups ahead of class-name ones.

    compressed-tensors saves the groups in module order ("Linear" first) and, when transformers
    or vLLM applies them, credits each module to the first target it matches, then warns
    "Could not match" for every pinned pattern, though it gives each module the most specific
    group all the same.  transformers writes config.json with sorted keys, so the groups are
    renumbered in the order they must be read."""
    path = artifact / "config.json"
    if not path.is_file():  # under torchrun only rank 0 saves
        return
    config = json.loads(path.read_text())
    groups = (config.get("quantization_config") or {}).get("config_groups")
    if not groups:
        return
    ordered = sorted(groups.values(), key=lambda group: not any(t.startswith("re:") for t in group["targets"]))
    config["quantization_config"]["config_groups"] = {f"group_{i}": group for i, group in enumerate(ordered)}
    atomic.write_text(path, json.dumps(config, indent=2, sort_keys=True) + "\n")


def ignores_as_stored(artifact: Path) -> None:
    """Name each ignored module in the saved `config.json` also as the checkpoint stores it.

    transformers saves the weights under the checkpoint's names (its conversion mapping reversed:
    GLM-5.3-Flash's `self_attn.f_a_proj`), while compressed-tensors writes `ignore` in the loaded
    model's module names (`self_attn.forget_gate.f_a_proj`); a loader that matches stored names
    (vLLM, the reference engine) would take the module as quantized and find it unpacked."""
    path = artifact / "config.json"
    if not path.is_file():  # under torchrun only rank 0 saves
        return
    config = json.loads(path.read_text())
    quantization = config.get("quantization_config") or {}
    ignore = quantization.get("ignore") or []
    model_type = str(config.get("model_type", ""))
    modules = {name.rsplit(".", 1)[0] for name in safetensors_entries(artifact)}
    as_stored = {renamed(f"{m}.weight", model_type).removesuffix(".weight"): m for m in modules}
    extra = sorted({as_stored[e] for e in ignore if as_stored.get(e, e) != e} - set(ignore))
    if extra:
        quantization["ignore"] = [*ignore, *extra]
        atomic.write_text(path, json.dumps(config, indent=2, sort_keys=True) + "\n")


def _quantizer(cls, groups: list[tuple[str, list[str]]], options: dict):
    """`cls` putting each (format, targets) group in its format."""
    if all(SCHEMES[fmt].preset for fmt, _ in groups):
        # llmcompressor's preset names, as its own examples write mixed recipes; they also keep
        # the saved recipe.yaml plain data (explicit config groups under GPTQ serialise an enum
        # with a Python tag that yaml.safe_load refuses).
        presets: dict[str, list[str]] = {}
        for fmt, targets in groups:
            presets.setdefault(SCHEMES[fmt].preset, []).extend(targets)
        return cls(scheme=presets, **options)
    config_groups = {f"group_{i}": SCHEMES[fmt].quantization_scheme(targets) for i, (fmt, targets) in enumerate(groups)}
    return cls(config_groups=config_groups, **options)


def rotation(method: Method) -> list:
    """SpinQuant's offline rotations of `method`, fused into the weights (none: [])."""
    from llmcompressor.modifiers.transform import SpinQuantModifier

    if not method.rotations:
        return []
    return [
        SpinQuantModifier(
            rotations=list(method.rotations),
            transform_type=method.rotation_type,
            transform_block_size=method.rotation_block,
        )
    ]


def rotated_copy(model: torch.nn.Module, tokenizer, method: Method) -> torch.nn.Module:
    """A copy of `model` with `method`'s rotations fused and nothing quantized: the BF16 side of a
    selection whose quantized copies are rotated (the rotations are deterministic, so the copies
    share them).  Its logits are the model's within fp32 rounding (1e-4 on the tiny llama)."""
    rotated = copy.deepcopy(model)
    apply(rotated, tokenizer, rotation(method), None, 0)
    return rotated.eval()


def prepared_copy(
    model: torch.nn.Module, tokenizer, settings: Quantize, dataset: Dataset | None
) -> tuple[torch.nn.Module, Quantize]:
    """What a search's format copies share: `model` with `settings.method`'s smoothing and rotations
    fused and nothing quantized, and the settings that quantize it further (the method less them).

    Copies made from `model` each with the whole method would each carry their own smoothing
    scales (AWQ searches them per format), and groups taken from one beside norms and groups of
    another would compute another function. So smoothing is found once, for `settings.scheme`
    with the method's observer, rounding to nearest (GPTQ and AutoRound write their rounded
    weights back), and kept without its quantization; rotations are deterministic."""
    method = settings.method
    if method.smoothing == "none" and not method.rotations:
        return model, settings
    rest = settings.model_copy(update={"method": method.model_copy(update={"smoothing": "none", "rotations": []})})
    if method.smoothing == "none":
        return rotated_copy(model, tokenizer, method), rest
    prepared = copy.deepcopy(model)
    smoothing = settings.model_copy(update={"method": method.model_copy(update={"algorithm": "rtn"})})
    apply(prepared, tokenizer, modifier(smoothing, settings.scheme), dataset, settings.calibration.max_seq_length)
    return _without_quantization(prepared).eval(), rest


def _without_quantization(model: torch.nn.Module) -> torch.nn.Module:
    """`model` after oneshot with its weights as calibrated (smoothed, rotated) and compressed-tensors'
    quantization removed: no schemes, no quantization parameters. Each module keeps the forward
    compressed-tensors wrapped, which quantizes nothing without a scheme and which a later oneshot
    wraps again (removing it left the next oneshot's activation quantization unwired)."""
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is None:
            continue
        for name in [name for name in module._parameters if name not in ("weight", "bias")]:
            del module._parameters[name]
        for name in ("quantization_scheme", "quantization_status", "quantization_enabled"):
            module.__dict__.pop(name, None)
    return model


def needs_calibration(settings: Quantize, formats: set[str]) -> bool:
    method = settings.method
    return (
        not isinstance(method, Method)
        or method.algorithm != "rtn"
        or method.smoothing != "none"
        or "imatrix" in method.observer
        or any(SCHEMES[f].calibrated for f in formats)
    )


@contextmanager
def _pinning_only_with_accelerator():
    """llm-compressor 0.14's AWQ pins its cached activations for faster host-to-device copies, and
    pinning raises where no accelerator exists; pinning changes no value, so without one it is
    skipped."""
    from llmcompressor.pipelines.cache import IntermediatesCache

    if torch.accelerator.is_available():
        yield
        return
    pin = IntermediatesCache.pin_memory
    IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
    try:
        yield
    finally:
        IntermediatesCache.pin_memory = pin


@contextmanager
def _rotations_without_embedding_centering():
    """llm-compressor 0.14's SpinQuant subtracts each embedding row's mean before rotating. That is
    exact before a LayerNorm, which removes the mean anyway, but not before an RMSNorm, which every
    family onboard runs uses: on a tiny llama in fp32 it moved the logits by 6.4, and without it the
    rotated model's logits are the original's within 1e-5 (tests/quantize/test_methods.py)."""
    from llmcompressor.modifiers.transform import SpinQuantModifier

    center = SpinQuantModifier._center_embeddings
    SpinQuantModifier._center_embeddings = lambda self, model: None
    try:
        yield
    finally:
        SpinQuantModifier._center_embeddings = center


@contextmanager
def _autoround_in_bf16_on_every_cpu():
    """auto-round tunes a BF16 model on CPU in BF16 where cpuid reports avx512_bf16 and casts the
    whole model to float32 where not: other numerics, twice the memory, and an artifact that
    depends on the CPU. torch runs BF16 on every x86 CPU, so it is the one choice here."""
    from auto_round.utils.device_manager import CpuARDevice

    supports = CpuARDevice.supports_bf16
    CpuARDevice.supports_bf16 = lambda self: True
    try:
        yield
    finally:
        CpuARDevice.supports_bf16 = supports


@contextmanager
def _autoround_leaves_other_modifiers_modules():
    """llm-compressor 0.14's AutoRound tells auto-round to skip only the target modules with no
    scheme, so a pinned module another modifier quantizes (an FP8 `o_proj` next to NVFP4) was
    tuned in NVFP4 too and its scales then failed to map back. Those modules are skipped as well."""
    from compressed_tensors.utils import match_named_modules
    from llmcompressor.modifiers.autoround import AutoRoundModifier

    unquantized = AutoRoundModifier.get_unquantized_layer_names

    def skipped(self, layer: torch.nn.Module) -> list[str]:
        own = self._match_autoround_targets(layer)
        others = [name for name, module in match_named_modules(layer, self.resolved_targets) if module not in own]
        return list(dict.fromkeys([*unquantized(self, layer), *others]))

    AutoRoundModifier.get_unquantized_layer_names = skipped
    try:
        yield
    finally:
        AutoRoundModifier.get_unquantized_layer_names = unquantized


def apply(model: torch.nn.Module, tokenizer, recipe, dataset: Dataset | None, max_seq_length: int) -> None:
    """llmcompressor oneshot, in place, on calibration `dataset` (None: data-free formats)."""
    with (
        _pinning_only_with_accelerator(),
        _rotations_without_embedding_centering(),
        _autoround_leaves_other_modifiers_modules(),
        _autoround_in_bf16_on_every_cpu(),
        # llm-compressor calibrates with eager attention (`calibration_forward_context`), whose bf16
        # `torch.matmul`s were 70 % of the quick demo's quantize under an AVX2 cap (171 s, 28 s with
        # avx512_bf16): on such CPUs they are summed in float32 GEMM, as bf16 linears are.
        cpu_bf16.matmuls_via_fp32(),
    ):
        _oneshot(model, tokenizer, recipe, dataset, max_seq_length)


def _oneshot(model: torch.nn.Module, tokenizer, recipe, dataset: Dataset | None, max_seq_length: int) -> None:
    from llmcompressor import oneshot

    from onboard.models.compressed import quantize_expert_inputs_per_token

    if dataset is None:
        oneshot(model=model, tokenizer=tokenizer, recipe=recipe)
        quantize_expert_inputs_per_token(model)
        return
    oneshot(
        model=model,
        tokenizer=tokenizer,
        dataset=dataset,
        recipe=recipe,
        max_seq_length=max_seq_length,
        num_calibration_samples=len(dataset),
        shuffle_calibration_samples=False,
    )
    quantize_expert_inputs_per_token(model)


def quantized_copy(model, tokenizer, settings: Quantize, fmt: str, dataset: Dataset | None) -> torch.nn.Module:
    """A copy of `model` with every target in `fmt`, weights quantized once and for all.

    compressed-tensors re-quantizes weights in every forward; a candidate search runs hundreds
    of forwards over unchanged weights, so the quantize-dequantize result is stored in the
    weight and the module marked compressed (its forward then quantizes activations alone).
    The logits are identical; only the search's copies are treated so, never an artifact.
    """
    quantized = copy.deepcopy(model)
    _quantize_once(quantized, tokenizer, settings, fmt, dataset)
    return quantized.eval()


def offloaded_copy(checkpoint, offload, tokenizer, settings: Quantize, fmt: str, dataset: Dataset | None):
    """`quantized_copy` of a checkpoint larger than memory: loaded offloaded (`load_offloaded`),
    calibrated one layer at a time, its quantized weights written to `offload` (a bf16 copy of
    every target on disk), never more than one module's weights in memory."""
    from onboard.quantize.offloaded import load_offloaded

    quantized = load_offloaded(checkpoint, offload)
    _quantize_once(quantized, tokenizer, settings, fmt, dataset)
    return quantized.eval()


def _quantize_once(model, tokenizer, settings: Quantize, fmt: str, dataset: Dataset | None) -> None:
    from compressed_tensors.offload import update_offload_parameter
    from compressed_tensors.quantization import QuantizationStatus
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize

    calibrated = dataset if needs_calibration(settings, {fmt}) else None
    apply(model, tokenizer, modifier(settings, fmt), calibrated, settings.calibration.max_seq_length)
    with torch.no_grad():
        for module in model.modules():
            scheme = getattr(module, "quantization_scheme", None)
            if scheme is not None and scheme.weights is not None:
                # in place, or into the offload folder where the module is offloaded
                quantized = forward_quantize(module, module.weight.data, "weight", scheme.weights)
                update_offload_parameter(module, "weight", quantized)
                module.quantization_status = QuantizationStatus.COMPRESSED
