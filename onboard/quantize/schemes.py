"""onboard's scheme names mapped onto llmcompressor's preset quantization schemes."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Scheme:
    name: str
    preset: str  # llmcompressor / compressed-tensors preset scheme
    calibrated: bool  # static activation scales need calibration data
    summary: str


SCHEMES = {
    s.name: s
    for s in (
        Scheme("nvfp4", "NVFP4", True, "W4A4: FP4 E2M1 weights and activations, FP8 scales per 16, FP32 global scale"),
        Scheme("nvfp4a16", "NVFP4A16", False, "W4A16: FP4 E2M1 weights with FP8 scales per 16, BF16 activations"),
        Scheme("fp8", "FP8_DYNAMIC", False, "W8A8: FP8 E4M3 per-channel weights, dynamic per-token FP8 activations"),
    )
}
