"""In-place branches (`shoal.optim._inplace`) and the one-pass non-finite test."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shoal.optim._inplace import keeps_shape, passthrough_bytes, run_if, switch_inplace
from shoal.optim._nonfinite import any_nonfinite, local_nonfinite


def test_run_if_runs_fn_only_when_pred_holds():
    carry = (jnp.arange(4.0), {"n": jnp.int32(3)})
    fn = lambda c: (c[0] * 2 + 1, {"n": c[1]["n"] + 1})
    for pred, want in ((True, ([1.0, 3.0, 5.0, 7.0], 4)), (False, ([0.0, 1.0, 2.0, 3.0], 3))):
        out = jax.jit(run_if, static_argnums=1)(pred, fn, carry)
        np.testing.assert_array_equal(out[0], want[0])
        assert int(out[1]["n"]) == want[1]


def test_run_if_under_vmap_unbatched_and_batched_predicates():
    xs = jnp.arange(6.0).reshape(3, 2)
    double = lambda x: x * 2
    # Unbatched (the same on every worker): a real branch.
    out = jax.vmap(lambda x: run_if(jnp.bool_(True), double, x))(xs)
    np.testing.assert_array_equal(out, xs * 2)
    # Batched: still each worker's own answer.
    preds = jnp.array([True, False, True])
    out = jax.vmap(lambda p, x: run_if(p, double, x))(preds, xs)
    np.testing.assert_array_equal(out, np.where(np.asarray(preds)[:, None], xs * 2, xs))


def test_run_if_refuses_a_fn_that_changes_the_carry():
    with pytest.raises(ValueError, match="run_if: fn must return a tree like its carry"):
        run_if(True, lambda x: x.astype(jnp.float16), jnp.ones(3))
    with pytest.raises(ValueError, match="run_if"):
        run_if(True, lambda x: x[:2], jnp.ones(3))
    assert keeps_shape(lambda x: x + 1, jnp.ones(3))
    assert not keeps_shape(lambda x: (x, x), jnp.ones(3))


def test_switch_inplace_picks_one_branch_and_clamps():
    fns = [lambda x: x + 1, lambda x: x * 10, lambda x: -x]
    f = jax.jit(lambda i, x: switch_inplace(i, fns, x))
    x = jnp.array([1.0, 2.0])
    for i, want in ((0, [2.0, 3.0]), (1, [10.0, 20.0]), (2, [-1.0, -2.0]), (7, [-1.0, -2.0])):
        np.testing.assert_array_equal(f(i, x), want)
    np.testing.assert_array_equal(f(-3, x), [2.0, 3.0])


def test_passthrough_bytes_counts_inputs_and_loop_outputs():
    carry = (jnp.ones(10), jnp.ones(100))
    # The second leaf is returned as it came: 400 bytes.
    assert passthrough_bytes(lambda c: (c[0] * 2, c[1]), carry) == 400
    # Out of a loop that may have left it alone: counted as well.
    assert passthrough_bytes(lambda c: run_if(c[0][0] > 0, lambda d: d, c), carry) == 440
    assert passthrough_bytes(lambda c: (c[0] + 1, c[1] * 3), carry) == 0


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.complex64])
@pytest.mark.parametrize("shape", [(), (7,), (5, 3), (2, 3, 4)])
def test_any_nonfinite_finds_every_nan_and_inf(dtype, shape):
    f = jax.jit(any_nonfinite)
    x = jnp.ones(shape, dtype)
    assert not f(x)
    # The largest finite values: no false alarm (0 * v is exactly 0, no sum overflows).
    assert not f(jnp.full(shape, jnp.finfo(dtype).max, dtype))
    for v in (np.nan, np.inf, -np.inf):
        for i in range(x.size):
            y = x.reshape(-1).at[i].set(v).reshape(shape)
            assert f(y), (v, i)
            flags = jax.vmap(f)(jnp.stack([x, y]))
            assert not flags[0] and flags[1]


def test_any_nonfinite_complex_parts_and_integers():
    z = jnp.ones((3, 4), jnp.complex64)
    assert any_nonfinite(z.at[1, 2].set(complex(1.0, np.nan)))
    assert any_nonfinite(z.at[0, 0].set(complex(0.0, -np.inf)))
    assert not any_nonfinite(jnp.arange(5))
    tree = {"a": jnp.ones(3), "b": jnp.arange(3), "c": jnp.zeros((0, 2))}
    assert int(local_nonfinite(tree)) == 0
    assert int(local_nonfinite({**tree, "a": jnp.array([1.0, np.inf, 0.0])})) == 1
