"""onboard.engine.quant against compressed-tensors itself: the same bits, in less time."""

from collections.abc import Callable

import pytest
import torch
from compressed_tensors.compressors.naive_quantized import FloatQuantizationCompressor
from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, apply_quantization_config
from compressed_tensors.quantization.lifecycle.forward import forward_quantize
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4

from onboard.engine.quant import (
    dequantize_fp8,
    dequantize_nvfp4,
    fp8_dynamic_activation_quant,
    nvfp4_activation_quant,
    round_to_e2m1,
    round_to_fp8_e4m3,
    unpack_fp4_e2m1,
)

INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bit patterns (so +0 and -0 differ, as they would on disk)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.view(INT_VIEW[a.dtype]), b.view(INT_VIEW[b.dtype]))


def scheme(preset: str) -> QuantizationScheme:
    return QuantizationScheme(targets=["Linear"], **PRESET_SCHEMES[preset])


def ct_linear(preset: str, in_features: int, input_global_scale: float | None = None) -> torch.nn.Linear:
    """A Linear that compressed-tensors has set up for `preset` (its forward fake-quantizes)."""
    model = torch.nn.Sequential(torch.nn.Linear(in_features, 16, bias=False, dtype=torch.bfloat16))
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme(preset)}))
    linear = model[0]
    if input_global_scale is not None:
        linear.input_global_scale.data.fill_(input_global_scale)
    return linear


def ct_input_quant(linear: torch.nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    args = linear.quantization_scheme.input_activations
    return lambda x: forward_quantize(linear, x, "input", args)


def activations(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Random activations with per-token magnitudes, and the edge cases planted in them: an
    all-zero block, a -0, a block of huge values, one of tiny ones, a lone outlier, exact ties."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.rand((*shape[:-1], 1), generator=gen) * 4
    x = x.to(dtype)
    if shape[-1] > 16:
        x[..., :16] = 0
    x.view(-1)[17] = -0.0
    if shape[-1] >= 64:
        x[..., 16:32] *= 1e30 if dtype != torch.float16 else 1e3
        x[..., 32:48] *= 1e-30 if dtype != torch.float16 else 1e-3
        x[..., 48] = 1000
        x[..., 49:64] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 6, -0.25, -0.75, -2.5, -5, 1.0, 0.5, 3])[
            : min(15, shape[-1] - 49)
        ]
    if dtype == torch.bfloat16 and x.numel() > 100:
        x.view(-1)[99] = torch.finfo(torch.bfloat16).max
    return x


# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------


def test_unpack_fp4_matches_compressed_tensors() -> None:
    packed = torch.arange(256, dtype=torch.uint8).reshape(8, 32)
    for dtype in (torch.float32, torch.bfloat16):
        assert same_bits(unpack_fp4_e2m1(packed, dtype), unpack_fp4_from_uint8(packed, 8, 64, dtype=dtype))
    values = cast_to_fp4(torch.randn(32, 64, generator=torch.Generator().manual_seed(0)) * 3)
    assert torch.equal(unpack_fp4_e2m1(pack_fp4_to_uint8(values)), values)  # low nibble first


