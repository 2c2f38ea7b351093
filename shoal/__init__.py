"""shoal: communication-efficient distributed training algorithms as Optax transformations.

The subpackages live in top-level folders of the repository and install as
``shoal.comms`` (collectives, wire accounting), ``shoal.optim`` (the algorithms),
``shoal.kernels`` (compression kernels) and ``shoal.experiments`` (the runner).

Example:
    >>> import shoal
    >>> shoal.__version__
    '0.1.0'
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("shoal")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "unknown"

# Run from the repository root, this folder shadows the installed `shoal`: extending the
# package path lets `shoal.optim` and the rest resolve to the installed subpackages.
__path__ = __import__("pkgutil").extend_path(__path__, __name__)
