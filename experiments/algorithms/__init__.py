"""The algorithms a config can name, one module each, and their registry.

Each module of this package (but the private ones) holds one runnable algorithm: its
hyper-parameters as a typed `Hyper` dataclass, its checks and its builder, registered
with `register`. Importing the package imports them all, so adding an algorithm is adding
one module. `parts` holds the pieces their hyper-parameters share (optimizers, exchange
codec, BMUF's block step); `renamed` maps the old flat field names to their new homes.

Example:
  >>> from shoal.experiments.algorithms import ALGORITHMS, resolve
  >>> from shoal.experiments.config import Config
  >>> entry = resolve("diloco[sync_every=20]", Config(algorithms=("diloco",), steps=40))
  >>> entry.params.sync_every, entry.params.outer.learning_rate
  (20, 0.7)
"""

import importlib
import pkgutil

from shoal.experiments.algorithms._registry import (
    ALGORITHMS,
    FAMILIES,
    Algorithm,
    Builder,
    Comms,
    Context,
    Entry,
    Hyper,
    algorithm,
    check_params,
    is_reference,
    params_of,
    parse_entry,
    register,
    resolve,
    resolve_all,
)

__all__ = [
    "ALGORITHMS",
    "FAMILIES",
    "Algorithm",
    "Builder",
    "Comms",
    "Context",
    "Entry",
    "Hyper",
    "algorithm",
    "check_params",
    "is_reference",
    "params_of",
    "parse_entry",
    "register",
    "resolve",
    "resolve_all",
]

# Every algorithm module registers itself when imported; `parts` and `renamed` are not
# algorithms.
for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_") and _module.name not in ("parts", "renamed"):
        importlib.import_module(f"{__name__}.{_module.name}")
