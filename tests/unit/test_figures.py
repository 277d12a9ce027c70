"""thinwire.figures: the flat {tag: number} dict a logger takes."""

import math

from thinwire.comm.meter import ByteMeter
from thinwire.figures import figures, numeric
from thinwire.timing import Timing


def test_numbers_pass_bools_count_and_the_rest_is_left_out():
    assert [numeric(v) for v in (3, 2.5, True, False, "kernels", None, math.nan, math.inf, [1])] == \
        [3.0, 2.5, 1.0, 0.0, None, None, None, None, None]


def test_figures_carry_bytes_messages_seconds_and_the_methods_own():
    meter = ByteMeter()
    meter.record("all_reduce", 1000, 4)  # a ring all_reduce of 1000 bytes over 4 ranks
    out = figures(meter, Timing(codec_seconds=0.25, comm_seconds=1.5), {"delay": 2, "phase": "warmup", "theta": 0.9})
    assert out == {"thinwire/bytes_sent": meter.bytes_sent, "thinwire/messages": float(meter.messages),
                   "thinwire/codec_seconds": 0.25, "thinwire/comm_seconds": 1.5, "thinwire/delay": 2.0,
                   "thinwire/theta": 0.9}
    assert out["thinwire/bytes_sent"] == 1500.0  # 2 (n-1)/n of the buffer
