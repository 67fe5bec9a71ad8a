"""onboard's formats mapped onto compressed-tensors quantization schemes, with their exact size."""

from dataclasses import dataclass

from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, preset_name_to_scheme

NVFP4_GROUP = 16  # values per FP8 block scale


@dataclass(frozen=True)
class Scheme:
    name: str
    preset: str | None  # compressed-tensors preset scheme; None: built here (fp8_weight) or none (bf16)
    calibrated: bool  # static activation scales need calibration data
    summary: str

    def quantization_scheme(self, targets: list[str]) -> QuantizationScheme | None:
        if self.name == "bf16":
            return None
        if self.name == "nvfp4_activations":  # NVFP4's own activation quantization, weights untouched
            return QuantizationScheme(
                targets=targets, input_activations=preset_name_to_scheme("NVFP4", targets).input_activations
            )
        if self.preset:
            return preset_name_to_scheme(self.preset, targets)
        # No preset stores FP8 weights with BF16 activations; vLLM runs it as FP8 W8A16 (Marlin).
        weights = QuantizationArgs(num_bits=8, type="float", strategy="channel", symmetric=True, dynamic=False)
        return QuantizationScheme(targets=targets, weights=weights)

    def stored_bits(self, out_features: int, in_features: int, scale_bits: int = 16) -> int:
        """Bits a [out, in] weight takes on disk in this format (values, block and global scales).

        `scale_bits` is the width of FP8 per-channel scales, which follow the model's dtype.
        Input scales are not counted: they are per-tensor activation statistics, not weights.
        """
        weights = out_features * in_features
        if self.name in ("nvfp4", "nvfp4a16"):
            return 4 * weights + 8 * out_features * (in_features // NVFP4_GROUP) + 32
        if self.name in ("fp8", "fp8_weight"):
            return 8 * weights + scale_bits * out_features
        return 16 * weights


SCHEMES = {
    s.name: s
    for s in (
        Scheme("nvfp4", "NVFP4", True, "W4A4: FP4 E2M1 weights and activations, FP8 scales per 16, FP32 global scale"),
        Scheme("nvfp4a16", "NVFP4A16", False, "W4A16: FP4 E2M1 weights with FP8 scales per 16, BF16 activations"),
        Scheme("fp8", "FP8_DYNAMIC", False, "W8A8: FP8 E4M3 per-channel weights, dynamic per-token FP8 activations"),
        Scheme("fp8_weight", None, False, "W8A16: FP8 E4M3 per-channel weights, BF16 activations"),
        Scheme("bf16", None, False, "BF16: kept in the checkpoint's precision"),
        # The other half of W4A4, for measuring where the damage is (bench-quant); no format vLLM serves.
        Scheme("nvfp4_activations", None, True, "A4 only: NVFP4 activations, BF16 weights (a measurement)"),
    )
}

# The formats `scheme: auto` chooses from, cheapest first, for each base format.
LADDERS = {"nvfp4": ("nvfp4", "fp8", "bf16"), "nvfp4a16": ("nvfp4a16", "fp8_weight", "bf16")}
