"""bf16 linears through float32 GEMM where the CPU has no bf16 dot product (`onboard.cpu_bf16`)."""

import pytest
import torch
import torch.nn.functional as F

from onboard import cpu_bf16


def _operands(rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 96, generator=gen).bfloat16()
    weight = torch.randn(40, 96, generator=gen).bfloat16()
    bias = torch.randn(40, generator=gen).bfloat16()
    return x, weight, bias


def test_a_routed_product_is_a_bf16_gemm_with_float32_sums() -> None:
    x, weight, bias = _operands(cpu_bf16.MIN_ROWS)
    routed = cpu_bf16.linear_via_fp32(x, weight, bias)
    exact = (x.double() @ weight.double().T + bias.double()).float()
    assert routed.dtype is torch.bfloat16 and routed.shape == (cpu_bf16.MIN_ROWS, 40)
    # One rounding to bf16 (half an ulp, 2**-8 of the value) plus float32 sums' error.
    assert ((routed.float() - exact).abs() <= exact.abs() * 2**-8 + 1e-4).all()
    # A batch of 3-d rows is the same product as its 2-d rows.
    batched = cpu_bf16.linear_via_fp32(x.view(4, -1, 96), weight, bias)
    assert torch.equal(batched.reshape(routed.shape), routed)


def test_a_decode_step_keeps_the_bf16_kernel() -> None:
    x, weight, bias = _operands(cpu_bf16.MIN_ROWS - 1)
    assert torch.equal(cpu_bf16.linear_via_fp32(x, weight, bias), cpu_bf16._bf16_linear(x, weight, bias))
    # float32 operands are never touched.
    x32, w32 = x.float(), weight.float()
    assert torch.equal(cpu_bf16.linear_via_fp32(x32, w32), cpu_bf16._bf16_linear(x32, w32))


def test_gradients_reach_bf16_weights() -> None:
    x, weight, bias = _operands(cpu_bf16.MIN_ROWS)
    weight.requires_grad_(True)
    cpu_bf16.linear_via_fp32(x, weight, bias).float().square().sum().backward()
    assert weight.grad is not None and weight.grad.dtype is torch.bfloat16 and weight.grad.abs().sum() > 0


@pytest.mark.parametrize("cap", ["AVX2", "AVX512_CORE", "avx512_core_vnni"])
def test_an_isa_cap_without_bf16_routes(monkeypatch: pytest.MonkeyPatch, cap: str) -> None:
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    assert not cpu_bf16.bf16_dot_product()
    monkeypatch.setattr(F, "linear", F.linear)  # restored after the test
    cpu_bf16.install()
    assert F.linear is cpu_bf16.linear_via_fp32
    # nn.Linear reaches it: a module's forward is the routed product.
    module = torch.nn.Linear(96, 40).bfloat16()
    x = _operands(cpu_bf16.MIN_ROWS)[0]
    with torch.no_grad():
        want = (x.float() @ module.weight.float().T + module.bias.float()).bfloat16()
        assert torch.equal(module(x), want)


def test_a_cpu_with_the_dot_product_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert cpu_bf16.bf16_dot_product()
    monkeypatch.setattr(F, "linear", F.linear)
    original = F.linear
    cpu_bf16.install()
    assert F.linear is original


def test_under_bf16_autocast_the_operands_are_rounded_as_autocast_rounds_them() -> None:
    x, weight, bias = (t.float() + 1e-3 for t in _operands(cpu_bf16.MIN_ROWS))  # not bf16 values
    weight.requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        routed = cpu_bf16.linear_via_fp32(x, weight, bias)
    rounded = [t.detach().bfloat16().double() for t in (x, weight, bias)]
    exact = (rounded[0] @ rounded[1].T + rounded[2]).float()
    assert routed.dtype is torch.bfloat16
    assert ((routed.float() - exact).abs() <= exact.abs() * 2**-8 + 1e-4).all()
    routed.float().sum().backward()
    assert weight.grad is not None and weight.grad.dtype is torch.float32


def test_inside_bf16_kernels_nothing_is_routed(monkeypatch: pytest.MonkeyPatch) -> None:
    widened: list[int] = []
    widen = cpu_bf16._widened
    monkeypatch.setattr(cpu_bf16, "_widened", lambda *a: widened.append(1) or widen(*a))
    x, weight, bias = _operands(cpu_bf16.MIN_ROWS)
    with cpu_bf16.bf16_kernels():
        with cpu_bf16.bf16_kernels():
            cpu_bf16.linear_via_fp32(x, weight, bias)
        cpu_bf16.linear_via_fp32(x, weight, bias)  # still inside after a nested block ends
    assert widened == []
    cpu_bf16.linear_via_fp32(x, weight, bias)
    assert widened == [1]


def test_matmuls_are_routed_only_inside_the_block_and_only_without_the_dot_product(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gen = torch.Generator().manual_seed(1)
    scores = torch.randn(2, 3, cpu_bf16.MIN_ROWS, 24, generator=gen).bfloat16()
    keys = torch.randn(2, 3, 24, cpu_bf16.MIN_ROWS, generator=gen).bfloat16()
    original = torch.matmul
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    with cpu_bf16.matmuls_via_fp32():
        assert torch.matmul is cpu_bf16.matmul_via_fp32
        routed = torch.matmul(scores, keys)
        assert torch.equal(routed, original(scores.float(), keys.float()).bfloat16())
        one_row = scores[:, :, :1]  # a decode step keeps the bf16 kernel
        assert torch.equal(torch.matmul(one_row, keys), original(one_row, keys))
    assert torch.matmul is original
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    with cpu_bf16.matmuls_via_fp32():
        assert torch.matmul is original


@pytest.mark.parametrize(
    ("bf16", "capability", "cap"),
    [(True, "AVX512", "AVX512_CORE"), (False, "AVX512", "AVX2"), (False, "AVX2", "SSE41")],
)
def test_make_test_isa_caps_below_the_cpus_own_isa(
    monkeypatch: pytest.MonkeyPatch, bf16: bool, capability: str, cap: str
) -> None:
    monkeypatch.setattr(cpu_bf16, "bf16_dot_product", lambda: bf16)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    assert cpu_bf16.cap_below_native() == cap
