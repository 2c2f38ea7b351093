"""The `Collective` protocol is complete: every engine has every member, algorithms refuse
a value that lacks one (naming it), and the host-side agreements give every rank's value."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from harness import UNDER_MPI

from shoal.comms import AxisCollective, Collective, RecordingCollective, check_same_structure
from shoal.comms.collective import MEMBERS, missing_members
from shoal.optim import allreduce_gradients


def _engines():
    yield AxisCollective("workers", 4)
    yield RecordingCollective(4)
    if UNDER_MPI:
        from shoal.comms import MPICollective

        yield MPICollective()


@pytest.mark.mpi
@pytest.mark.parametrize("engine", list(_engines()), ids=lambda c: type(c).__name__)
def test_every_engine_has_every_member(engine):
    assert isinstance(engine, Collective)
    assert missing_members(engine) == []
    intra, inter = engine.split(engine.size // 2 if engine.size % 2 == 0 else 1)
    assert missing_members(intra) == missing_members(inter) == []
    assert intra.size * inter.size == engine.size


def test_members_match_the_protocol():
    declared = {m for m in vars(Collective) if not m.startswith("_")}
    assert declared | {"size"} == set(MEMBERS)


class _Partial:
    """A collective written against the old, incomplete contract."""

    size = 2

    def rank(self):
        return jnp.int32(0)

    def all_reduce(self, tree, op="mean"):
        return tree

    def all_gather(self, x):
        return jnp.stack([x, x])

    def all_to_all(self, x):
        return x


def test_algorithms_name_the_missing_members():
    with pytest.raises(TypeError) as e:
        allreduce_gradients(collective=_Partial())
    for member in ("uniform", "broadcast", "ppermute", "split", "host_allgather"):
        assert f".{member}" in str(e.value)
    assert "_Partial" in str(e.value)


@pytest.mark.mpi
def test_host_agreements_give_every_ranks_value():
    if UNDER_MPI:
        from shoal.comms import MPICollective

        coll = MPICollective()
        me = coll.process_rank
        assert coll.host_allgather(("rank", me)) == [("rank", r) for r in range(coll.size)]
        assert coll.host_broadcast(me * 10, root=coll.size - 1) == (coll.size - 1) * 10
    else:
        coll = AxisCollective("workers", 3)
        value = {"a": 1}
        assert coll.host_allgather(value) == [value] * 3
        assert coll.host_broadcast(value, root=2) is value
        with pytest.raises(ValueError, match="root"):
            coll.host_broadcast(value, root=3)


def test_structure_check_goes_through_the_protocol():
    # A stand-in whose ranks disagree shows that the check reads host_allgather (MPI's
    # case, without MPI): worker 1's leaf "b" is float16 where worker 0's is float32.
    class Disagreeing(RecordingCollective):
        def host_allgather(self, obj):
            other = [(path, shape, "float16" if path == "['b']" else dt) for path, shape, dt in obj]
            return [obj, other]

    tree = {"a": jnp.zeros(2), "b": jnp.zeros(3)}
    with pytest.raises(ValueError, match=r"leaf 1 \['b'\]: worker 0 has shape \(3,\) float32"):
        check_same_structure(tree, Disagreeing(2))
    check_same_structure(tree, RecordingCollective(2))  # identical workers: accepted
