"""Slow workers: synchronous and asynchronous DiLoCo on the byte-level LM when the workers'
speeds differ, timed on the simulated clock (``speeds``).

Run each condition with its ``speeds`` (about 7 minutes each on 2 CPU cores)::

    shoal-run heterogeneous --seeds 0,1,2 --set speeds=1 --out runs/heterogeneous/a_equal
    shoal-run heterogeneous --seeds 0,1,2 --set speeds=2@0-1 --out runs/heterogeneous/b_quarter_2x
    shoal-run heterogeneous --seeds 0,1,2 --set speeds=pareto:2 --out runs/heterogeneous/c_pareto
    shoal-run heterogeneous --seeds 0,1,2 --set "churn=leave:2@31-70,leave:5@51-90" \
        --out runs/heterogeneous/d_churn

(a) equal speeds; (b) a quarter of the 8 workers (0 and 1) twice as slow; (c) every
worker's every step drawn from 1 + Lomax(2): mean 2, heavy-tailed stragglers; (d) equal
speeds, and 2 of the 8 workers away for 40 steps each (worker 2 from step 31 to 70,
worker 5 from 51 to 90: they leave and come back mid-round; `shoal.experiments.churn`;
an asynchronous worker misses its own inner steps 31 to 70, or 51 to 90). One
step takes 100 ms times its factor (``compute_ms``: the clock is the same on every
machine); the workers sit one per site on 1 Gbps links with 10 ms latency
(``wan-1gbps``).

Entries, every round H = 20 inner AdamW steps (the recipe of `diloco_plus_lm`, whose
rate was tuned there for DiLoCo; not tuned again here), 160 steps' worth of tokens:

- ``ssgd_adamw``: the reference, the gradients all-reduced every step;
- ``diloco``: synchronous rounds, every worker waits for the slowest;
- ``streaming_diloco``: 4 fragments synchronised in turn, one every 5 steps;
- ``async_diloco``: Liu et al.'s method, Delayed Nesterov (every 8 arrivals) and DyLU;
- ``async_diloco[dynamic_steps=false]``: Delayed Nesterov only;
- ``async_diloco[nesterov_period=1;dynamic_steps=false]``: naive async (Nesterov at
  every arrival);
- ``quorum_diloco``: the outer step at 6 of 8 arrivals, or 500 ms after the first.

``target_loss`` 3.2 (nats per byte): the simulated time of the first evaluation at or
below it. Non-finite steps are not skipped (``nonfinite=off``): the skip all-reduces a
flag every step, a barrier that would make every DiLoCo step wait for the slowest worker.
"""

from shoal.experiments.config import Config
from shoal.experiments.configs.diloco_plus_lm import ADAMW, LM

H = 20
INNER = {"inner": {"adamw": ADAMW}, "sync_every": H}


def get_config() -> Config:
    return Config(
        name="heterogeneous",
        algorithms=(
            "ssgd_adamw",
            "diloco",
            "streaming_diloco",
            "async_diloco",
            "async_diloco[dynamic_steps=false]",
            "async_diloco[nesterov_period=1;dynamic_steps=false]",
            "quorum_diloco",
        ),
        **LM,
        steps=160,
        eval_every=20,
        project_cluster="wan-1gbps",
        speeds="1",
        compute_ms=100.0,
        target_loss=3.2,
        nonfinite="off",
        params={
            "ssgd_adamw": {"adamw": ADAMW},
            "diloco": INNER,
            "streaming_diloco": INNER,
            "async_diloco": {**INNER, "nesterov_period": 8},
            "quorum_diloco": {**INNER, "quorum": 6, "grace_ms": 500.0},
        },
    )
