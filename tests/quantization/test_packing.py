"""Bit packing against the layout written in ``packing.py``'s docstring, built bit by bit here."""

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mxtrain.formats import MX_FORMAT_NAMES, parse_format
from mxtrain.quantization import pack_codes, packed_length, quantize_mx, unpack_codes

SUB_BYTE = ["fp6_e3m2", "fp6_e2m3", "fp4_e2m1", "int4", "int2"]
GROUP = {6: 4, 4: 2, 2: 4}
GROUP_BYTES = {6: 3, 4: 1, 2: 1}


def reference_pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """The documented layout, one group at a time, with plain Python integers."""
    flat = codes.reshape(-1, codes.shape[-1])
    rows = []
    for row in flat:
        out = []
        for i in range(0, len(row), GROUP[bits]):
            c = [int(v) for v in row[i:i + GROUP[bits]]]
            if bits == 4:
                out.append(c[0] | c[1] << 4)
            elif bits == 2:
                out.append(c[0] | c[1] << 2 | c[2] << 4 | c[3] << 6)
            else:
                lo = [v & 0xF for v in c]
                hi = [v >> 4 for v in c]
                out += [lo[0] | lo[1] << 4, lo[2] | lo[3] << 4, hi[0] | hi[1] << 2 | hi[2] << 4 | hi[3] << 6]
        rows.append(out)
    return np.array(rows, dtype=np.uint8).reshape(*codes.shape[:-1], -1)


@pytest.mark.parametrize("name", SUB_BYTE)
def test_every_code_in_every_slot(name):
    """Each code value in each position of a group, against the documented bit positions."""
    bits = parse_format(name).bits
    g = GROUP[bits]
    rows = []
    for slot in range(g):
        for code in range(2**bits):
            row = np.zeros(g, np.int64)
            row[slot] = code
            rows.append(row)
    codes = np.array(rows, dtype=np.uint8)
    packed = pack_codes(torch.from_numpy(codes), name)
    assert packed.dtype == torch.uint8 and packed.shape == (len(rows), GROUP_BYTES[bits])
    np.testing.assert_array_equal(packed.numpy(), reference_pack(codes, bits))
    assert torch.equal(unpack_codes(packed, name), torch.from_numpy(codes))


@pytest.mark.parametrize("name", ["fp4_e2m1", "int4", "int2"])
def test_packing_is_a_bijection_on_bytes(name):
    """4-bit pairs and 2-bit quads: all 256 arrangements give all 256 bytes, and back."""
    bits = parse_format(name).bits
    g = GROUP[bits]
    codes = np.array(list(itertools.product(range(2**bits), repeat=g)), dtype=np.uint8)
    packed = pack_codes(torch.from_numpy(codes), name).numpy().ravel()
    assert sorted(packed.tolist()) == list(range(256))
    np.testing.assert_array_equal(packed, reference_pack(codes, bits).ravel())
    assert torch.equal(unpack_codes(torch.arange(256, dtype=torch.uint8).reshape(-1, 1), name),
                       torch.from_numpy(codes[np.argsort(packed)]))


@pytest.mark.parametrize("name", ["fp6_e3m2", "fp6_e2m3"])
def test_fp6_every_byte_triple_unpacks_and_repacks(name):
    """Every value of every packed byte (in each of the 3 positions) round-trips."""
    b = np.zeros((3 * 256, 3), np.uint8)
    for pos in range(3):
        b[pos * 256:(pos + 1) * 256, pos] = np.arange(256)
    packed = torch.from_numpy(b)
    codes = unpack_codes(packed, name)
    assert codes.shape == (3 * 256, 4) and int(codes.max()) < 64
    assert torch.equal(pack_codes(codes, name), packed)
    np.testing.assert_array_equal(reference_pack(codes.numpy(), 6), b)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(SUB_BYTE + ["fp8_e4m3", "int8"]), st.lists(st.integers(1, 4), max_size=3),
       st.integers(1, 12), st.data())
def test_round_trip_random_shapes(name, lead, groups, data):
    bits = parse_format(name).bits
    g = GROUP.get(bits, 1)
    shape = tuple(lead) + (groups * g,)
    seed = data.draw(st.integers(0, 2**32 - 1))
    codes = np.random.default_rng(seed).integers(0, 2**bits, shape).astype(np.uint8)
    t = torch.from_numpy(codes)
    packed = pack_codes(t, name)
    assert packed.shape == shape[:-1] + (packed_length(shape[-1], name),)
    if bits < 8:
        assert packed.shape[-1] == groups * GROUP_BYTES[bits]
        np.testing.assert_array_equal(packed.numpy(), reference_pack(codes, bits))
    else:
        assert torch.equal(packed, t)
    assert torch.equal(unpack_codes(packed, name), t)


@pytest.mark.parametrize("name", MX_FORMAT_NAMES)
def test_quantize_mx_packed_plane_is_pack_of_codes(name):
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((3, 5, 64)).astype(np.float32))
    packed = quantize_mx(x, name, axis=(1, 2), block_size=4)
    plain = quantize_mx(x, name, axis=(1, 2), block_size=4, pack=False)
    for axis in (1, 2):
        p, q = packed.plane(axis), plain.plane(axis)
        assert p.packed and not q.packed
        assert torch.equal(p.scale, q.scale)
        assert torch.equal(p.data, pack_codes(q.data, name))
        assert torch.equal(packed.codes(axis), q.data)
        assert torch.equal(packed.dequantize(axis=axis), plain.dequantize(axis=axis))
    bits = parse_format(name).bits
    assert packed.plane(2).data.shape[-1] == 64 * bits // 8


def test_pack_errors():
    with pytest.raises(ValueError, match="pack=False"):
        pack_codes(torch.zeros(6, dtype=torch.uint8), "fp6_e2m3")
    with pytest.raises(ValueError, match="multiple of 2"):
        pack_codes(torch.zeros(3, dtype=torch.uint8), "fp4_e2m1")
    with pytest.raises(ValueError, match="multiple of 4"):
        pack_codes(torch.zeros(6, dtype=torch.uint8), "int2")
    with pytest.raises(TypeError):
        pack_codes(torch.zeros(4, dtype=torch.int32), "fp4_e2m1")
    with pytest.raises(TypeError):
        unpack_codes(torch.zeros(4, dtype=torch.int8), "fp4_e2m1")
    with pytest.raises(ValueError, match="multiple of 3"):
        unpack_codes(torch.zeros(4, dtype=torch.uint8), "fp6_e3m2")
