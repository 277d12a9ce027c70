"""bitpack: k-bit codes <-> bytes, MSB-first, checked against a bit-string reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from thinwire.numerics.bitpack import pack, pack_numpy, packed_nbytes, unpack

ALL_BITS = list(range(1, 9))
SIZES = [0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 1001]


def reference_pack(codes: list[int], bits: int) -> list[int]:
    """The layout by definition: concatenate each code's bits MSB-first, cut into bytes."""
    stream = "".join(format(c, f"0{bits}b") for c in codes)
    stream += "0" * (-len(stream) % 8)
    return [int(stream[i : i + 8], 2) for i in range(0, len(stream), 8)]


def random_codes(n: int, bits: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 131 + bits * 17 + n)
    return torch.randint(0, 1 << bits, (n,), generator=g, dtype=torch.uint8)


@pytest.mark.parametrize(
    "n, bits, expected",
    [(0, 1, 0), (1, 1, 1), (8, 1, 1), (9, 1, 2), (4, 2, 1), (5, 2, 2), (3, 3, 2), (8, 3, 3), (5, 8, 5), (3, 7, 3)],
)
def test_packed_nbytes_is_ceil_of_bits_over_8(n, bits, expected):
    assert packed_nbytes(n, bits) == expected


@pytest.mark.parametrize(
    "codes, bits, expected",
    [
        ([3, 0, 1, 2], 2, [0b11_00_01_10]),  # first code in the top bits of the first byte
        ([1, 0, 0, 0, 0, 0, 0, 1, 1], 1, [0x81, 0x80]),  # the 9th bit starts byte 2, zero padded
        ([0xA, 0x5, 0xF], 4, [0xA5, 0xF0]),
        ([1, 2, 3], 3, [0b001_010_01, 0b1_0000000]),  # a code straddles the byte boundary
        ([200, 7], 8, [200, 7]),
    ],
)
def test_known_layouts(codes, bits, expected):
    packed = pack(torch.tensor(codes, dtype=torch.uint8), bits)
    assert packed.dtype == torch.uint8
    assert packed.tolist() == expected
    assert unpack(packed, len(codes), bits).tolist() == codes


@pytest.mark.parametrize("bits", ALL_BITS)
@pytest.mark.parametrize("n", SIZES)
def test_matches_reference_and_round_trips(n, bits):
    codes = random_codes(n, bits)
    packed = pack(codes, bits)
    assert packed.shape == (packed_nbytes(n, bits),)
    assert packed.tolist() == reference_pack(codes.tolist(), bits)
    back = unpack(packed, n, bits)
    assert back.dtype == torch.uint8 and torch.equal(back, codes)


@pytest.mark.parametrize("bits", ALL_BITS)
def test_extreme_codes_round_trip(bits):
    codes = torch.tensor([0, (1 << bits) - 1] * 13, dtype=torch.uint8)  # 26 values: all-zero / all-one codes
    assert torch.equal(unpack(pack(codes, bits), codes.numel(), bits), codes)


def test_accepts_other_integer_dtypes_and_shapes_without_modifying_input():
    codes = torch.randint(0, 4, (6, 5), generator=torch.Generator().manual_seed(1))  # int64, 2-D
    before = codes.clone()
    packed = pack(codes.t(), 2)  # a non-contiguous view: packed in its logical (row-major) order
    assert torch.equal(codes, before)
    assert torch.equal(unpack(packed, 30, 2).long(), codes.t().reshape(-1))
    bools = torch.tensor([True, False, True])
    assert pack(bools, 1).tolist() == [0b101_00000]


def test_unpack_ignores_extra_bytes():
    codes = random_codes(10, 3)
    padded = torch.cat([pack(codes, 3), torch.full((5,), 255, dtype=torch.uint8)])
    assert torch.equal(unpack(padded, 10, 3), codes)


@pytest.mark.parametrize("bits", [0, 9, 16, -1, 2.0])
def test_bits_out_of_range_raise_with_the_rule(bits):
    with pytest.raises(ValueError, match=r"bits must be an integer in 1\.\.8"):
        pack(torch.zeros(4, dtype=torch.uint8), bits)
    with pytest.raises(ValueError, match=r"bits must be an integer in 1\.\.8"):
        packed_nbytes(4, bits)


def test_unpack_with_too_few_bytes_raises():
    with pytest.raises(ValueError, match="need 2 bytes for 9 codes of 1 bits, got 1"):
        unpack(torch.zeros(1, dtype=torch.uint8), 9, 1)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("n", SIZES + [2 * 65536 + 5])
def test_numpy_packer_writes_the_same_bytes_into_out(n, bits):
    codes = random_codes(n, bits, seed=2)
    out = np.full(packed_nbytes(n, bits), 0xA5, np.uint8)  # stale bytes: every one must be written
    assert pack_numpy(codes.numpy(), bits, out) is out
    assert out.tolist() == pack(codes, bits).tolist()


def test_numpy_packer_states_its_rules():
    with pytest.raises(ValueError, match=r"widths that divide 8 \(1, 2, 4, 8\), got 3"):
        pack_numpy(np.zeros(8, np.uint8), 3, np.zeros(3, np.uint8))
    with pytest.raises(ValueError, match="out holds 2 bytes, need 3"):
        pack_numpy(np.zeros(5, np.uint8), 4, np.zeros(2, np.uint8))
