"""`shoal.checks.check_real` and `shoal.optim._validation.check_hyper`: every bound, bools
and non-numbers refused, injected arrays passed through (traced) or checked (concrete)."""

import doctest

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shoal import checks
from shoal.checks import check_real
from shoal.optim._validation import check_hyper


def test_doctests():
    assert doctest.testmod(checks).failed == 0


@pytest.mark.parametrize(
    "args, kwargs, value, ok",
    [
        ((0, 1), dict(open_low=True), 1, True),
        ((0, 1), dict(open_low=True), 0.0, False),
        ((0, 1), dict(open_high=True), 0, True),
        ((0, 1), dict(open_high=True), 1.0, False),
        ((0,), {}, 0.0, True),
        ((0,), dict(open_low=True), 0.0, False),
        ((None, 2), {}, 2, True),
        ((None, 2), dict(open_high=True), np.float32(2), False),
        ((), {}, np.int64(-7), True),
        ((), {}, float("inf"), False),
        ((), {}, float("nan"), False),
        ((), {}, True, False),
        ((), {}, np.bool_(False), False),
        ((), {}, "0.5", False),
        ((), {}, np.ones(()), False),
    ],
)
def test_check_real_bounds(args, kwargs, value, ok):
    if ok:
        assert check_real("x", value, *args, **kwargs) == float(value)
        assert type(check_real("x", value, *args, **kwargs)) is float
    else:
        with pytest.raises(ValueError, match=r"^x must be a "):
            check_real("x", value, *args, **kwargs)


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        ((0, 1), dict(open_low=True), r"x must be a number in \(0, 1\], got -1"),
        ((0, 1), dict(open_high=True), r"x must be a number in \[0, 1\), got -1"),
        ((0,), dict(open_low=True, why=" or a schedule"), "x must be a finite number > 0 or a "),
        ((None, -2), {}, "x must be a finite number <= -2, got -1"),
    ],
)
def test_check_real_names_the_range(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        check_real("x", -1, *args, **kwargs)


def test_check_hyper_passes_traced_and_checks_concrete_arrays():
    seen = []
    jax.jit(lambda v: seen.append(check_hyper("lr", v, 0, open_low=True)) or v)(-1.0)
    assert isinstance(seen[0], jax.core.Tracer)  # nothing is known of it at trace time
    value = jnp.asarray(0.5)
    assert check_hyper("lr", value, 0, open_low=True) is value
    with pytest.raises(ValueError, match="lr must be a finite number > 0, got -1.0"):
        check_hyper("lr", jnp.asarray(-1.0), 0, open_low=True)
    with pytest.raises(ValueError, match="lr must be a finite number > 0, got True"):
        check_hyper("lr", jnp.asarray(True), 0, open_low=True)
