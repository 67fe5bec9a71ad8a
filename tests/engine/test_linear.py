"""EngineLinear: the pre-reordered oneDNN weight gives exactly what `F.linear` (and transformers) gives."""

import pytest
import torch
import torch.nn.functional as F

from onboard.engine.linear import EngineLinear, onednn_packed_weight, pytorch_linear

PACKS = onednn_packed_weight(torch.zeros(64, 128, dtype=torch.bfloat16)) is not None


def random_linear(out_features: int, in_features: int, bias: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).to(torch.bfloat16)
    b = torch.randn(out_features, generator=gen).to(torch.bfloat16) if bias else None
    return weight, b, gen


@pytest.mark.skipif(not PACKS, reason="this CPU/PyTorch build has no oneDNN bf16 matmul")
@pytest.mark.parametrize(("out_features", "in_features"), [(192, 64), (128, 64), (96, 160), (640, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_bitwise_f_linear(out_features: int, in_features: int, bias: bool) -> None:
    weight, b, gen = random_linear(out_features, in_features, bias, seed=out_features + in_features)
    linear = EngineLinear(weight, b)
    assert linear.packed is not None and linear.plain is None
    assert torch.equal(linear.weight, weight)  # the reorder is lossless
    for rows in (2, 7, 16, 33, 200):
        x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
        assert torch.equal(linear(x), F.linear(x, weight, b)), rows
    x = torch.randn(1, in_features, generator=gen).to(torch.bfloat16)
    assert torch.equal(linear(x), F.linear(x.expand(2, -1), weight, b)[:1])  # one row runs as two
    x = torch.randn(2, 5, in_features, generator=gen).to(torch.bfloat16)
    assert torch.equal(linear(x), F.linear(x, weight, b))


def test_small_and_non_bf16_weights_stay_plain() -> None:
    # m*n*k <= 16**3 even for one row: PyTorch does not use oneDNN for these, so neither may we.
    small, _, _ = random_linear(64, 64, False, seed=0)
    assert onednn_packed_weight(small) is None
    linear = EngineLinear(small)
    assert linear.packed is None and linear.weight is linear.plain
    wide = torch.randn(128, 64)
    assert onednn_packed_weight(wide) is None  # float32: MKL's path, left alone
    x = torch.randn(3, 64)
    assert torch.equal(EngineLinear(wide)(x), F.linear(x, wide))
    assert (EngineLinear(wide).out_features, EngineLinear(wide).in_features) == (128, 64)


@pytest.mark.skipif(not PACKS, reason="this CPU/PyTorch build has no oneDNN bf16 matmul")
def test_a_row_gives_the_same_result_alone_and_in_a_batch() -> None:
    # Heavy-tailed activations, like a real model's: on AVX512-BF16 oneDNN's single-row kernel
    # rounds a few of these differently from its multi-row one (seeds 4 and 13 here).
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        linear = EngineLinear((torch.randn(576, 1536, generator=gen) * 0.02).to(torch.bfloat16))
        x = (torch.randn(9, 1536, generator=gen) * torch.randn(9, 1536, generator=gen).exp()).to(torch.bfloat16)
        for rows in (2, 3, 9):
            assert torch.equal(linear(x[:1]), linear(x[:rows])[:1]), (seed, rows)


@pytest.mark.skipif(not PACKS, reason="this CPU/PyTorch build has no oneDNN bf16 matmul")
def test_the_one_row_gemv_is_pytorchs_own_kernel_and_leaves_onednn_on() -> None:
    weight, b, gen = random_linear(640, 96, True, seed=5)
    linear = EngineLinear(weight, b)
    linear.use_fast_kernels(batch_invariant=False)
    assert torch.equal(linear.row_weight, weight)
    x = torch.randn(3, 96, generator=gen).to(torch.bfloat16)
    with torch.backends.mkldnn.flags(enabled=False):
        native = F.linear(x[:1], weight, b)
    assert torch.equal(linear(x[:1]), native)  # one row: PyTorch's GEMV, not oneDNN
    assert torch.equal(linear(x), F.linear(x, weight, b))  # several rows: still oneDNN's packed kernel
    assert torch.backends.mkldnn.enabled
    with pytest.raises(RuntimeError):
        pytorch_linear(x[:1], weight[:, :5], None)  # shapes that do not multiply
    assert torch.backends.mkldnn.enabled  # restored on error too


def test_fast_kernels_keep_a_small_weights_rows_independent_of_the_batch() -> None:
    """A weight too small to pack (48 x 64): `F.linear` hands one row to PyTorch's kernel and two to
    oneDNN, which round a few rows in a thousand differently (a tiny DeepSeek-V3's kv_a_proj
    changed a greedy token that way); fast numerics' kernel gives a row the same bits alone and
    among others."""
    gen = torch.Generator().manual_seed(7)
    weight = (torch.randn(48, 64, generator=gen) * 0.2).to(torch.bfloat16)
    x = torch.randn(2048, 64, generator=gen).to(torch.bfloat16)
    linear = EngineLinear(weight)
    assert linear.packed is None

    def changed_rows() -> int:
        alone = torch.cat([linear(x[i : i + 1]) for i in range(0, len(x), 2)])
        paired = torch.cat([linear(x[i : i + 2])[:1] for i in range(0, len(x), 2)])
        return int((alone != paired).any(dim=1).sum())

    assert changed_rows() > 0  # what the fast kernel fixes
    linear.use_fast_kernels(batch_invariant=True)
    assert changed_rows() == 0
    assert linear.row_weight is None  # the one-row GEMV copy is for packed weights only
