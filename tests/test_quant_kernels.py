"""quantize/dequantize (int8 / fp8 e4m3 / fp4 e2m1, absmax block scales): the Pallas
kernels, interpreted on CPU, against the jnp reference bit for bit (codes, scales and
decoded values, non-finite inputs included), plus the CUDA lowering."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from gpu_target import lower_for_cuda, on_gpu

from shoal.kernels.quant import dequantize, quantize
from shoal.kernels.quant_pallas import MAX_BLOCK, dequantize_pallas, quantize_pallas

FORMATS = ("int8", "fp8", "fp4")
TOP = {"int8": 127.0, "fp8": 448.0, "fp4": 6.0}
BITS = {"int8": 8, "fp8": 8, "fp4": 4}
# Power-of-two and other block lengths (the kernels mask the lanes past the block).
CASES = [
    ("int8", 1),
    ("int8", 3),
    ("int8", 32),
    ("int8", 48),
    ("fp8", 2),
    ("fp8", 32),
    ("fp8", 100),
    ("fp4", 2),
    ("fp4", 6),
    ("fp4", 32),
    ("fp4", 64),
]


def f32bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


def ties(fmt):
    """Values of a block whose scale is exactly 1 that sit on the format's rounding
    midpoints, on its grid, and around the fp8 subnormal range."""
    if fmt == "int8":
        grid = np.arange(-127, 128, dtype=np.float32)
    elif fmt == "fp8":
        grid = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
        grid = np.sort(grid[np.isfinite(grid) & (np.abs(grid) <= 448)])
    else:
        half = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
        grid = np.concatenate([-half[::-1], half])
    mids = (grid[:-1] + grid[1:]) / 2  # exact in float32
    return np.concatenate([mids, grid, np.nextafter(mids, np.float32(np.inf))])


def sample(fmt, block, lead=2, blocks=6, seed=0):
    """float32[lead, blocks * block]: wide-range random blocks, one all-zero block, one
    of signed zeros and a tiny value, and (block >= 2) blocks of rounding ties."""
    rng = np.random.default_rng(seed + block)
    v = rng.standard_normal((lead, blocks * block)) * np.exp(3 * rng.standard_normal())
    v = (v * np.exp(3 * rng.standard_normal((lead, blocks * block)))).astype(np.float32)
    v[0, :block] = 0.0
    v[1, :block] = -0.0
    v[1, block - 1] = 1e-30
    if block >= 2:
        special = ties(fmt)
        per = block - 1
        rows = -(-special.size // per)
        special = np.resize(special, rows * per).reshape(rows, per)
        special = np.concatenate([np.full((rows, 1), TOP[fmt], np.float32), special], 1)
        extra = special.reshape(-1)
        pad = -extra.size % (lead * block)
        extra = np.concatenate([extra, np.zeros(pad, np.float32)]).reshape(lead, -1)
        v = np.concatenate([v, extra], axis=1)
    return v


def assert_same(pallas_out, reference_out, *, nan_payloads=True):
    """Equal dtypes, shapes and bits. With ``nan_payloads=False`` a NaN only has to meet a
    NaN: where a NaN code meets a NaN scale, IEEE 754 leaves open which operand's sign and
    payload the product keeps, and XLA:CPU orders the operands of its own multiply."""
    for got, want in zip(pallas_out, reference_out, strict=True):
        got, want = np.asarray(got), np.asarray(want)
        assert got.dtype == want.dtype and got.shape == want.shape
        if got.dtype != np.float32:
            np.testing.assert_array_equal(got, want)
            continue
        if not nan_payloads:
            np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
            got, want = np.where(np.isnan(got), 0, got), np.where(np.isnan(want), 0, want)
        np.testing.assert_array_equal(f32bits(got), f32bits(want))


@pytest.mark.parametrize(("fmt", "block"), CASES)
def test_pallas_is_bit_exact(fmt, block):
    v = sample(fmt, block)
    ref = quantize(v, fmt, block, impl="reference")
    pal = quantize(v, fmt, block, impl="pallas")
    assert_same(pal, ref)
    codes, scales = ref
    assert codes.shape == (2, v.shape[1] * BITS[fmt] // 8)
    assert scales.shape == (2, v.shape[1] // block)
    assert float(scales[0, 0]) == 0.0 and not np.asarray(codes[0, : block * BITS[fmt] // 8]).any()
    assert_same(
        [dequantize(codes, scales, fmt, block, impl="pallas")],
        [dequantize(codes, scales, fmt, block, impl="reference")],
    )


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_every_code(fmt):
    """Every byte (fp8 NaN codes included) times scales that are 0, +-Inf, NaN, tiny."""
    block = 8
    rng = np.random.default_rng(1)
    codes = np.resize(np.arange(256, dtype=np.uint8), (2, 36 * block * BITS[fmt] // 8))
    codes[1] = rng.permutation(codes[1])
    scales = rng.standard_normal((2, 36)).astype(np.float32)
    scales[0, :6] = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40]
    ref = dequantize(codes, scales, fmt, block, impl="reference")
    pal = dequantize(codes, scales, fmt, block, impl="pallas")
    assert_same([pal], [ref])


@pytest.mark.parametrize("fmt", FORMATS)
def test_nonfinite_inputs_match_reference(fmt):
    nan, inf = np.float32(np.nan), np.float32(np.inf)
    negative_nan, payload_nan = np.array([0xFFC00000, 0x7FC00123], np.uint32).view(np.float32)
    v = np.array(
        [
            [1.0, nan, 2.0, 3.0],
            [1.0, inf, -2.0, 3.0],
            [inf, -inf, 0.0, 1.0],
            [negative_nan, 0.0, -5.0, 0.0],
            [nan, inf, 1.0, -2.0],
            [0.0, -0.0, 0.0, 0.0],
            [payload_nan, 2.0, 0.0, -1.0],
        ],
        np.float32,
    ).reshape(1, -1)
    ref = quantize(v, fmt, 4, impl="reference")
    pal = quantize(v, fmt, 4, impl="pallas")
    assert_same(pal, ref)
    scales = np.asarray(ref[1])[0]
    assert np.isnan(scales[[0, 3, 4, 6]]).all() and np.isinf(scales[[1, 2]]).all()
    assert scales[5] == 0.0
    out = [dequantize(*ref, fmt, 4, impl=impl) for impl in ("pallas", "reference")]
    # fp8 only: the code of -NaN (0xff) decodes to -NaN, which then meets the NaN scale.
    assert_same(out[:1], out[1:], nan_payloads=fmt != "fp8")
    out = np.asarray(out[0]).reshape(7, 4)
    # A non-finite scale makes every value of its block NaN (codes times NaN, 0 * Inf).
    assert np.isnan(out[[0, 1, 2, 3, 4, 6]]).all() and (out[5] == 0).all()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_a_nan_makes_its_block_scale_nan_at_any_shape(fmt, impl):
    """float32[2, 37 * 128] in blocks of 128: XLA:CPU's float max reduction drops every
    NaN at this shape (jax 0.10), which gave the reference a finite scale where the
    Pallas kernel, on the GPU and interpreted, gives NaN (found by the GPU check's size
    sweep, benchmarks/gpu/kernels.py). Each NaN here, one per block at every position
    class, must make its block's scale NaN, and its payload is the block's largest."""
    rng = np.random.default_rng(7)
    v = rng.standard_normal((2, 37 * 128)).astype(np.float32)
    blocks = v.reshape(2, 37, 128)
    for b in range(0, 37, 3):
        blocks[b % 2, b, (b * 11) % 128] = np.nan
    codes, scales = quantize(v, fmt, 128, impl=impl)
    want = np.isnan(blocks).any(axis=-1)
    np.testing.assert_array_equal(np.isnan(np.asarray(scales)), want)
    finite = np.abs(blocks).max(axis=-1) * np.float32(1 / TOP[fmt])
    np.testing.assert_array_equal(np.asarray(scales)[~want], finite[~want])
    assert_same(quantize(v, fmt, 128, impl="pallas"), quantize(v, fmt, 128, impl="reference"))


@pytest.mark.parametrize(("fmt", "block"), [("int8", 16), ("fp4", 16)])
def test_leading_dimensions_and_vmap(fmt, block):
    v = sample(fmt, block, lead=6, blocks=2).reshape(2, 3, -1)
    ref = quantize(v, fmt, block, impl="reference")
    assert_same(quantize(v, fmt, block, impl="pallas"), ref)
    pack = jax.jit(
        jax.vmap(jax.vmap(functools.partial(quantize, fmt=fmt, block=block, impl="pallas")))
    )
    assert_same(pack(v), ref)
    unpack = jax.jit(
        jax.vmap(lambda c, s: dequantize(c, s, fmt, block, impl="pallas"), in_axes=(0, None))
    )
    got = unpack(ref[0][:, 0], ref[1][0, 0])
    want = dequantize(ref[0][:, 0], jnp.broadcast_to(ref[1][0, 0], ref[1][:, 0].shape), fmt, block)
    assert_same([got], [want])


def _has_pallas(fn, *args):
    return "pallas_call" in str(jax.make_jaxpr(fn)(*args))


def test_dispatch():
    v = np.ones((2, 8), np.float32)
    assert _has_pallas(lambda x: quantize(x, "fp8", 4), v) == on_gpu()
    assert _has_pallas(lambda x: quantize(x, "fp8", 4, impl="pallas"), v)
    codes, scales = quantize(v, "fp8", 4)
    assert _has_pallas(lambda c, s: dequantize(c, s, "fp8", 4), codes, scales) == on_gpu()
    assert _has_pallas(lambda c, s: dequantize(c, s, "fp8", 4, impl="pallas"), codes, scales)
    # Blocks longer than MAX_BLOCK stay on the reference whatever impl says.
    big = 2 * MAX_BLOCK
    w = np.linspace(-3, 5, big, dtype=np.float32)[None]
    assert not _has_pallas(lambda x: quantize(x, "fp4", big, impl="pallas"), w)
    out = quantize(w, "fp4", big, impl="pallas")
    assert_same(out, quantize(w, "fp4", big, impl="reference"))
    assert not _has_pallas(lambda c, s: dequantize(c, s, "fp4", big, impl="pallas"), *out)


@pytest.mark.parametrize("fmt", FORMATS)
def test_empty_buffers(fmt):
    v = np.zeros((2, 0), np.float32)
    codes, scales = quantize(v, fmt, 4, impl="pallas")
    assert codes.shape == (2, 0) and codes.dtype == jnp.uint8 and scales.shape == (2, 0)
    assert dequantize(codes, scales, fmt, 4, impl="pallas").shape == (2, 0)


@pytest.mark.parametrize(("fmt", "block"), [("int8", 48), ("fp8", 32), ("fp4", 6), ("fp4", 64)])
def test_pallas_lowers_for_gpu(fmt, block):
    """The Triton kernels lower (Pallas -> Triton IR) for CUDA without a GPU."""
    n = 10 * block
    text = lower_for_cuda(
        functools.partial(quantize_pallas, fmt=fmt, block=block),
        jax.ShapeDtypeStruct((3, n), jnp.float32),
    ).as_text()
    assert text.count("xla.gpu.triton") == 1 and f"quantize_{fmt}" in text
    assert "div.rn.f32" in text  # the IEEE division, not Triton's approximate one
    text = lower_for_cuda(
        functools.partial(dequantize_pallas, fmt=fmt, block=block),
        jax.ShapeDtypeStruct((3, n * BITS[fmt] // 8), jnp.uint8),
        jax.ShapeDtypeStruct((3, 10), jnp.float32),
    ).as_text()
    assert text.count("xla.gpu.triton") == 1 and f"dequantize_{fmt}" in text


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"fmt": "fp4", "block": 3}, ValueError, "even"),
        ({"block": 0}, ValueError, "block"),
        ({"block": 2.0}, ValueError, "block"),
        ({"block": True}, ValueError, "block"),
        ({"block": 3}, ValueError, "multiple"),
        ({"fmt": "fp16"}, ValueError, "fmt"),
        ({"values": np.ones(8, np.float64)}, TypeError, "values"),
        ({"values": np.ones(8, np.int32)}, TypeError, "values"),
        ({"values": np.float32(1.0)}, ValueError, "values"),
        ({"impl": "triton"}, ValueError, "impl"),
    ],
)
def test_quantize_rejects_bad_input(kwargs, error, match):
    args = {"values": np.ones(8, np.float32), "fmt": "int8", "block": 4, "impl": "pallas"}
    args.update(kwargs)
    with pytest.raises(error, match=match):
        quantize(**args)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"fmt": "fp4", "block": 5}, ValueError, "even"),
        ({"block": -4}, ValueError, "block"),
        ({"fmt": "e5m2"}, ValueError, "fmt"),
        ({"codes": np.zeros(4, np.int8)}, TypeError, "codes"),
        ({"codes": np.zeros(6, np.uint8)}, ValueError, "codes"),
        ({"fmt": "fp4"}, ValueError, "codes"),  # fp4 needs 4 bytes for 8 values
        ({"scales": np.ones(2, np.float64)}, TypeError, "scales"),
        ({"scales": np.float32(1.0)}, ValueError, "scales"),
        ({"impl": "cuda"}, ValueError, "impl"),
    ],
)
def test_dequantize_rejects_bad_input(kwargs, error, match):
    args = {
        "codes": np.zeros(8, np.uint8),
        "scales": np.ones(2, np.float32),
        "fmt": "int8",
        "block": 4,
        "impl": "pallas",
    }
    args.update(kwargs)
    with pytest.raises(error, match=match):
        dequantize(**args)
