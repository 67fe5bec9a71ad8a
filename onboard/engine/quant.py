"""The numerics of compressed-tensors' formats, bit for bit, in a handful of torch ops.

Every function here mirrors what compressed-tensors 0.19 computes when it decompresses a
checkpoint or fake-quantizes an activation, including the dtype of every intermediate (which
division happens in bf16 and which in fp32, when values are rounded to fp8, what a zero block
scale becomes), so that the engine's outputs equal those of the compressed-tensors-wrapped
transformers model exactly. Each function names the compressed-tensors code it reproduces; the
tests compare against that code directly.

Constants that enter an op as tensors in compressed-tensors (the FP4/FP8 ranges) enter as
tensors on the input's device here as well: a Python scalar divisor may be turned into a
multiplication by its reciprocal on some devices, which is not the same rounding.
"""

from collections.abc import Callable
from functools import cache

import torch
import torch.nn.functional as F

FP4_MAX = 6.0
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
NVFP4_GROUP = 16
# compressed-tensors' `_get_dtype_eps`: what a block scale that rounded to zero in FP8 becomes.
FP8_SCALE_EPS = 0.125
# Size thresholds between two exact ways of computing the same thing (see where they are used).
_POOL_FROM = 8192
_CAST_UP_TO = 4096

# FP4 E2M1 code points by 4-bit code: sign bit, 2 exponent bits, 1 mantissa bit (code 8 is -0).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@cache
def _byte_table(device: torch.device) -> torch.Tensor:
    """[256, 2] float32: the two E2M1 values of a packed byte, low nibble first."""
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    codes = torch.arange(256)
    return torch.stack([values[codes & 0x0F], values[codes >> 4]], dim=-1).to(device)


