"""The simulated clock (`shoal.costmodel.clock`) and the workers' speeds
(`shoal.costmodel.speeds`): hand-computed timelines, an independent event-by-event
oracle, every group's barrier, and the speed grammar's values and errors."""

import numpy as np
import pytest

from shoal.costmodel import Cluster, Event, step_comm_time
from shoal.costmodel.clock import simulate
from shoal.costmodel.speeds import check_speeds, speed_factors

ZERO_COST = dict(intra_bandwidth=1e30, intra_latency=0.0, inter_bandwidth=1e30, inter_latency=0.0)


def cluster(workers, per_node=1, **links):
    return Cluster(nodes=workers // per_node, workers_per_node=per_node,
                   **(links or ZERO_COST))  # fmt: skip


SYNC = Event("all_reduce", "world", nbytes=0)


def test_hand_computed_lock_step_and_local_steps():
    # Two local steps, then an exchange: worker 1 (2x slower) makes worker 0 wait 2 s.
    compute = np.array([[1.0, 2.0], [1.0, 2.0], [1.0, 1.0]])
    t = simulate([[], [SYNC], []], compute, cluster(2))
    assert t.end.tolist() == [2.0, 4.0, 5.0]
    assert t.busy.tolist() == [3.0, 5.0]
    assert t.idle.tolist() == [2.0, 0.0]
    assert t.comm.tolist() == [0.0, 0.0]
    shares = t.shares()
    np.testing.assert_allclose(shares["busy"], [3 / 5, 1.0])
    np.testing.assert_allclose(shares["idle"], [2 / 5, 0.0])  # waits, none after the end


def test_communication_time_is_the_cost_models():
    c = cluster(4, intra_bandwidth=1e9, intra_latency=1e-3,
                inter_bandwidth=1e8, inter_latency=1e-2)  # fmt: skip
    event = Event("all_reduce", "world", nbytes=4_000_000)
    seconds = step_comm_time([event], c)
    compute = np.array([[0.1, 0.2, 0.3, 0.4]] * 2)
    t = simulate([[event], [event, event]], compute, c)
    np.testing.assert_allclose(t.end, [0.4 + seconds, 0.8 + 3 * seconds])
    np.testing.assert_allclose(t.comm, [3 * seconds] * 4)
    np.testing.assert_allclose(t.idle, [0.6, 0.4, 0.2, 0.0])


def oracle(step_events, compute):
    """Event by event in Python floats, "world" barriers of zero cost only."""
    steps, workers = compute.shape
    clocks, idle, ends = [0.0] * workers, [0.0] * workers, []
    for s in range(steps):
        clocks = [c + float(compute[s, w]) for w, c in enumerate(clocks)]
        for _ in step_events[s]:
            last = max(clocks)
            idle = [i + last - c for i, c in zip(idle, clocks)]
            clocks = [last] * workers
        ends.append(max(clocks))
    return ends, idle


@pytest.mark.parametrize("seed", range(4))
def test_agrees_with_an_event_by_event_oracle(seed):
    rng = np.random.default_rng(seed)
    steps, workers = 30, 5
    compute = rng.exponential(1.0, (steps, workers))
    events = [[SYNC] * int(k) for k in rng.integers(0, 3, steps)]
    t = simulate(events, compute, cluster(workers))
    ends, idle = oracle(events, compute)
    np.testing.assert_allclose(t.end, ends, rtol=1e-12)
    np.testing.assert_allclose(t.idle, idle, rtol=1e-12, atol=1e-12)


def test_intra_and_inter_groups_wait_only_for_their_members():
    compute = np.array([[1.0, 2.0, 3.0, 5.0]])
    c = cluster(4, per_node=2)
    intra = simulate([[Event("all_reduce", "intra", nbytes=0)]], compute, c, group_size=2)
    assert intra.idle.tolist() == [1.0, 0.0, 2.0, 0.0]  # {0, 1} and {2, 3}
    inter = simulate([[Event("all_reduce", "inter", nbytes=0)]], compute, c, group_size=2)
    assert inter.idle.tolist() == [2.0, 3.0, 0.0, 0.0]  # {0, 2} and {1, 3}
    world = simulate([[Event("ppermute", "world", nbytes=0)]], compute, c)
    assert world.idle.tolist() == [4.0, 3.0, 2.0, 0.0]  # a ppermute waits for its group