def random_fp8(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Every finite FP8 E4M3 bit pattern is equally likely (0x7F and 0xFF are NaN)."""
    codes = torch.randint(0, 254, shape, generator=gen, dtype=torch.int32)
    codes = codes + (codes >= 0x7F).int()
    return codes.to(torch.uint8).view(torch.float8_e4m3fn)


@pytest.mark.parametrize("global_scale", [4864.0, 1.0, 0.3712, 123456.789])
def test_dequantize_nvfp4_matches_the_compressor(global_scale: float) -> None:
    gen = torch.Generator().manual_seed(1)
    out, inp = 48, 128
    packed = torch.randint(0, 256, (out, inp // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    block = random_fp8((out, inp // 16), gen).float().abs().to(torch.float8_e4m3fn)  # scales are >= 0
    gscale = torch.tensor([global_scale], dtype=torch.float32)
    state = {"weight_packed": packed, "weight_scale": block, "weight_global_scale": gscale}
    expected = NVFP4PackedCompressor.decompress(state, scheme("NVFP4"))["weight"]
    assert same_bits(dequantize_nvfp4(packed, block, gscale, torch.bfloat16), expected)
    assert torch.equal(dequantize_nvfp4(packed, block, gscale, torch.float32), expected.float())


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
def test_dequantize_fp8_matches_the_compressor(scale_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    weight = random_fp8((40, 96), gen)
    scale = (torch.rand(40, 1, generator=gen) * 0.01 + 1e-4).to(scale_dtype)
    expected = FloatQuantizationCompressor.decompress({"weight": weight, "weight_scale": scale}, scheme("FP8_DYNAMIC"))
    assert same_bits(dequantize_fp8(weight, scale, scale_dtype), expected["weight"])
    with pytest.raises(ValueError, match="block-wise"):
        dequantize_fp8(weight, torch.ones(1, 1).expand(40, 3), scale_dtype)


# ---------------------------------------------------------------------------------------------
# Rounding
# ---------------------------------------------------------------------------------------------


def test_round_to_e2m1_is_cast_to_fp4() -> None:
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6.0])
    mids = (grid[1:] + grid[:-1]) / 2
    up, down = torch.tensor(10.0), torch.tensor(-10.0)
    edges = torch.cat([grid, mids, mids.nextafter(up), mids.nextafter(down), torch.tensor([1e-40, 1e-30])])
    gen = torch.Generator().manual_seed(3)
    x = torch.cat([edges, -edges[1:], torch.empty(1_000_000).uniform_(-6, 6, generator=gen)])
    assert same_bits(round_to_e2m1(x.clone()), cast_to_fp4(x.clone()))
    # An input -0 is the one difference (cast_to_fp4 gives +0); the activation quant adds the zero point first.
    assert torch.equal(round_to_e2m1(torch.tensor([-0.0])).signbit(), torch.tensor([True]))
    assert not cast_to_fp4(torch.tensor([-0.0])).signbit().item()


def test_round_to_fp8_is_the_cast() -> None:
    every_bf16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    every_f16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    gen = torch.Generator().manual_seed(4)
    f32 = torch.randn(2_000_000, generator=gen) * 10 ** torch.empty(2_000_000).uniform_(-6, 3, generator=gen)
    fp8 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    fp8 = fp8[fp8.isfinite()].sort().values
    mids = (fp8[1:] + fp8[:-1]) / 2
    f32 = torch.cat([f32, fp8, mids, mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(-1e9))])
    for x in (every_bf16, every_f16, f32):
        x = x[x.isfinite()].clamp(-448, 448)
        assert x.numel() > 4096  # the arithmetic path, not the cast
        assert same_bits(round_to_fp8_e4m3(x), x.to(torch.float8_e4m3fn).to(x.dtype))


# ---------------------------------------------------------------------------------------------
# Activation fake-quantization
# ---------------------------------------------------------------------------------------------

SHAPES = [(1, 576), (512, 576), (3, 7, 64), (2, 5, 32), (4, 16), (1, 300, 64)]


@pytest.mark.parametrize("global_scale", [684.0, 1.0, 0.37, 9.5e4])
@pytest.mark.parametrize("shape", SHAPES)
def test_nvfp4_activation_quant_is_forward_quantize(shape: tuple[int, ...], global_scale: float) -> None:
    linear = ct_linear("NVFP4", shape[-1], global_scale)
    x = activations(shape, seed=len(shape) * 1000 + shape[-1])
    expected = ct_input_quant(linear)(x)
    got = nvfp4_activation_quant(linear.input_global_scale)(x)
    assert same_bits(got, expected)
    assert not torch.equal(got, x)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_nvfp4_activation_quant_other_dtypes(dtype: torch.dtype) -> None:
    linear = ct_linear("NVFP4", 64, 448.0)
    for shape in [(3, 64), (300, 64)]:
        x = activations(shape, seed=5, dtype=dtype)
        assert same_bits(nvfp4_activation_quant(linear.input_global_scale)(x), ct_input_quant(linear)(x))


def test_nvfp4_activation_quant_all_zero_input() -> None:
    linear = ct_linear("NVFP4", 64, 684.0)
    x = torch.zeros(2, 3, 64, dtype=torch.bfloat16)
    x[0, 1, 5] = -0.0
    assert same_bits(nvfp4_activation_quant(linear.input_global_scale)(x), ct_input_quant(linear)(x))


@pytest.mark.parametrize("shape", [(1, 5, 576), (2, 7, 64), (1, 512, 576), (3, 1, 32)])
def test_fp8_activation_quant_is_forward_quantize(shape: tuple[int, ...]) -> None:
    linear = ct_linear("FP8_DYNAMIC", shape[-1])
    x = activations(shape, seed=shape[1])
    quant = fp8_dynamic_activation_quant()
    expected = ct_input_quant(linear)(x)
    assert same_bits(quant(x), expected)
    # The engine's [T, H] rows are tokens: the same as compressed-tensors on a batch of one.
    for b in range(shape[0]):
        assert same_bits(quant(x[b]), expected[b])


def test_compressed_tensors_reduces_a_2d_input_per_tensor() -> None:
    """Why fp8_dynamic_activation_quant reduces the last dim rather than copying compressed-tensors
    on 2-D inputs: its "token" strategy keeps dims 0 and 1, so a [T, H] input gets one scale."""
    linear = ct_linear("FP8_DYNAMIC", 64)
    x = activations((6, 64), seed=6)
    x[0] *= 100
    per_tensor = ct_input_quant(linear)(x)
    assert same_bits(per_tensor, ct_input_quant(linear)(x.reshape(1, 1, -1)).reshape(6, 64))
    assert not torch.equal(per_tensor, fp8_dynamic_activation_quant()(x))
    assert same_bits(fp8_dynamic_activation_quant()(x), ct_input_quant(linear)(x[None])[0])
