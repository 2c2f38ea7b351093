"""Churn: simulated workers that leave and come back (config ``churn``).

A schedule is terms joined by ``,``; steps count from 1, workers are written as in
`shoal.costmodel.speeds` (``3``, ``0-1``, ``2+5-6``):

* ``leave:W@S``: workers ``W`` are absent from step ``S`` on (until a later ``join``);
* ``leave:W@S-E``: absent for steps ``S`` to ``E``, present again from ``E + 1``;
* ``join:W@S``: present from step ``S`` on: back after a ``leave``, or, for a worker
  with no earlier ``leave``, a late arrival, absent from step 1.

An absent worker computes nothing and sends nothing: its model and optimizer state stay
as they were, its collectives' bytes are 0, and the reductions of the present workers
leave it out (`shoal.comms.presence`). Shared (rank-uniform) state moves on.

A worker that joins at step ``S`` takes, before its step ``S``:

* the global model, `shoal.optim.readouts.evaluation_params` of the lowest worker present
  at ``S - 1`` (DiLoCo's ``theta_g``, S-SGD's common model);
* that worker's optimizer state (inner moments, counters, schedule position), so that it
  steps like the others: its own moments from before it left are stale;
* but not its error feedback: a worker keeps its own (every leaf under a state class's
  ``ERROR_FEEDBACK``) while absent and after it joins, and delivers it in its next
  exchange, so the workers' total error feedback is never dropped or copied. Its byte
  meters stay its own too.

The copy is counted: the joiner receives, and its source sends, the model's and the
copied state's bytes.

Averages are weighted by tokens (``weights``): a worker's weight at step ``t`` is the
number of consecutive steps it has been present up to ``t``, at most ``window``, the
algorithm's steps per round (``sync_every``; 1 for per-step exchanges). At an outer step
of DiLoCo that is the share of the round it trained since it last started from the global
model: a worker that joined mid-round weighs less, one that left weighs 0. Equal rounds
give equal weights, the plain mean.

The asynchronous entries (`shoal.experiments.asynchronous.simulate`'s ``present``) read
row ``k`` as each worker's own ``k``-th inner step: a worker away at a round's start comes
back after the seconds of the steps it missed and pulls the global model; one that leaves
inside a round loses the round.

Example:
  >>> from shoal.experiments.churn import Schedule
  >>> s = Schedule.parse("leave:1@2-3,join:2@3", steps=4, workers=3)
  >>> s.present.astype(int).tolist()
  [[1, 1, 0], [1, 0, 0], [1, 0, 1], [1, 1, 1]]
  >>> s.weights(window=4).tolist()
  [[1.0, 1.0, 0.0], [2.0, 0.0, 0.0], [3.0, 0.0, 1.0], [4.0, 1.0, 2.0]]
"""

from __future__ import annotations

import dataclasses

import numpy as np

from shoal.costmodel.speeds import worker_set

__all__ = ["Schedule", "check_churn"]

_KINDS = ("leave", "join")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Who is present at each step.

    Attributes:
      present: ``[steps, workers]`` bools, row ``t`` for step ``t + 1``.
    """

    present: np.ndarray

    @classmethod
    def parse(cls, spec: str, *, steps: int, workers: int) -> Schedule:
        """The schedule ``spec`` (the module's grammar; ``""``: everyone, always).

        Raises:
          ValueError: a term that does not parse, a step outside ``1..steps``, a worker
            that leaves while absent or joins while present, or a step nobody is present
            at; named with the spec.
        """
        events: dict[int, list[tuple[int, str, str]]] = {}  # worker -> (step, kind, term)
        for term in filter(None, (t.strip() for t in spec.split(","))):
            kind, colon, rest = term.partition(":")
            who, at, when = rest.partition("@")
            if not colon or kind not in _KINDS or not at or not who or not when:
                raise ValueError(
                    f"churn = {spec!r}: term {term!r} must be leave:W@S, leave:W@S-E or "
                    f"join:W@S (W: workers such as 3, 0-1 or 2+5; S, E: steps from 1)"
                )
            start, dash, end = when.partition("-")
            first = _step(start, steps, spec, term)
            for w in worker_set(who, workers, spec, field="churn"):
                events.setdefault(w, []).append((first, kind, term))
                if dash:
                    if kind != "leave":
                        raise ValueError(
                            f"churn = {spec!r}: {term!r}: a range S-E is for leave only"
                        )
                    last = _step(end, steps, spec, term)
                    if last < first:
                        raise ValueError(f"churn = {spec!r}: {term!r}: E must be >= S")
                    if last < steps:
                        events[w].append((last + 1, "join", term))
        present = np.ones((steps, workers), bool)
        for w, todo in events.items():
            todo.sort(key=lambda e: e[0])
            here = todo[0][1] == "leave"  # a first join: a late arrival
            if not here:
                present[:, w] = False
            for step, kind, term in todo:
                if (kind == "leave") != here:
                    state = "absent" if kind == "leave" else "present"
                    raise ValueError(
                        f"churn = {spec!r}: {term!r}: worker {w} is {state} at step {step} already"
                    )
                here = kind == "join"
                present[step - 1 :, w] = here
        empty = np.flatnonzero(~present.any(axis=1))
        if empty.size:
            raise ValueError(f"churn = {spec!r}: no worker is present at step {empty[0] + 1}")
        return cls(present)

    def weights(self, window: int) -> np.ndarray:
        """``[steps, workers]`` float32 token weights (the module's rule): consecutive
        steps present up to each step, at most ``window``; 0 where absent."""
        steps, workers = self.present.shape
        run = np.zeros((steps, workers), np.int64)
        count = np.zeros(workers, np.int64)
        for t in range(steps):
            count = np.where(self.present[t], count + 1, 0)
            run[t] = count
        return np.minimum(run, window).astype(np.float32)

    def joining(self) -> np.ndarray:
        """``[steps, workers]`` bools: present at the step, absent at the one before."""
        before = np.vstack([np.ones((1, self.present.shape[1]), bool), self.present[:-1]])
        return self.present & ~before

    def sources(self) -> np.ndarray:
        """``[steps]`` int32: the lowest worker present at the step before (0 at step 1),
        whose model and state a joiner takes."""
        before = np.vstack([self.present[:1], self.present[:-1]])
        return np.argmax(before, axis=1).astype(np.int32)


def _step(text: str, steps: int, spec: str, term: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= steps:
        raise ValueError(f"churn = {spec!r}: {term!r}: steps must be ints in 1-{steps}")
    return value


def check_churn(spec: str, *, steps: int, workers: int) -> None:
    """Raise ``ValueError`` unless ``spec`` parses for the run's steps and workers."""
    Schedule.parse(spec, steps=steps, workers=workers)
