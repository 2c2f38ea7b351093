"""GTC pack/unpack kernels against an independent NumPy oracle of Strom's encoding.

Every check is bit-exact: words as int32, remainders compared as raw float32 bits.
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_target import lower_for_cuda, on_gpu
from gtc_oracle import SIGN, pack_oracle, unpack_oracle

from shoal.kernels import gtc_pack, gtc_pack_parts, gtc_unpack
from shoal.kernels.gtc_pallas import BLOCK, gtc_pack_pallas, gtc_unpack_pallas


def bits(x):
    return np.asarray(x, np.float32).view(np.int32)


def assert_pack_equal(result, expected):
    words, count, remainder = result
    e_words, e_count, e_remainder = expected
    np.testing.assert_array_equal(np.asarray(words), e_words)
    assert int(count) == e_count
    np.testing.assert_array_equal(bits(remainder), bits(e_remainder))


def random_values(rng, n, density, specials=False):
    v = rng.standard_normal(n).astype(np.float32)
    tau = np.float32(np.quantile(np.abs(v), 1 - density)) if density > 0 else np.float32(10)
    if specials and n >= 8:
        at = rng.choice(n, 6, replace=False)
        v[at] = [np.nan, np.inf, -np.inf, -0.0, tau, -tau]
    return v, tau


# ---------------------------------------------------------------------------- pack


def test_word_bit_layout():
    v = np.array([0.0, 3.0, -4.0, 0.5, -0.25, 5.0, 1.5], np.float32)
    words, count, remainder = gtc_pack(jnp.asarray(v), 1.0, 5)
    # Index in bits 0-30, bit 31 set for -tau: int32 words are negative exactly for -tau.
    expected = [1, 2 | SIGN, 5, 6, 0]
    np.testing.assert_array_equal(np.asarray(words).view(np.uint32), expected)
    np.testing.assert_array_equal(np.asarray(words), [1, -(2**31) + 2, 5, 6, 0])
    assert words.dtype == jnp.int32 and words.shape == (5,)
    assert count.dtype == jnp.int32 and count.shape == () and int(count) == 4
    np.testing.assert_array_equal(
        np.asarray(remainder), np.array([0, 2, -3, 0.5, -0.25, 4, 0.5], np.float32)
    )


def test_negative_zero_and_exact_tau_are_kept():
    tau = np.float32(0.75)
    v = np.array([-0.0, 0.0, tau, -tau, np.nextafter(tau, np.float32(1)), -1.0], np.float32)
    words, count, remainder = gtc_pack(jnp.asarray(v), tau, 6)
    assert int(count) == 2  # |v| == tau is not sent (strict threshold)
    np.testing.assert_array_equal(np.asarray(words)[:3], [4, 5 | -(2**31), 0])
    np.testing.assert_array_equal(bits(remainder)[:4], bits(v)[:4])  # -0.0 stays -0.0
    assert_pack_equal((words, count, remainder), pack_oracle(v, tau, 6))


def test_nan_and_inf():
    nan_payload = np.array([0x7FC01234], np.int32).view(np.float32)[0]
    v = np.array([np.nan, np.inf, 0.1, -np.inf, nan_payload, -3.0], np.float32)
    words, count, remainder = gtc_pack(jnp.asarray(v), 1.0, 6)
    # NaN never qualifies and keeps its exact bits; +-Inf is sent and stays +-Inf.
    np.testing.assert_array_equal(np.asarray(words), [1, 3 | -(2**31), 5 | -(2**31), 0, 0, 0])
    assert int(count) == 3
    np.testing.assert_array_equal(bits(remainder)[[0, 4]], bits(v)[[0, 4]])
    np.testing.assert_array_equal(np.asarray(remainder)[[1, 3, 5]], [np.inf, -np.inf, -2.0])


@pytest.mark.parametrize(
    ("capacity", "offset", "sent"),
    [
        (3, 0, [1, 2, 4]),  # the first three from index 0
        (3, 4, [4, 7, 9]),  # from the offset on, no wrap needed
        (3, 8, [1, 2, 9]),  # wraps: 9, then 1, 2; words still in index order
        (2, 5, [7, 9]),
        (4, 9, [1, 2, 4, 9]),
        (6, 3, [1, 2, 4, 7, 9]),  # everything fits: all sent, offset irrelevant
    ],
)
def test_capacity_overflow_with_offset(capacity, offset, sent):
    v = np.zeros(10, np.float32)
    v[[1, 2, 4, 7, 9]] = [2.0, -2.0, 3.0, -3.0, 4.0]
    words, count, remainder = gtc_pack(jnp.asarray(v), 1.0, capacity, offset)
    assert int(count) == len(sent)
    np.testing.assert_array_equal(np.asarray(words)[: len(sent)] & (SIGN - 1), sent)
    assert not np.asarray(words)[len(sent) :].any()
    assert_pack_equal((words, count, remainder), pack_oracle(v, 1.0, capacity, offset))


@pytest.mark.parametrize("n", [1, 7, 64, 200, 4099])
@pytest.mark.parametrize("density", [0.0, 0.02, 0.3, 1.0])
def test_pack_matches_oracle(n, density):
    rng = np.random.default_rng(n * 1000 + int(density * 100))
    v, tau = random_values(rng, n, density, specials=True)
    pack = jax.jit(gtc_pack, static_argnums=2)
    for capacity in sorted({1, max(1, n // 3), n}):
        for offset in sorted({0, n // 2, n - 1}):
            result = pack(jnp.asarray(v), tau, capacity, offset)
            assert_pack_equal(result, pack_oracle(v, tau, capacity, offset))


def test_traced_tau_and_offset():
    rng = np.random.default_rng(5)
    v, tau = random_values(rng, 300, 0.2)

    @jax.jit
    def pack(v, tau, offset):
        return gtc_pack(v, tau, 40, offset)

    for offset in (0, 123, 299, 300 + 17):  # a traced offset is taken modulo n
        assert_pack_equal(pack(v, tau, offset), pack_oracle(v, tau, 40, offset % 300))


def test_donated_values_are_updated_in_place():
    rng = np.random.default_rng(6)
    v, tau = random_values(rng, 4096, 0.05)
    expected = pack_oracle(v, tau, 100, 7)
    pack = jax.jit(functools.partial(gtc_pack, capacity=100), donate_argnums=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Some donated buffers were not usable"
        result = pack(jnp.asarray(v), tau, offset=7)
    assert_pack_equal(result, expected)


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_vmap_over_workers(impl):
    """Simulated workers: vmap (also nested, as for two-tier groups) packs each row."""
    rng = np.random.default_rng(10)
    groups, members, n, capacity = 2, 3, 700, 25
    v = rng.standard_normal((groups, members, n)).astype(np.float32)
    tau = np.float32(1.2)
    offsets = rng.integers(0, n, (groups, members)).astype(np.int32)
    pack = functools.partial(gtc_pack, capacity=capacity, impl=impl)

    flat = jax.jit(jax.vmap(lambda v, o: pack(v, tau, offset=o)))
    words, count, remainder = flat(v[0], offsets[0])
    for m in range(members):
        expected = pack_oracle(v[0, m], tau, capacity, offsets[0, m])
        assert_pack_equal((words[m], count[m], remainder[m]), expected)

    taus = np.float32(1.0) + rng.random((groups, members)).astype(np.float32)
    nested = jax.jit(jax.vmap(jax.vmap(lambda v, t, o: pack(v, t, offset=o))))
    words, count, remainder = nested(v, taus, offsets)
    for g in range(groups):
        for m in range(members):
            expected = pack_oracle(v[g, m], taus[g, m], capacity, offsets[g, m])
            assert_pack_equal((words[g, m], count[g, m], remainder[g, m]), expected)


# -------------------------------------------------------------------------- unpack


def test_unpack_ignores_slots_past_count():
    words = jnp.asarray([3, 5 | -(2**31), 7, 1, 2 | -(2**31)], jnp.int32)
    dense = gtc_unpack(words, 2, 0.5, 10)
    expected = np.zeros(10, np.float32)
    expected[[3, 5]] = [0.5, -0.5]
    np.testing.assert_array_equal(np.asarray(dense), expected)
    np.testing.assert_array_equal(np.asarray(gtc_unpack(words, 0, 0.5, 10)), np.zeros(10))


def test_unpack_sums_all_buffers():
    rng = np.random.default_rng(7)
    n, capacity, workers = 500, 60, 4
    tau = np.float32(0.1)  # 3 * 0.1 rounds: the result must be tau * net count
    words, counts = [], []
    for p in range(workers):
        v, _ = random_values(rng, n, 0.0)
        w, c, _ = pack_oracle(v * 10, tau, capacity, offset=37 * p)
        w[c:] = rng.integers(-(2**31), 2**31 - 1, capacity - c)  # garbage past count
        words.append(w)
        counts.append(c)
    words, counts = np.stack(words), np.asarray(counts, np.int32)
    dense = gtc_unpack(jnp.asarray(words), jnp.asarray(counts), tau, n)
    np.testing.assert_array_equal(bits(dense), bits(unpack_oracle(words, counts, tau, n)))
    # Leading dims [2, 2] behave as the flattened [4].
    dense4 = gtc_unpack(words.reshape(2, 2, capacity), counts.reshape(2, 2), tau, n)
    np.testing.assert_array_equal(bits(dense4), bits(dense))


def test_round_trip_conserves_values():
    # Multiples of 2**-12 below 2**6 and tau = 0.375: every v -+ tau is exact.
    rng = np.random.default_rng(8)
    workers, n, capacity = 3, 1000, 150
    values = (rng.integers(-(2**18), 2**18, (workers, n)) / 2**12).astype(np.float32)
    tau = np.float32(0.375)
    packs = [gtc_pack(jnp.asarray(values[p]), tau, capacity, 11 * p) for p in range(workers)]
    for p, (words, count, remainder) in enumerate(packs):
        np.testing.assert_array_equal(
            np.asarray(remainder + gtc_unpack(words, count, tau, n)), values[p]
        )
    words = jnp.stack([w for w, _, _ in packs])
    counts = jnp.stack([c for _, c, _ in packs])
    total = sum(r for _, _, r in packs) + gtc_unpack(words, counts, tau, n)
    np.testing.assert_array_equal(np.asarray(total), values.sum(0))


# ------------------------------------------------- decode over the fewest slots
# The reference decodes (and unpacks) over the fewest of capacity, capacity / 2, ...
# capacity / 16 slots that hold every buffer's count; these counts fall in each of them,
# on both sides of each boundary (capacity 16384: 1024, 2048, 4096, 8192, 16384 slots).
BIG_N, BIG_CAPACITY = 24000, 16384
SENT = [0, 1, 1024, 1025, 2048, 2049, 5000, 16384, 20000]


def values_sending(rng, n, sent):
    """``n`` values of which exactly ``sent`` have ``|v| > 1``, both signs."""
    v = rng.uniform(-0.9, 0.9, n).astype(np.float32)
    at = rng.choice(n, sent, replace=False)
    v[at] = (rng.uniform(1.1, 3.0, sent) * rng.choice([-1, 1], sent)).astype(np.float32)
    return v


@pytest.mark.parametrize("sent", SENT)
def test_decode_over_fewer_slots_matches_oracle(sent):
    rng = np.random.default_rng(sent)
    v = values_sending(rng, BIG_N, sent)
    parts = [v[:1000].reshape(10, 100), v[1000:1037], v[1037:]]
    for offset in (0, 12345):
        expected = pack_oracle(v, 1.0, BIG_CAPACITY, offset)
        assert expected[1] == min(sent, BIG_CAPACITY)
        assert_pack_equal(gtc_pack(jnp.asarray(v), 1.0, BIG_CAPACITY, offset), expected)
        words, count, rem = gtc_pack_parts(parts, 1.0, BIG_CAPACITY, offset)
        flat = np.concatenate([np.ravel(r) for r in rem])
        assert_pack_equal((words, count, flat), expected)
    words, count = expected[:2]
    dense = gtc_unpack(jnp.asarray(words), count, 0.5, BIG_N)
    np.testing.assert_array_equal(bits(dense), bits(unpack_oracle(words, count, 0.5, BIG_N)))


def test_decode_over_fewer_slots_under_nested_vmap():
    # Buffers with different counts: the branch is the one for the largest.
    rng = np.random.default_rng(11)
    sent = np.array([[3, 5000], [0, 1500]])
    v = np.stack([np.stack([values_sending(rng, BIG_N, s) for s in row]) for row in sent])
    offsets = jnp.array([[0, 777], [23999, 4096]], jnp.int32)
    pack = lambda x, o: gtc_pack(x, 1.0, BIG_CAPACITY, o)
    words, count, rem = jax.vmap(jax.vmap(pack))(jnp.asarray(v), offsets)
    pack_parts = lambda x, o: gtc_pack_parts([x[:100], x[100:]], 1.0, BIG_CAPACITY, o)
    p_words, p_count, p_rem = jax.vmap(jax.vmap(pack_parts))(jnp.asarray(v), offsets)
    for i in range(2):
        for j in range(2):
            expected = pack_oracle(v[i, j], 1.0, BIG_CAPACITY, int(offsets[i, j]))
            assert_pack_equal((words[i, j], count[i, j], rem[i, j]), expected)
            p_flat = np.concatenate([np.asarray(r)[i, j] for r in p_rem])
            assert_pack_equal((p_words[i, j], p_count[i, j], p_flat), expected)
    # Unpack: each group's buffers summed, the groups decoded on their own (vmap over
    # them, and nested: a vmap over a batch of one group).
    taus = jnp.array([0.5, 0.25], jnp.float32)
    unpack = lambda w, c, t: gtc_unpack(w, c, t, BIG_N)
    dense = jax.vmap(unpack)(words, count, taus)
    nested = jax.vmap(jax.vmap(unpack), in_axes=(1, 1, None))(words[:, None], count[:, None], taus)
    for i in range(2):
        expected = unpack_oracle(np.asarray(words[i]), np.asarray(count[i]), taus[i], BIG_N)
        np.testing.assert_array_equal(bits(dense[i]), bits(expected))
        np.testing.assert_array_equal(bits(nested[0, i]), bits(expected))


# ------------------------------------------------------------------ pack by parts


def split_parts(rng, v):
    """``v`` cut at random points (groups of 64 straddled, parts shorter than a group,
    empty ones) and reshaped to random 1-3-D shapes, row-major."""
    cuts = np.sort(rng.choice(np.arange(v.size + 1), rng.integers(0, 6)))
    parts = []
    for piece in np.split(v, cuts):
        shape = (piece.size,)
        if piece.size and piece.size % 3 == 0:
            shape = (3, piece.size // 3) if piece.size % 2 else (piece.size // 3, 1, 3)
        parts.append(piece.reshape(shape))
    return parts


@pytest.mark.parametrize("n", [1, 63, 64, 65, 1000, 4099])
def test_pack_parts_is_the_pack_of_the_concatenation(n):
    rng = np.random.default_rng(n)
    for density in (0.0, 0.05, 0.6):
        v, tau = random_values(rng, n, density, specials=True)
        parts = split_parts(rng, v)
        for capacity in sorted({1, max(1, n // 7), n}):
            for offset in (0, n // 3, n - 1):
                words, count, rem = gtc_pack_parts(
                    [jnp.asarray(p) for p in parts], tau, capacity, offset
                )
                assert [r.shape for r in rem] == [p.shape for p in parts]
                flat = np.concatenate([np.ravel(r) for r in rem])
                assert_pack_equal((words, count, flat), pack_oracle(v, tau, capacity, offset))


def test_pack_parts_adds_residuals_where_it_reads():
    rng = np.random.default_rng(5)
    g = [rng.standard_normal(s).astype(np.float32) for s in ((7, 9), (64,), (130,))]
    r = [rng.standard_normal(x.shape).astype(np.float32) for x in g]
    v = np.concatenate([np.ravel(a + b) for a, b in zip(g, r)])
    words, count, rem = gtc_pack_parts(g, 1.2, 40, 17, residuals=r)
    flat = np.concatenate([np.ravel(x) for x in rem])
    assert_pack_equal((words, count, flat), pack_oracle(v, np.float32(1.2), 40, 17))


def test_pack_parts_under_vmap_and_nested_vmap():
    rng = np.random.default_rng(6)
    shapes = [(5, 13), (1,), (200,)]
    values = rng.standard_normal((2, 3, 266)).astype(np.float32)
    offsets = jnp.array([[0, 100, 265], [7, 64, 1]], jnp.int32)
    cut = np.cumsum([65, 1])
    parts = [p.reshape(2, 3, *s) for p, s in zip(np.split(values, cut, axis=2), shapes)]
    pack = lambda ps, o: gtc_pack_parts(list(ps), 0.9, 30, o)
    words, count, rem = jax.vmap(jax.vmap(pack))([jnp.asarray(p) for p in parts], offsets)
    for i in range(2):
        for j in range(3):
            flat = np.concatenate([np.ravel(np.asarray(r)[i, j]) for r in rem])
            expected = pack_oracle(values[i, j], np.float32(0.9), 30, int(offsets[i, j]))
            assert_pack_equal((words[i, j], count[i, j], flat), expected)


def test_pack_parts_pallas_interpret_matches_reference():
    rng = np.random.default_rng(7)
    v, tau = random_values(rng, 3000, 0.2, specials=True)
    parts = [jnp.asarray(p) for p in split_parts(rng, v)]
    ref = gtc_pack_parts(parts, tau, 500, 1234, impl="reference")
    pallas = gtc_pack_parts(parts, tau, 500, 1234, impl="pallas")
    np.testing.assert_array_equal(np.asarray(pallas[0]), np.asarray(ref[0]))
    assert int(pallas[1]) == int(ref[1])
    for a, b in zip(pallas[2], ref[2]):
        np.testing.assert_array_equal(bits(a), bits(b))


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"parts": np.ones(10, np.float32)}, TypeError, "parts"),
        ({"parts": []}, TypeError, "parts"),
        ({"parts": [np.ones(4, np.float32), np.ones(3, np.int32)]}, TypeError, r"parts\[1\]"),
        ({"parts": [np.ones(0, np.float32)]}, ValueError, "parts"),
        ({"residuals": [np.ones(4, np.float32)]}, TypeError, "residuals"),
        (
            {"residuals": [np.ones(4, np.float32), np.ones(4, np.float32)]},
            ValueError,
            r"residuals\[1\]",
        ),
        ({"capacity": 8}, ValueError, "capacity"),
        ({"offset": 7}, ValueError, "offset"),
        ({"tau": 0.0}, ValueError, "tau"),
    ],
)
def test_pack_parts_rejects_bad_input(kwargs, error, name):
    args = {"parts": [np.ones(4, np.float32), np.ones((1, 3), np.float32)], "tau": 0.5,
            "capacity": 3, "offset": 0}  # fmt: skip
    args.update(kwargs)
    with pytest.raises(error, match=name):
        gtc_pack_parts(**args)


# ---------------------------------------------------------------------- Pallas path


@pytest.mark.parametrize("n", [1, 1000, BLOCK, 2 * BLOCK + 77])
def test_pallas_interpret_is_bit_exact(n):
    rng = np.random.default_rng(n)
    for density in (0.05, 0.6):
        v, tau = random_values(rng, n, density, specials=True)
        capacity = max(1, n // 4)
        for offset in (0, (n * 2) // 3):
            args = (jnp.asarray(v), tau, capacity, offset)
            ref = gtc_pack(*args, impl="reference")
            pallas = gtc_pack(*args, impl="pallas")
            assert_pack_equal(pallas, tuple(np.asarray(x) for x in ref))
            assert_pack_equal(pallas, pack_oracle(v, tau, capacity, offset))
            other, other_count, _ = pack_oracle(-v[::-1], tau, capacity, offset)
            words = jnp.stack([ref[0], jnp.asarray(other)])
            counts = jnp.stack([ref[1] // 2, jnp.int32(other_count)])
            dense_ref = gtc_unpack(words, counts, tau, n, impl="reference")
            dense_pallas = gtc_unpack(words, counts, tau, n, impl="pallas")
            np.testing.assert_array_equal(bits(dense_pallas), bits(dense_ref))


def test_default_impl_is_pallas_on_gpu_only():
    v, tau = random_values(np.random.default_rng(9), 100, 0.1)
    jaxpr = str(jax.make_jaxpr(lambda x: gtc_pack(x, tau, 10, 3))(v))
    assert ("pallas_call" in jaxpr) == on_gpu()
    assert_pack_equal(gtc_pack(v, tau, 10, 3), pack_oracle(v, tau, 10, 3))


def test_pallas_lowers_for_gpu():
    """The Triton kernels lower (Pallas -> Triton IR) for CUDA without a GPU."""

    def pack(values, tau, offset):
        return gtc_pack_pallas(values, tau, 100, offset, interpret=False)

    lowered = lower_for_cuda(
        pack, jax.ShapeDtypeStruct((5000,), jnp.float32), jnp.float32(1), jnp.int32(0)
    )
    text = lowered.as_text()
    assert text.count("xla.gpu.triton") == 2
    assert "gtc_count" in text and "gtc_emit" in text

    unpack = functools.partial(gtc_unpack_pallas, size=5000, interpret=False)
    lowered = lower_for_cuda(
        unpack,
        jax.ShapeDtypeStruct((4, 100), jnp.int32),
        jax.ShapeDtypeStruct((4,), jnp.int32),
        jnp.float32(1),
    )
    text = lowered.as_text()
    assert "gtc_unpack" in text and "gtc_scale" in text


# ------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"capacity": 0}, ValueError, "capacity"),
        ({"capacity": 11}, ValueError, "capacity"),
        ({"capacity": 2.0}, TypeError, "capacity"),
        ({"values": np.ones((2, 5), np.float32)}, ValueError, "values"),
        ({"values": np.arange(10, dtype=np.int32)}, TypeError, "values"),
        ({"values": jnp.ones(10, jnp.bfloat16)}, TypeError, "values"),
        ({"tau": 0.0}, ValueError, "tau"),
        ({"tau": -1.0}, ValueError, "tau"),
        ({"tau": np.ones(2, np.float32)}, ValueError, "tau"),
        ({"offset": 10}, ValueError, "offset"),
        ({"offset": -1}, ValueError, "offset"),
        ({"offset": 1.5}, TypeError, "offset"),
        ({"impl": "triton"}, ValueError, "impl"),
    ],
)
def test_pack_rejects_bad_input(kwargs, error, name):
    args = {"values": np.ones(10, np.float32), "tau": 0.5, "capacity": 3, "offset": 0}
    args.update(kwargs)
    with pytest.raises(error, match=name):
        gtc_pack(**args)


def test_pack_rejects_too_many_elements():
    big = jax.ShapeDtypeStruct((2**31,), jnp.float32)
    with pytest.raises(ValueError, match="values"):
        jax.eval_shape(lambda v: gtc_pack(v, 1.0, 10), big)


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"words": np.ones(4, np.float32)}, TypeError, "words"),
        ({"count": np.ones(2, np.int32)}, ValueError, "count"),
        ({"count": 1.0}, TypeError, "count"),
        ({"size": 0}, ValueError, "size"),
        ({"impl": "cuda"}, ValueError, "impl"),
    ],
)
def test_unpack_rejects_bad_input(kwargs, error, name):
    args = {"words": np.zeros(4, np.int32), "count": 1, "tau": 0.5, "size": 10}
    args.update(kwargs)
    with pytest.raises(error, match=name):
        gtc_unpack(**args)
