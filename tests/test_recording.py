"""RecordingCollective / record_events: the per-step sequence of collectives of a
transformation, checked by hand (only executed branches are logged)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from harness import UNDER_MPI

from shoal.comms.recording import RecordingCollective, record_events
from shoal.costmodel import Event
from shoal.optim import (
    allreduce_gradients,
    bmuf,
    bmuf_gtc,
    partial_exchange,
    skip_nonfinite,
)
from shoal.optim.helpers import partial_exchange_bins

pytestmark = pytest.mark.skipif(UNDER_MPI, reason="single-process recording")

PARAMS = {"a": jnp.zeros((10,)), "b": jnp.zeros((4, 5)), "c": jnp.zeros((2,))}  # 32 floats
NBYTES = 4 * 32
# skip_nonfinite all-reduces its non-finite flag, one int32, before the update it wraps.
FLAG = Event("all_reduce", "world", 4)


def test_allreduce_logs_one_event_per_step():
    events = record_events(
        lambda c: allreduce_gradients(collective=c), PARAMS, workers=128, steps=3
    )
    assert events == [[Event("all_reduce", "world", NBYTES)]] * 3


def test_bmuf_logs_only_its_block_steps():
    events = record_events(
        lambda c: bmuf(optax.sgd(0.1), collective=c, block_size=3), PARAMS, workers=16, steps=7
    )
    # A local step communicates nothing at all; a block step all-reduces the model.
    assert events == [[], [], [Event("all_reduce", "world", NBYTES)]] * 2 + [[]]


def test_skip_nonfinite_adds_its_flag_to_every_step():
    make = lambda c: skip_nonfinite(bmuf(optax.sgd(0.1), collective=c, block_size=3), collective=c)
    events = record_events(make, PARAMS, workers=16, steps=7)
    model = Event("all_reduce", "world", NBYTES)
    assert events == [[FLAG], [FLAG], [FLAG, model]] * 2 + [[FLAG]]


def test_pgx_cycles_its_bins():
    fraction = 0.7  # bins of floor(0.7 * 128) = 89 bytes
    events = record_events(
        lambda c: partial_exchange(fraction, collective=c), PARAMS, workers=8, steps=4
    )
    bins = partial_exchange_bins(PARAMS, fraction)  # first fit decreasing: b + c (88 B), then a
    sizes = {"['a']": 40, "['b']": 80, "['c']": 8}
    per_bin = [sum(sizes[p] for p in b) for b in bins]
    assert per_bin == [88, 40]
    assert [[e.nbytes for e in ev] for ev in events] == [[88], [40], [88], [40]]


def test_two_tier_groups():
    events = record_events(
        lambda tiers: skip_nonfinite(
            bmuf_gtc(optax.sgd(0.1), intra=tiers[0], inter=tiers[1], block_size=2, threshold=0.01),
            collective=tiers,
        ),
        PARAMS,
        workers=32,
        group_size=8,
        steps=4,
    )
    # skip_nonfinite's flag is summed in the group, then across groups, before the
    # algorithm runs.
    flags = [Event("all_reduce", "intra", 4), Event("all_reduce", "inter", 4)]
    for t, ev in enumerate(events, 1):
        assert ev[:2] == flags
        groups = [e.group for e in ev[2:]]
        assert "intra" in groups  # GTC inside the group every step
        assert ("inter" in groups) == (t % 2 == 0)  # BMUF across groups every 2 steps


def test_stand_in_values():
    c = RecordingCollective(4)
    x = jnp.arange(8.0).reshape(4, 2)
    np.testing.assert_array_equal(c.all_reduce(x, "sum"), 4 * x)
    np.testing.assert_array_equal(c.all_gather(x[0]), jnp.broadcast_to(x[0], (4, 2)))
    np.testing.assert_array_equal(c.all_to_all(x), jnp.broadcast_to(x[0], (4, 2)))
    np.testing.assert_array_equal(c.ppermute(x, [(1, 0)]), x)
    np.testing.assert_array_equal(c.ppermute(x, [(0, 1)]), jnp.zeros_like(x))
    intra, inter = c.split(2)
    assert (intra.size, intra.group, inter.size, inter.group) == (2, "intra", 2, "inter")
    with pytest.raises(ValueError, match="group"):
        RecordingCollective(4, "nodes")
    assert jax.jit(lambda: c.rank())() == 0
