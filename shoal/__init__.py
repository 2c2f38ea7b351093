"""shoal: communication-efficient distributed training algorithms as Optax transformations.

The subpackages live in top-level folders of the repository, linked into this folder
(``shoal/optim -> ../optim``, ...), and import as
``shoal.comms`` (collectives, wire accounting), ``shoal.optim`` (the algorithms),
``shoal.kernels`` (compression kernels), ``shoal.costmodel`` (the cost model of the
collectives) and ``shoal.experiments`` (the runner).

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
