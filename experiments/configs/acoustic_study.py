"""The shape of Ladkat et al.'s Tables 1-3 at CPU scale: S-SGD, GTC, BMUF and two-tier
BMUF_GTC on the acoustic-modelling stand-in (`shoal.experiments.tasks.acoustic`), every run
2 epochs of the same data, frame error relative to one-worker SGD.

Run with ``shoal-run experiments/configs/acoustic_study.py`` (about 4 minutes on 2 CPU
cores); it writes ``runs/acoustic_study/summary.md``. Settings and learning-rate rule:
``acoustic.py``. The paper's scale is 16-128 GPUs, block sizes 25-200 and 8 GPUs per
group; here it is 8-32 simulated workers, 320 steps at 32 workers, block sizes 5-40
and groups of 4 (the number of groups, 2 to 8, spans the paper's 2 to 16).
"""

import dataclasses

from shoal.experiments.configs.acoustic import entries
from shoal.experiments.configs.acoustic import get_config as acoustic
from shoal.experiments.runner.study import Row, Study, Table

WORKERS = (8, 16, 32)
LARGEST = WORKERS[-1]
BLOCK_SIZE = 10
BLOCK_SIZES = (5, 10, 20, 40)
GROUP_SIZES = (1, 2, 4, 8)

DESCRIPTION = """\
The shape of Ladkat et al.'s Tables 1-3 at CPU scale. Task: frame classification of
sequences from a 64-state sticky HMM with weak 40-dimensional Gaussian emissions, by a
one-layer LSTM (64 units, 31k parameters). Local optimizer: SGD with momentum 0.9 (reset
after every BMUF step); learning rates by the linear scaling rule from 0.02 for one worker
(x N for S-SGD and GTC, x group size for BMUF_GTC, x 1 for BMUF, whose block momentum
1 - 1/M supplies the factor). GTC: tau = 0.05, buffers of 2.5% of the parameters. BMUF:
Nesterov block momentum, block learning rate 1, eq. 5 with C = 1 over the M models
averaged (N for BMUF, N / group size for BMUF_GTC). One seed."""


def get_config() -> Study:
    cfg = dataclasses.replace(acoustic(), name="acoustic_study")
    group_size = cfg.params["bmuf_gtc"].group_size
    table1 = Table(
        "Table 1: number of workers",
        ("method", "workers"),
        [
            Row((method, str(n)), n, entry)
            for method in ("S-SGD", "GTC", "BMUF", "BMUF_GTC")
            for n in WORKERS
            for entry in [entries(n)[method]]
        ],
        note=f"Block size {BLOCK_SIZE} for BMUF and BMUF_GTC; group size {group_size}.",
    )
    table2 = Table(
        f"Table 2: block size ({LARGEST} workers)",
        ("method", "block size"),
        [
            Row((method, str(b)), LARGEST, entries(LARGEST, block_size=b)[method])
            for method in ("BMUF", "BMUF_GTC")
            for b in BLOCK_SIZES
        ],
        note=f"Group size {group_size} for BMUF_GTC.",
    )
    table3 = Table(
        f"Table 3: group size ({LARGEST} workers, block size {BLOCK_SIZE})",
        ("method", "group size"),
        [
            Row(("BMUF_GTC", str(p)), LARGEST, entries(LARGEST, group_size=p)["BMUF_GTC"])
            for p in GROUP_SIZES
        ],
        note="Group size 1 is BMUF (no GTC inside a group of one); compare Table 1.",
    )
    return Study(
        config=cfg,
        tables=(table1, table2, table3),
        epochs=2,
        baseline=Row(("SGD",), 1, "ssgd"),
        evals=4,
        description=DESCRIPTION,
    )
