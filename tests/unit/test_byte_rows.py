"""Short texts between ranks as fixed-width rows: every rank's text in rank order, rank 0's on
every rank, padding dropped, a text over the width refused before anything is sent."""

import pytest

from thinwire.comm.byte_rows import from_row, gather_bytes, share_bytes, to_row
from thinwire.comm.local import LocalWorld


def test_every_rank_gets_every_text_and_rank_0s():
    def fn(comm):
        mine = f"rank-{comm.rank}".encode() * (comm.rank + 1)
        return gather_bytes(comm, mine, 32), share_bytes(comm, b"from rank %d" % comm.rank, 32), comm.meter.bytes_sent

    out = LocalWorld(3).run(fn)
    for every, shared, _ in out:
        assert every == [b"rank-0", b"rank-1rank-1", b"rank-2rank-2rank-2"] and shared == b"from rank 0"
    assert out[1][2] == 2 * 32  # the all_gather of one 32-byte row to 2 peers; a broadcast's receiver sends nothing


def test_a_row_is_zero_padded_and_a_text_over_the_width_is_refused():
    row = to_row(b"abc", 8)
    assert row.tolist() == [97, 98, 99, 0, 0, 0, 0, 0] and from_row(row) == b"abc"
    assert from_row(to_row(b"", 4)) == b""
    with pytest.raises(ValueError, match="longer than 4 bytes"):
        to_row(b"abcde", 4)
