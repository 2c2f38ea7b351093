import os
import sys

# Tests import their helpers (harness.py) as plain modules.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
