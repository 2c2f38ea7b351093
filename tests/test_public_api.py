"""The public surface: every module of shoal is reachable under its own name (no function
shadows a module, as ``shoal.optim.gtc`` once did), algorithm code is private, and
`shoal.optim` exports the factories, their states and a named namespace of helpers."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import types

import shoal
import shoal.optim as optim
import shoal.optim.helpers as helpers


def _modules() -> list[str]:
    names = []
    # mpi4jax is an optional extra: shoal.comms.mpi imports it lazily, so every module loads.
    for info in pkgutil.walk_packages(shoal.__path__, "shoal."):
        if ".configs." not in info.name:  # config files run code when imported
            names.append(info.name)
    return names


def test_no_module_is_shadowed_by_an_attribute_of_its_package():
    shadowed = []
    for name in _modules():
        module = importlib.import_module(name)
        parent, _, last = name.rpartition(".")
        if getattr(importlib.import_module(parent), last) is not module:
            shadowed.append(name)
    assert not shadowed, f"package attributes hide these modules: {shadowed}"


def test_algorithm_code_is_in_private_modules():
    public = [m.name for m in pkgutil.iter_modules(optim.__path__) if not m.name.startswith("_")]
    assert sorted(public) == ["helpers", "readouts"]
    for name in optim.__all__:
        obj = getattr(optim, name)
        assert not isinstance(obj, types.ModuleType), name
        if inspect.isfunction(obj) or inspect.isclass(obj):
            assert obj.__module__.startswith("shoal.optim._"), (name, obj.__module__)


def test_helpers_are_a_named_namespace_not_the_top_level():
    assert set(helpers.__all__) == {"noise_scale", "peer_permutation", "partial_exchange_bins",
                                    "take_raised", "same_model_check", "check_same_model",
                                    "SameModelCheck", "split_fragments", "hold_uniform",
                                    "uniform_axes", "pairing", "error_feedback_mask",
                                    "rank_uniform_mask", "take_turns"}  # fmt: skip
    assert not set(helpers.__all__) & set(optim.__all__)
    assert helpers.peer_permutation("round_robin", 4, 1) == (2, 3, 0, 1)
