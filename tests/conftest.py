import atexit
import os
import shutil
import sys
import tempfile

# Tests import their helpers (harness.py) as plain modules.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One persistent compilation cache per test session, inherited by the processes the tests
# start: the runner, checkpoint and fault tests compile the same programs again and again
# (a whole run and its resumed halves, every mpiexec job of one config). A fresh folder,
# so no entry outlives the session.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="shoal-jax-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"

# Tests compile for speed of compilation (tests/xla_flags.py says which flags and why).
# Inherited by the processes the tests start unless they set their own XLA_FLAGS (those
# that emulate a user's fresh process do). `make run`, the benchmarks and users keep XLA's
# default.
from xla_flags import flags as _test_xla_flags  # noqa: E402

TEST_XLA_FLAGS = _test_xla_flags()
for _flag in TEST_XLA_FLAGS:
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()

# Strict dtype promotion for the whole session: a mix of dtypes (bfloat16 + float32, a
# Python float times an int32 counter) must be cast explicitly, so an accidental widening
# (a bfloat16 model silently updated in float32) fails here. Third-party code that is not
# strict-clean runs relaxed only where a test calls it (`shoal.dtypes.standard_promotion`
# around optax's Adam family: `harness.adam`, `harness.adamw`). The notebooks run in their
# own kernels, under standard promotion.
import jax  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
