"""EngineLinear: exact numerics call `F.linear` as transformers does; fast numerics its kernels."""

import pytest
import torch
import torch.nn.functional as F

from onboard.engine.kernels import KernelChoice, onednn_packs
from onboard.engine.linear import EngineLinear

PACKS = onednn_packs(torch.zeros(64, 128, dtype=torch.bfloat16))


def random_linear(out_features: int, in_features: int, bias: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).to(torch.bfloat16)
    b = torch.randn(out_features, generator=gen).to(torch.bfloat16) if bias else None
    return weight, b, gen


@pytest.mark.parametrize("bias", [False, True])
def test_exact_is_f_linear_on_the_plain_weight_with_any_kernel_setting(bias: bool) -> None:
    """The same op, dtype, layout and rows as transformers' `nn.Linear`: equal under oneDNN and
    under PyTorch's own kernels, for one row, several, 3-D inputs and a strided input."""
    weight, b, gen = random_linear(640, 96, bias, seed=3)
    linear = EngineLinear(weight, b)
    reference = torch.nn.Linear(96, 640, bias=bias, dtype=torch.bfloat16)
    with torch.no_grad():
        reference.weight.copy_(weight)
        if bias:
            reference.bias.copy_(b)
    for enabled in (True, False):
        with torch.backends.mkldnn.flags(enabled=enabled):
            for rows in (1, 2, 7, 33):
                x = torch.randn(rows, 96, generator=gen).to(torch.bfloat16)
                assert torch.equal(linear(x), reference(x)), (enabled, rows)
            x = torch.randn(2, 5, 96, generator=gen).to(torch.bfloat16)
            assert torch.equal(linear(x), reference(x))
            wide = torch.randn(4, 192, generator=gen).to(torch.bfloat16)[:, ::2]  # a strided view
            assert torch.equal(linear(wide), reference(wide.contiguous()))
    assert linear.plain is not None and linear.kernels is None and linear.weight is linear.plain


@pytest.mark.skipif(not PACKS, reason="this CPU/PyTorch build has no oneDNN bf16 matmul")
@pytest.mark.parametrize("choice", [("onednn", "onednn"), ("onednn2", "onednn"), ("pytorch", "per_row")])
def test_fast_kernels_hold_the_weight_losslessly(choice: tuple[str, str]) -> None:
    weight, b, gen = random_linear(192, 64, True, seed=1)
    linear = EngineLinear(weight, b)
    linear.use_kernels(KernelChoice(*choice))
    assert torch.equal(linear.weight, weight)  # the reorder is lossless
    assert (linear.plain is None) == (choice[0] != "pytorch")  # oneDNN's copy replaces the plain one
    x = torch.randn(9, 64, generator=gen).to(torch.bfloat16)
    # the function is the linear's: close to the fp32 product whatever the kernel
    assert torch.allclose(linear(x).float(), F.linear(x.float(), weight.float(), b.float()), atol=0.05, rtol=0.02)
    assert linear(x[:1]).shape == (1, 192) and linear(x.view(3, 3, 64)).shape == (3, 3, 192)


@pytest.mark.skipif(not PACKS, reason="this CPU/PyTorch build has no oneDNN bf16 matmul")
def test_the_pytorch_kernel_is_pytorchs_own_and_leaves_onednn_on() -> None:
    from onboard.engine.kernels import pytorch_linear

    weight, b, gen = random_linear(640, 96, True, seed=5)
    linear = EngineLinear(weight, b)
    linear.use_kernels(KernelChoice("pytorch", "onednn"))
    x = torch.randn(3, 96, generator=gen).to(torch.bfloat16)
    with torch.backends.mkldnn.flags(enabled=False):
        native = F.linear(x[:1], weight, b)
    assert torch.equal(linear(x[:1]), native)  # one row: PyTorch's GEMV, not oneDNN
    assert torch.backends.mkldnn.enabled
    with pytest.raises(RuntimeError):
        pytorch_linear(x[:1], weight[:, :5], None)  # shapes that do not multiply
    assert torch.backends.mkldnn.enabled  # restored on error too