def test_segments_cover_each_workers_time():
    compute = np.array([[1.0, 3.0], [2.0, 1.0], [1.0, 1.0]])
    t = simulate([[SYNC], [], [SYNC]], compute, cluster(2), keep_steps=3)
    for w in range(2):
        mine = sorted((a, d, k) for v, a, d, k in t.segments if v == w)
        position = 0.0
        for start, seconds, _ in mine:  # back to back, no gap, no overlap
            assert start == pytest.approx(position)
            position = start + seconds
        assert position == pytest.approx(t.end[-1])
    kinds = {k for *_, k in t.segments}
    assert kinds == {"compute", "comm", "idle"}
    assert len(simulate([[SYNC]] * 3, compute, cluster(2), keep_steps=1).segments) < len(t.segments)


def test_simulate_refuses_mismatched_inputs():
    with pytest.raises(ValueError, match="step_events has 1 steps, compute has 2"):
        simulate([[]], np.ones((2, 2)), cluster(2))
    with pytest.raises(ValueError, match="compute has 3 workers, the cluster 2"):
        simulate([[]], np.ones((1, 3)), cluster(2))
    with pytest.raises(ValueError, match="compute must hold finite seconds >= 0"):
        simulate([[]], np.array([[1.0, -1.0]]), cluster(2))


# ---------------------------------------------------------------------------------- speeds


def test_constant_and_per_worker_factors_multiply():
    f = speed_factors("2@0-1+3*1.5", steps=2, workers=4, seed=0)
    assert f.tolist() == [[3.0, 3.0, 1.5, 3.0]] * 2
    assert speed_factors("", steps=1, workers=3, seed=0).tolist() == [[1.0, 1.0, 1.0]]


def test_draws_are_seeded_and_distributed_as_named():
    a = speed_factors("lognormal:0.5", steps=4000, workers=8, seed=3)
    assert np.array_equal(a, speed_factors("lognormal:0.5", steps=4000, workers=8, seed=3))
    assert not np.array_equal(a, speed_factors("lognormal:0.5", steps=4000, workers=8, seed=4))
    logs = np.log(a)
    assert abs(logs.mean()) < 0.02 and abs(logs.std() - 0.5) < 0.02
    p = speed_factors("pareto:3", steps=4000, workers=8, seed=0)
    assert p.min() >= 1.0
    assert abs(p.mean() - (1 + 1 / (3 - 1))) < 0.03  # Lomax(3): mean 1/2
    assert p.max() > 5  # heavy-tailed: stragglers


def test_a_trace_repeats_from_the_top(tmp_path):
    path = tmp_path / "speeds.txt"
    path.write_text("# one row per step\n1 2\n3,4  # comment\n\n")
    f = speed_factors(f"trace:{path}*2", steps=5, workers=2, seed=0)
    assert f.tolist() == [[2, 4], [6, 8], [2, 4], [6, 8], [2, 4]]


@pytest.mark.parametrize(
    "spec, match",
    [
        ("0", r"speeds = '0': a factor must be a finite number > 0, got '0'"),
        ("2@4", r"workers '4' must lie in 0-3 \(4 workers\)"),
        ("2@3-1", r"workers '3-1' must lie in 0-3 \(4 workers\), low to high"),
        ("2@a", r"workers 'a' must be i, i-j or ranges joined by '\+'"),
        ("gamma:2", r"unknown term 'gamma': one of F, F@WORKERS, lognormal:X, pareto:X"),
        ("lognormal:-1", r"lognormal's sigma must be a finite number > 0, got '-1'"),
        ("pareto:inf", r"pareto's shape must be a finite number > 0"),
        ("trace:/no/such/file", r"cannot read the trace '/no/such/file'"),
    ],
)
def test_bad_specs_name_the_term(spec, match):
    with pytest.raises(ValueError, match=match):
        check_speeds(spec, 4)


def test_a_trace_must_have_a_factor_per_worker(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("1 1\n1 1 1\n")
    with pytest.raises(ValueError, match=r"line 2 has 3 factors, one per worker \(2\)"):
        check_speeds(f"trace:{path}", 2)
    path.write_text("# nothing\n")
    with pytest.raises(ValueError, match="holds no rows of factors"):
        check_speeds(f"trace:{path}", 2)


def test_the_modules_examples_run():
    import doctest

    from shoal.costmodel import clock, speeds

    for module in (clock, speeds):
        result = doctest.testmod(module)
        assert result.attempted >= 1 and result.failed == 0, module.__name__
