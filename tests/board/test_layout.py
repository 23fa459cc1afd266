"""The byte map: offsets, sizes, alignment and word packing."""

from __future__ import annotations

import numpy as np
import pytest

from shmhb.board import layout as L



def test_header_fits_and_words_are_aligned() -> None:
    assert L.HEADER_DTYPE.itemsize == L.HEADER_BYTES == 4096
    for name, (dt, off) in L.HEADER_DTYPE.fields.items():
        if dt == np.dtype("<u8") or dt.subdtype:
            assert off % 8 == 0, name
        assert off + dt.itemsize <= L.HEADER_BYTES, name
    f = L.HEADER_DTYPE.fields
    # agent words and lock-protected counters sit on their own cache lines
    assert f["inc_counter"][1] // 64 != f["agent_hb"][1] // 64
    assert f["stats"][1] + f["stats"][0].itemsize <= f["cfg_gen"][1]


@pytest.mark.parametrize("dt,size", [
    (L.SLOT_WORDS_DTYPE, 64), (L.SLOT_RECORD_DTYPE, 384), (L.PEER_ROW_DTYPE, 192),
    (L.REMOTE_ROW_DTYPE, 384), (L.WATCH_ROW_DTYPE, 128),
])
def test_row_sizes_and_word_alignment(dt: np.dtype, size: int) -> None:
    assert dt.itemsize == size
    ends = []
    for name, (fdt, off) in dt.fields.items():
        if fdt == np.dtype("<u8"):
            assert off % 8 == 0, name
        ends.append((off, off + fdt.itemsize))
    ends.sort()
    for (a0, a1), (b0, _) in zip(ends, ends[1:]):
        assert a1 <= b0, "fields overlap"
    assert ends[-1][1] <= size


def test_section_offsets() -> None:
    s = L.Sizes(64, 256, 4096, 512)
    assert s.slot_off == 4096
    assert s.record_off == 4096 + 64 * 64
    assert s.peer_off == s.record_off + 64 * 384
    assert s.remote_off == s.peer_off + 256 * 192
    assert s.watch_off == s.remote_off + 4096 * 384
    assert s.total_bytes % 4096 == 0 and s.total_bytes >= s.watch_off + 512 * 128
    for off in (s.slot_off, s.record_off, s.peer_off, s.remote_off, s.watch_off):
        assert off % 64 == 0
    # odd sizes stay aligned
    t = L.Sizes(3, 5, 7, 9)
    for off in (t.slot_off, t.record_off, t.peer_off, t.remote_off, t.watch_off):
        assert off % 64 == 0


def test_word_packing_roundtrip() -> None:
    inc, ts = 0xABCDEF12345, (1 << 39) - 5
    w = L.pack_hb(inc, ts)
    assert w >> L.INC_SHIFT == inc & L.INC_MASK
    assert w & L.TS39_MASK == ts and not w & L.LEFT_BIT
    assert L.pack_hb(inc, ts, left=True) & L.LEFT_BIT
    assert w < 1 << 64
    g, c, t = L.unpack_row(L.pack_row(0x123456, 3, 0xFF_FFFF_FFFF))
    assert (g, c, t) == (0x23456, 3, 0xFF_FFFF_FFFF)
    assert L.pack_verdict(5, 7) == (5 << 40) | 7
    assert L.pack_rtt(1, 1 << 50) & L.RTT_MASK == L.RTT_MASK


def test_checksum_covers_every_record_field() -> None:
    rec = np.zeros((), L.SLOT_RECORD_DTYPE)
    rec["incarnation"], rec["pid"], rec["key"], rec["endpoints"] = 7, 42, b"k", b"h:1"
    base = L.record_checksum(rec)
    assert base != 0
    for field, value in [("incarnation", 8), ("pid", 43), ("pid_start", 1), ("pid_ns", 1),
                         ("registered_ns", 1), ("key", b"j"), ("endpoints", b"h:2")]:
        r2 = rec.copy()
        r2[field] = value
        assert L.record_checksum(r2) != base, field


def test_endpoints_roundtrip() -> None:
    eps = ("10.0.0.1:30003", "[::1]:5")
    assert L.decode_endpoints(L.encode_endpoints(eps)) == eps
    assert L.decode_endpoints(b"") == ()
