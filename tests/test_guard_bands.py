"""The guard bands of tests/guard_bands.py catch wrong masks: toy kernels
that store or load one element past the end fail under the guard and pass
silently without it."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") != "1",
                                reason="the guard wraps the Triton interpreter (TRITON_INTERPRET=1)")

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from . import guard_bands  # noqa: E402

TOY = __name__  # the toy kernels are named after this module


@triton.jit
def _copy_one_too_many(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    inside = offsets <= n  # wrong: one element past the end
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=inside), mask=inside)


@triton.jit
def _shifted_copy(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    inside = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets + 1, mask=inside), mask=inside)  # wrong: reads x[n]


@triton.jit
def _strided_store(out_ptr, n, stride, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets * stride + 1, 1.0, mask=offsets < n)  # wrong: between the elements


@triton.jit
def _store_through_table(table_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    target = tl.load(table_ptr).to(tl.pointer_type(tl.float32))
    tl.store(target + offsets, 1.0, mask=offsets <= n)  # wrong: one element past the end


@pytest.fixture
def toy_table_decoder(monkeypatch):
    """An ADDRESS_TABLES entry for _store_through_table: one float32 region of n elements."""
    def decode(args):
        (address,) = args["table_ptr"].tolist()
        regions = [guard_bands.Region("table_ptr[0]", address, torch.float32, (int(args["n"]),), (1,))]
        return regions, ("table_ptr",), lambda relocate: {
            "table_ptr": torch.tensor([relocate(address)], dtype=torch.int64)}

    monkeypatch.setitem(guard_bands.ADDRESS_TABLES, f"{TOY}._store_through_table", decode)


def test_store_past_the_end_is_caught():
    source = torch.arange(1.0, 7.0)  # x is its first 5 elements, out room's
    room = torch.zeros(6)
    with pytest.raises(guard_bands.GuardBandViolation, match=r"_copy_one_too_many .*1 element\(s\) past the end "
                                                              r"of out_ptr"):
        _copy_one_too_many[(1,)](source[:5], room[:5], 5, BLOCK=8)
    assert not room.any()  # nothing reached the original memory
    with guard_bands.unguarded():  # without the guard the interpreter lets it pass
        _copy_one_too_many[(1,)](source[:5], room[:5], 5, BLOCK=8)
    assert room.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]  # room[5] silently overwritten


def test_load_past_the_end_reads_nan():
    room = torch.arange(1.0, 7.0)
    x = room[:5]
    expected = torch.tensor([2.0, 3.0, 4.0, 5.0, 6.0])  # what an unguarded read of room[5] gives
    out = torch.zeros(5)
    _shifted_copy[(1,)](x, out, 5, BLOCK=8)
    assert torch.isnan(out[4]) and torch.equal(out[:4], expected[:4])
    with pytest.raises(AssertionError):
        torch.testing.assert_close(out, x)  # any comparison of the result fails
    with guard_bands.unguarded():
        out = torch.zeros(5)
        _shifted_copy[(1,)](x, out, 5, BLOCK=8)
    assert torch.equal(out, expected)  # silently reads the neighbour


def test_store_into_a_gap_is_caught():
    room = torch.zeros(10)
    with pytest.raises(guard_bands.GuardBandViolation, match="in a gap between its elements"):
        _strided_store[(1,)](room[::2], 4, 2, BLOCK=8)  # the last gap store lands on room[9]: past the view
    assert not room.any()


def test_stores_through_an_address_table_are_guarded(toy_table_decoder):
    room = torch.zeros(6)
    table = torch.tensor([room.data_ptr()], dtype=torch.int64)
    with pytest.raises(guard_bands.GuardBandViolation, match=r"past the end of table_ptr\[0\]"):
        _store_through_table[(1,)](table, 5, BLOCK=8)
    assert not room.any()


def test_raw_addresses_without_a_decoder_are_refused():
    room = torch.zeros(6)
    table = torch.tensor([room.data_ptr()], dtype=torch.int64)
    with pytest.raises(guard_bands.UnguardableLaunch, match="table_ptr holds what look like addresses"):
        _store_through_table[(1,)](table, 5, BLOCK=8)
    assert not room.any()


def test_results_and_in_place_updates_come_back():
    x = torch.arange(1.0, 6.0)
    out = torch.full((8,), -1.0)
    before = guard_bands.GUARDED[f"{TOY}._shifted_copy"]
    _shifted_copy[(1,)](out[:6], out[:5], 5, BLOCK=8)  # overlapping input and output share one buffer
    assert out.tolist() == [-1.0] * 8
    x6 = torch.cat([x, torch.tensor([6.0])])
    _shifted_copy[(1,)](x6, x6, 5, BLOCK=8)  # in place
    assert x6.tolist() == [2.0, 3.0, 4.0, 5.0, 6.0, 6.0]
    assert guard_bands.GUARDED[f"{TOY}._shifted_copy"] == before + 2


def test_package_kernels_are_found():
    kernels = guard_bands.package_kernels()
    families = {name.split(".")[2] for name in kernels}
    assert families == {"adam", "cross_entropy", "densenet", "linear_cross_entropy", "reductions", "softmax"}
    assert "effilayers.ops.adam.triton._adam_8bit_kernel" in kernels
    assert "effilayers.ops.softmax.triton._tile_backward" in kernels
    assert not any(name.endswith(("_locate", "_tile_indices", "_activated")) for name in kernels)  # helpers
    assert set(guard_bands.ADDRESS_TABLES) <= set(kernels)
