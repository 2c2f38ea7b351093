"""Closed-loop adaptation of the synchronisation, the step KungFu's thesis left manual.

A `Policy` maps the monitored metrics of the steps so far (the runner's per-step records:
``loss``, ``bytes_sent``, ``noise_scale``, ...) to new values of config fields, e.g. a
partial-exchange fraction. The runner asks it every ``cfg.policy_every`` steps; when it
answers with a change, the runner rebuilds the algorithm with the new fields, keeps the
parameters and every part of the optimizer state whose structure did not change (e.g. the
local optimizer's momentum), and logs the change in that step's record (``"policy"``).

An algorithm names its policy at registration (``register(..., policy="noise_scale")``);
write a new one as ``POLICIES["name"] = Policy(decide)``.

Reference: Brabete, "KungFu: a novel distributed training system for TensorFlow using
flexible synchronisation", MEng thesis, Imperial College London, 2019, section 4.4 (a
manual schedule from fraction 1 to 0.1, and the noise scale proposed as its trigger).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from shoal.experiments.config import Config

Decision = dict[str, Any] | None


@dataclasses.dataclass(frozen=True)
class Policy:
    """``decide(records, cfg)``: the changes to make to ``cfg`` now, or None. ``records``
    are this run's per-step records so far (on the root; the runner sends the answer to
    every worker), ``cfg`` the config the algorithm currently runs with."""

    decide: Callable[[Sequence[dict[str, Any]], Config], Decision]


def noise_scale_switch(records: Sequence[dict[str, Any]], cfg: Config) -> Decision:
    """Exchange every gradient while the gradient noise scale is below
    ``cfg.noise_threshold``, then only ``cfg.adaptive_fraction`` of them (partial exchange).

    The thesis's reasoning: the gradients shrink as training converges, so the noise scale
    grows, training is stable, and partial exchange costs little accuracy from then on. The
    median of the last ``policy_every`` steps' estimates decides, so one noisy estimate
    does not; the switch happens once.
    """
    if cfg.adaptive_sync != "full":
        return None
    recent = [r["noise_scale"] for r in records[-cfg.policy_every :] if "noise_scale" in r]
    if recent and np.median(recent) > cfg.noise_threshold:
        return {"adaptive_sync": "partial"}
    return None


POLICIES: dict[str, Policy] = {"noise_scale": Policy(noise_scale_switch)}


def describe(changes: dict[str, Any]) -> str:
    """``{"a": 1, "b": "x"}`` -> ``"a=1;b=x"`` (the metrics' ``policy`` field)."""
    return ";".join(f"{k}={v}" for k, v in changes.items())