@cache
def _constant(value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(value, dtype=dtype, device=device)


def unpack_fp4_e2m1(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [out, in/2] -> E2M1 values [out, in]; each byte holds element 2j in its low nibble
    and element 2j+1 in its high nibble (compressed-tensors' `pack_fp4_to_uint8`)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed FP4 must be uint8, got {packed.dtype}")
    values = _byte_table(packed.device)[packed.long()]  # [..., in/2, 2]
    return values.flatten(-2).to(dtype)


def dequantize_nvfp4(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """NVFP4 weight [out, in] as compressed-tensors' `NVFP4PackedCompressor.decompress` makes it:
    bf16 E2M1 values times (bf16(fp8 block scale) / global scale), a product taken in the promoted
    dtype of that division (fp32 for a stored fp32 global scale) and rounded once to bf16. Then
    cast to `dtype` (the identity for bf16)."""
    scale = weight_scale.to(torch.bfloat16) / weight_global_scale.to(weight_scale.device)
    values = unpack_fp4_e2m1(weight_packed, scale.dtype)  # E2M1 values are exact in any float dtype
    groups = values.unflatten(-1, (-1, NVFP4_GROUP)) * scale.unsqueeze(-1)
    return groups.flatten(-2).to(torch.bfloat16).to(dtype)


def dequantize_fp8(
    weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """FP8 E4M3 weight [out, in] with a per-channel [out, 1] (or per-tensor [1]) scale, as
    compressed-tensors' `FloatQuantizationCompressor.decompress` makes it: the fp8 values cast to
    the scale's dtype, times the scale, in that dtype. Then cast to `dtype`."""
    if weight_scale.numel() != 1 and tuple(weight_scale.shape) != (weight.shape[0], 1):
        raise ValueError(
            f"FP8 weight scale {tuple(weight_scale.shape)} for weight {tuple(weight.shape)} is neither per channel "
            "nor per tensor (block-wise FP8 is not supported)"
        )
    return (weight.to(weight_scale.dtype) * weight_scale).to(dtype)


_FLOAT_LAYOUT = {  # dtype -> (same-width int dtype, exponent bits, mantissa bits, exponent bias)
    torch.float32: (torch.int32, 8, 23, 127),
    torch.bfloat16: (torch.int16, 8, 7, 127),
    torch.float16: (torch.int16, 5, 10, 15),
}


def round_mantissa(x: torch.Tensor, mantissa_bits: int, min_exponent: int) -> torch.Tensor:
    """Round `x` to a float format with `mantissa_bits` explicit mantissa bits whose subnormal step
    is 2**min_exponent, ties to even, in x's own dtype: x / step, rounded to an integer and scaled
    back, with step = 2**(floor(log2|x|) - mantissa_bits) read from the exponent bits (at least
    2**min_exponent). Dividing and multiplying by a power of two is exact and torch.round rounds
    half to even, so this is one correct rounding, like a cast. The caller clamps to the format's
    range first. (1, -1) is FP4 E2M1; (3, -9) is FP8 E4M3, equal to `.to(float8_e4m3fn)` and back
    (checked on every bf16 value) but several times faster on CPU."""
    int_dtype, exponent_bits, mantissa, bias = _FLOAT_LAYOUT[x.dtype]
    exponent_mask = ((1 << exponent_bits) - 1) << mantissa
    step = (x.view(int_dtype) & exponent_mask).sub_(mantissa_bits << mantissa)
    step = step.clamp_(min=(bias + min_exponent) << mantissa).view(x.dtype)
    return (x / step).round_().mul_(step)


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round values in [-6, 6] to the nearest E2M1 value, ties to the even code (0.25 -> 0,
    0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), as compressed-tensors'
    `cast_to_fp4` does. Signs of zero: values in (-0.25, 0) give -0 as there, but an input -0
    stays -0 here where `cast_to_fp4` (sign(x) * |rounded|) gives +0; compressed-tensors never
    passes it one (it adds the zero point first, and so does nvfp4_activation_quant)."""
    return round_mantissa(x, 1, -1)


def round_to_fp8_e4m3(x: torch.Tensor) -> torch.Tensor:
    """`x.to(float8_e4m3fn).to(x.dtype)` for values in [-448, 448], bit for bit: the casts for small
    tensors (fewer ops), `round_mantissa` for large ones (the CPU casts are slow)."""
    if x.numel() <= _CAST_UP_TO or x.dtype not in _FLOAT_LAYOUT:
        return x.to(torch.float8_e4m3fn).to(x.dtype)
    return round_mantissa(x, 3, -9)


def _nvfp4_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x as fp32 blocks [..., H/16, 16] (a fresh tensor the caller may modify) and max |x| per
    block [..., H/16, 1] in x's dtype (exact). A reduction over an inner dim of 16 is slow on CPU
    for large inputs; max-pooling the fp32 copy is several times faster, and the copy is needed
    for the fp32 division anyway."""
    blocks = x.to(torch.float32, copy=True).unflatten(-1, (-1, NVFP4_GROUP))
    if x.numel() <= _POOL_FROM:
        return blocks, x.unflatten(-1, (-1, NVFP4_GROUP)).abs().amax(dim=-1, keepdim=True)
    pooled = F.max_pool1d(blocks.abs().reshape(-1, 1, x.shape[-1]), NVFP4_GROUP)
    return blocks, pooled.reshape(*x.shape[:-1], -1, 1).to(x.dtype)


def nvfp4_activation_quant(input_global_scale: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """W4A4 activation fake-quantization with compressed-tensors' arithmetic (`forward_quantize` for
    strategy tensor_group, group_size 16, dynamic "local", fp8 scale_dtype):

        s = absmax(block of 16) / 6                        # in x.dtype (compute_dynamic_scales_and_zp)
        s = fp8_e4m3(clamp(global * s, +-448)), 0 -> 0.125  # in fp32 (calculate_qparams)
        q = E2M1(clamp(x / (s / global) + 0, +-6))          # in fp32 (_quantize_dequantize)
        y = (q * (s / global)).to(x.dtype)

    For inputs of two or more dims ([T, H], [B, T, H]) with H a multiple of 16 and an fp32 global
    scale (as stored); x is bf16, fp16 or fp32."""
    global_scale = input_global_scale.detach().reshape(1)
    if global_scale.dtype != torch.float32:
        raise TypeError(f"NVFP4 input global scale must be float32, got {global_scale.dtype}")

    def quant(x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:
            return x
        if x.dim() < 2 or x.shape[-1] % NVFP4_GROUP:
            raise ValueError(f"NVFP4 activations must be [..., T, H] with H divisible by 16, got {tuple(x.shape)}")
        gs = global_scale if global_scale.device == x.device else global_scale.to(x.device)
        blocks, absmax = _nvfp4_blocks(x)
        # absmax equals compressed-tensors' max(|min(amin, 0)|, |max(amax, 0)|) bit for bit.
        scale = absmax / _constant(FP4_MAX, x.dtype, x.device)
        scale = round_to_fp8_e4m3((gs * scale).clamp_(-FP8_MAX, FP8_MAX))
        scale = torch.where(scale == 0, FP8_SCALE_EPS, scale) / gs
        # `+ 0` is compressed-tensors' adding of the (zero) zero point: it turns an input -0 into +0.
        q = round_to_e2m1(blocks.div_(scale).add_(0.0).clamp_(-FP4_MAX, FP4_MAX))
        return q.mul_(scale).flatten(-2).to(x.dtype)

    return quant


def fp8_dynamic_activation_quant() -> Callable[[torch.Tensor], torch.Tensor]:
    """Per-token dynamic FP8 E4M3 fake-quantization (the FP8_DYNAMIC preset: strategy token,
    dynamic True) with compressed-tensors' arithmetic, all in the input's dtype:

        s = absmax(token) / 448, 0 -> eps(dtype)
        y = fp8_e4m3(clamp(x / s + 0, +-448)).to(dtype) * s

    A token is a row of the last dim, for any number of leading dims. compressed-tensors keeps dims
    0 and 1 and reduces the rest, which is per token for the [B, T, H] inputs transformers passes
    but per tensor for a 2-D input; the engine's [T, H] rows are tokens, so it reduces the last dim
    (equal to compressed-tensors on x[None])."""

    def quant(x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:
            return x
        scale = x.abs().amax(dim=-1, keepdim=True) / _constant(FP8_MAX, x.dtype, x.device)
        scale = torch.where(scale == 0, torch.finfo(x.dtype).eps, scale)
        # `+ 0` is compressed-tensors' adding of the (zero) zero point: it turns -0 into +0.
        q = round_to_fp8_e4m3((x / scale).add_(0.0).clamp_(-FP8_MAX, FP8_MAX))
        return q.mul_(scale)

    return quant
