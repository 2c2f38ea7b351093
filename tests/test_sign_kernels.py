"""sign_pack/sign_unpack against NumPy (np.packbits, little bit order), bit-exact, for the
jnp reference and the Pallas kernels (interpreted on CPU), plus the CUDA lowering."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu_target import lower_for_cuda, on_gpu

from shoal.kernels import sign_pack, sign_unpack
from shoal.kernels.sign_pallas import ROWS, sign_pack_pallas, sign_unpack_pallas

IMPLS = ["reference", "pallas"]


def pack_oracle(v):
    v = np.asarray(v, np.float32)
    bits = np.packbits(~(v >= 0), axis=-1, bitorder="little")
    scale = np.sqrt(np.sum(v.astype(np.float64) ** 2, axis=-1) / v.shape[-1])
    return bits, scale.astype(np.float32)


def unpack_oracle(bits, scale, size):
    neg = np.unpackbits(np.asarray(bits), axis=-1, bitorder="little")[..., :size]
    s = np.asarray(scale, np.float32)[..., None]
    return np.where(neg == 1, -s, s)


def f32bits(x):
    return np.asarray(x, np.float32).view(np.int32)


@pytest.mark.parametrize("impl", IMPLS)
def test_bit_layout_and_zero_is_plus(impl):
    v = np.array([-1, 2, -0.0, 0.0, -3, 4, 5, -6, np.nan, 1, -1e-30], np.float32)
    bits, scale = sign_pack(jnp.asarray(v), impl=impl)
    # Element 8k+j is bit j of byte k, set for -1; +-0 give +1, NaN gives -1.
    assert bits.dtype == jnp.uint8 and bits.shape == (2,)
    assert np.asarray(bits).tolist() == [0b10010001, 0b101]
    assert np.isnan(float(scale))
    out = sign_unpack(bits, jnp.float32(2.0), 11, impl=impl)
    np.testing.assert_array_equal(np.asarray(out), [-2, 2, 2, 2, -2, 2, 2, -2, -2, 2, -2])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n", [1, 7, 8, 9, 200, 8 * ROWS, 8 * ROWS + 13, 3 * 8 * ROWS + 8])
def test_matches_oracle_and_round_trips(impl, n):
    rng = np.random.default_rng(n)
    v = rng.standard_normal((2, n)).astype(np.float32)
    v[0, ::5] = 0.0
    v[1, ::7] = -0.0
    bits, scale = sign_pack(jnp.asarray(v), impl=impl)
    e_bits, e_scale = pack_oracle(v)
    np.testing.assert_array_equal(np.asarray(bits), e_bits)
    np.testing.assert_allclose(np.asarray(scale), e_scale, rtol=1e-6)
    out = sign_unpack(bits, scale, n, impl=impl)
    np.testing.assert_array_equal(f32bits(out), f32bits(unpack_oracle(e_bits, scale, n)))
    # Round trip: scale * sign(v), exactly.
    expect = np.where(v >= 0, 1, -1) * np.asarray(scale)[:, None]
    np.testing.assert_array_equal(np.asarray(out), expect.astype(np.float32))


@pytest.mark.parametrize("n", [1, 13, 8 * ROWS, 2 * 8 * ROWS + 77])
def test_pallas_interpret_is_bit_exact(n):
    rng = np.random.default_rng(n + 1)
    v = rng.standard_normal((3, n)).astype(np.float32)
    v[0, :1] = np.nan
    v[1, :1] = -0.0
    ref_bits, ref_scale = sign_pack(v, impl="reference")
    pal_bits, pal_scale = sign_pack(v, impl="pallas")
    np.testing.assert_array_equal(np.asarray(pal_bits), np.asarray(ref_bits))
    np.testing.assert_array_equal(f32bits(pal_scale), f32bits(ref_scale))
    scales = jnp.asarray([0.5, 3.0, 1e-20], jnp.float32)
    ref = sign_unpack(ref_bits, scales, n, impl="reference")
    pal = sign_unpack(ref_bits, scales, n, impl="pallas")
    np.testing.assert_array_equal(f32bits(pal), f32bits(ref))


@pytest.mark.parametrize("impl", IMPLS)
def test_vmap_and_nested_vmap(impl):
    v = np.random.default_rng(2).standard_normal((2, 3, 100)).astype(np.float32)
    pack = jax.jit(jax.vmap(jax.vmap(functools.partial(sign_pack, impl=impl))))
    bits, scale = pack(v)
    e_bits, e_scale = pack_oracle(v)
    np.testing.assert_array_equal(np.asarray(bits), e_bits)
    np.testing.assert_allclose(np.asarray(scale), e_scale, rtol=1e-6)
    unpack = jax.jit(jax.vmap(lambda b, s: sign_unpack(b, s, 100, impl=impl)))
    out = unpack(bits[0], scale[0])
    np.testing.assert_array_equal(np.asarray(out), unpack_oracle(e_bits[0], scale[0], 100))


def test_unpack_leading_dimensions():
    bits = np.random.default_rng(3).integers(0, 256, (2, 2, 5), dtype=np.uint8)
    scale = np.arange(1, 5, dtype=np.float32).reshape(2, 2)
    for impl in IMPLS:
        out = sign_unpack(bits, scale, 37, impl=impl)
        np.testing.assert_array_equal(np.asarray(out), unpack_oracle(bits, scale, 37))


def test_default_impl_is_pallas_on_gpu_only():
    v = np.random.default_rng(4).standard_normal(50).astype(np.float32)
    assert ("pallas_call" in str(jax.make_jaxpr(sign_pack)(v))) == on_gpu()
    np.testing.assert_array_equal(np.asarray(sign_pack(v)[0]), pack_oracle(v)[0])


def test_pallas_lowers_for_gpu():
    """The Triton kernels lower (Pallas -> Triton IR) for CUDA without a GPU."""
    pack = functools.partial(sign_pack_pallas, interpret=False)
    text = lower_for_cuda(pack, jax.ShapeDtypeStruct((4, 5000), jnp.float32)).as_text()
    assert text.count("xla.gpu.triton") == 1 and "sign_pack" in text

    unpack = functools.partial(sign_unpack_pallas, size=5000, interpret=False)
    text = lower_for_cuda(
        unpack, jax.ShapeDtypeStruct((4, 625), jnp.uint8), jax.ShapeDtypeStruct((4,), jnp.float32)
    ).as_text()
    assert text.count("xla.gpu.triton") == 1 and "sign_unpack" in text


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"values": np.ones(4, np.float64)}, TypeError, "values"),
        ({"values": np.ones(4, np.int32)}, TypeError, "values"),
        ({"values": np.ones((3, 0), np.float32)}, ValueError, "values"),
        ({"values": np.float32(1.0)}, ValueError, "values"),
        ({"impl": "triton"}, ValueError, "impl"),
    ],
)
def test_pack_rejects_bad_input(kwargs, error, name):
    args = {"values": np.ones(4, np.float32)}
    args.update(kwargs)
    with pytest.raises(error, match=name):
        sign_pack(**args)


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"bits": np.zeros(2, np.int8)}, TypeError, "bits"),
        ({"bits": np.zeros(0, np.uint8)}, ValueError, "bits"),
        ({"scale": np.ones(2, np.float32)}, ValueError, "scale"),
        ({"scale": 1}, TypeError, "scale"),
        ({"size": 8}, ValueError, "size"),
        ({"size": 17}, ValueError, "size"),
        ({"size": 12.0}, TypeError, "size"),
        ({"impl": "cuda"}, ValueError, "impl"),
    ],
)
def test_unpack_rejects_bad_input(kwargs, error, name):
    args = {"bits": np.zeros(2, np.uint8), "scale": np.float32(1.0), "size": 12}
    args.update(kwargs)
    with pytest.raises(error, match=name):
        sign_unpack(**args)
