"""The distribution rule's floor: inputs moved by one unit in the last place, in their own dtype."""

import pytest
import torch

from onboard.adapt.distribution import moved_by_one_ulp


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_each_element_moves_by_at_most_one_ulp(dtype: torch.dtype) -> None:
    values = (torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * 10).to(dtype)
    values[0, :8] = 0
    moved = moved_by_one_ulp(values, torch.Generator().manual_seed(1))
    assert moved.dtype == dtype and moved.shape == values.shape
    up = torch.nextafter(values, torch.full_like(values, float("inf")))
    down = torch.nextafter(values, torch.full_like(values, float("-inf")))
    nonzero = values != 0
    # one step up, one step down or unchanged, every element; about a third of each
    assert ((moved == values) | (moved == up) | (moved == down))[nonzero].all()
    for part in (moved == values, moved == up, moved == down):
        assert 0.25 < part[nonzero].float().mean() < 0.42
    assert (moved[~nonzero].abs() < torch.finfo(dtype).tiny).all()  # zero's neighbours are subnormal


def test_the_move_is_seeded() -> None:
    values = torch.randn(8, 32).to(torch.bfloat16)
    first = moved_by_one_ulp(values, torch.Generator().manual_seed(3))
    assert torch.equal(first, moved_by_one_ulp(values, torch.Generator().manual_seed(3)))
    assert not torch.equal(first, moved_by_one_ulp(values, torch.Generator().manual_seed(4)))
