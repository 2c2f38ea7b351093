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

# Tests compile for speed of compilation, most of this suite's time: LLVM at -O0 (XLA's HLO
# passes still run; XLA:CPU uses no fast-math, so the float semantics are the same) and
# XLA:CPU's older loop emitters instead of its MLIR fusion emitters (half the compile time
# of a training step). Inherited by the processes the tests start unless they set their own
# XLA_FLAGS (those that emulate a user's fresh process do). `make run`, the benchmarks and
# users keep XLA's default.
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
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
import pytest  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")

# Test files that still run under standard promotion, each for a failure outside the
# library; remove a file from the list once its cause is fixed:
# - test_checkpoint.py, test_own_task.py: the runner's "diloco" (experiments/builders.py)
#   and "ssgd_adamw" build optax.adamw, whose bias correction is not strict-clean
#   (optax/tree_utils/_tree_math.py: ``decay ** count``); wrap it in
#   shoal.dtypes.standard_promotion there.
# - test_herring_table3.py: experiments/tasks/bert.py's float16 LayerNorm, through flax's
#   _compute_stats (``jnp.promote_types(float16, float32)``, refused under strict).
STANDARD_PROMOTION_FILES = frozenset(
    {"test_checkpoint.py", "test_own_task.py", "test_herring_table3.py"}
)


# Module-scoped, so that the module fixtures (the runs a file's tests share) are covered.
@pytest.fixture(autouse=True, scope="module")
def _dtype_promotion(request):
    if request.path.name in STANDARD_PROMOTION_FILES:
        with jax.numpy_dtype_promotion("standard"):
            yield
    else:
        yield
