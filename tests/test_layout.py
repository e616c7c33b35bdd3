"""The (outer, reduced, inner) view that row-wise ops and reductions share."""

import pytest
import torch

from effilayers._core.layout import ThreeGroups, merge_dims, normalize_dims, three_groups


def gather(x, groups: ThreeGroups):
    """Reads x's storage through the three groups, as a kernel would."""
    flat = x.as_strided((groups.outer, groups.reduced, groups.inner),
                        (groups.outer_stride, groups.reduced_stride, groups.inner_stride))
    return flat


@pytest.mark.parametrize("make, dims, expected", [
    (lambda: torch.randn(4, 5, 6), (2,), (20, 6, 1)),
    (lambda: torch.randn(4, 5, 6), (0,), (1, 4, 30)),
    (lambda: torch.randn(4, 5, 6), (1, 2), (4, 30, 1)),
    (lambda: torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last), (1,), (2, 3, 20)),
    (lambda: torch.randn(6, 5).t(), (1,), (5, 6, 1)),
    (lambda: torch.randn(4, 8)[:, ::2], (1,), (4, 4, 1)),
    (lambda: torch.randn(3, 1, 4), (0, 1, 2), (1, 12, 1)),
])
def test_three_groups_reads_the_same_values(make, dims, expected):
    x = make()
    groups = three_groups(x, dims)
    assert groups is not None and (groups.outer, groups.reduced, groups.inner) == expected
    kept = [d for d in range(x.dim()) if d not in dims]
    first = dims[0]
    want = x.permute(*kept[:first], *dims, *kept[first:]).reshape(expected)
    assert torch.equal(gather(x, groups), want)


def test_three_groups_declines_what_does_not_merge():
    x = torch.randn(4, 5, 6)
    assert three_groups(x, (0, 2)) is None          # not a run of dimensions
    assert three_groups(x[:, :, ::2].transpose(0, 1), (2,)) is None  # outer strides do not nest
    assert three_groups(x.transpose(1, 2), (1, 2)) is None


def test_merge_dims_ignores_size_one():
    assert merge_dims([3, 1, 4], [4, 99, 1]) == (12, 1)
    assert merge_dims([], []) == (1, 1)
    assert merge_dims([3, 4], [1, 3]) is None


def test_normalize_dims_errors():
    assert normalize_dims(None, 3) == (0, 1, 2)
    assert normalize_dims(-1, 3) == (2,)
    assert normalize_dims((2, 0), 3) == (0, 2)
    with pytest.raises(IndexError, match="dim 3 is out of range"):
        normalize_dims(3, 3)
    with pytest.raises(ValueError, match="more than once"):
        normalize_dims((1, -2), 3)
    with pytest.raises(TypeError, match="ints"):
        normalize_dims((1.0,), 3)
    with pytest.raises(TypeError, match="int, a sequence of ints or None"):
        normalize_dims(1.5, 3)
