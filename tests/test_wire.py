"""Wire accounting's exact 64-bit counts (two uint32 words) and the meters' step and total."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shoal.comms import ByteCount, WireCount, WireMeter, wire_bytes

WORD = 2**32


def words(count):
    return int(count.hi), int(count.lo)


def test_of_splits_into_words():
    assert words(ByteCount.of(0)) == (0, 0)
    assert words(ByteCount.of(WORD - 1)) == (0, 4_294_967_295)
    assert words(ByteCount.of(WORD)) == (1, 0)
    # 2,642,411,527: one S-SGD step of a 336M-parameter float32 model on 64 workers.
    assert words(ByteCount.of(2_642_411_527)) == (0, 2_642_411_527)
    assert words(ByteCount.of(10**12)) == (232, 3_567_587_328)  # 232 * 2**32 + lo
    assert ByteCount.of(10**12).hi.dtype == jnp.uint32
    with pytest.raises(ValueError):
        ByteCount.of(-1)
    with pytest.raises(TypeError, match="static Python int"):
        jax.jit(ByteCount.of)(3)


def test_add_carries_past_2_32():
    # (2**32 - 1) + 1 = 2**32: lo wraps to 0, hi takes the carry.
    assert words(ByteCount.of(WORD - 1) + ByteCount.of(1)) == (1, 0)
    # 3e9 + 3e9 = 6e9 = 1 * 2**32 + 1,705,032,704.
    six = ByteCount.of(3_000_000_000) + ByteCount.of(3_000_000_000)
    assert words(six) == (1, 1_705_032_704) and int(six) == 6_000_000_000
    # (5 * 2**32 + 4e9) + (2 * 2**32 + 5e8) = 8 * 2**32 + 205,032,704: both words and a carry.
    a = ByteCount(jnp.uint32(5), jnp.uint32(4_000_000_000))
    b = ByteCount(jnp.uint32(2), jnp.uint32(500_000_000))
    assert words(a + b) == (8, 205_032_704)
    assert int(a + b) == 34_564_771_072  # 34,359,738,368 + 205,032,704
    # No carry when lo does not wrap.
    assert words(ByteCount.of(WORD + 7) + ByteCount.of(8)) == (1, 15)


def test_add_under_jit_and_vmap_and_host_values():
    # Three workers, each adding 2**32 - 5 to its own count 4, 5, 6.
    mine = ByteCount(jnp.zeros(3, jnp.uint32), jnp.asarray([4, 5, 6], jnp.uint32))
    out = jax.jit(jax.vmap(lambda c: c + ByteCount.of(WORD - 5)))(mine)
    assert out.hi.shape == (3,)
    assert np.asarray(out.hi).tolist() == [0, 1, 1]
    assert np.asarray(out.lo).tolist() == [WORD - 1, 0, 1]
    host = np.asarray(out)
    assert host.dtype == np.int64 and host.tolist() == [WORD - 1, WORD, WORD + 1]
    assert out.numpy().tolist() == host.tolist()
    assert int(out[2]) == WORD + 1  # indexing picks a worker's count
    assert repr(out) == f"[{WORD - 1}, {WORD}, {WORD + 1}]"


def test_meter_record_add_idle():
    m = WireMeter.zero().record(WireCount.of(3_000_000_000, 10))
    m = m.record(WireCount.of(3_000_000_000, 20))
    assert (int(m.step.sent), int(m.step.received)) == (3_000_000_000, 20)
    assert (int(m.total.sent), int(m.total.received)) == (6_000_000_000, 30)
    m = m.add(WireCount.of(6, 6))  # the same update also moved a flag
    assert (int(m.step.sent), int(m.total.sent)) == (3_000_000_006, 6_000_000_006)
    m = m.idle()  # a skipped step moved nothing; the totals stay
    assert (int(m.step.sent), int(m.step.received)) == (0, 0)
    assert (int(m.total.sent), int(m.total.received)) == (6_000_000_006, 36)
    with pytest.raises(TypeError, match="record"):
        m + WireCount.of(1, 1)


def test_wire_bytes_which_and_printing():
    state = {
        "a": WireMeter(WireCount.of(1, 2), WireCount.of(WORD, 20)),
        "b": (WireMeter(WireCount.of(3, 4), WireCount.of(WORD - 1, 40)),),
    }
    assert str(wire_bytes(state, "step")) == "WireCount(sent=4, received=6)"
    assert str(wire_bytes(state, which="total")) == f"WireCount(sent={2 * WORD - 1}, received=60)"
    traced = jax.jit(lambda s: wire_bytes(s, "total"))(state)
    assert int(traced.sent) == 2 * WORD - 1
