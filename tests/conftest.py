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
