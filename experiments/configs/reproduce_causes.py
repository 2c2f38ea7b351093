"""Why DiLoCo misses its data-parallel claim in ``reproduce``: the inner batch tested.

In ``reproduce`` each of DiLoCo's 8 workers steps on 4 windows of 32 bytes, an eighth of
data parallel's global batch, and 400 steps leave 8 rounds at H = 50; the paper's inner
batches are large enough that an inner step is nearly a synchronous one. This study
keeps the steps, rounds and everything else of that claim and gives every worker 4x the
batch (16 windows; so 4x the tokens, for DiLoCo and data parallel alike): if the inner
batch is the cause, DiLoCo's gap to data parallel shrinks.

Run it with ``shoal-run reproduce_causes`` (about 20 minutes on 2 CPU cores); each arm's
inner rate and DiLoCo's outer momentum are tuned on the validation files as in
``reproduce``, over a smaller grid.
"""

import dataclasses

from shoal.experiments.configs.reproduce import H, M
from shoal.experiments.configs.reproduce import get_config as reproduce_config
from shoal.experiments.runner.claims import Arm, Claim, Reproduction

BATCH = 16  # windows per worker and step: 4x reproduce's


def get_config() -> Reproduction:
    base = reproduce_config()
    config = dataclasses.replace(base.config, name="reproduce_causes", batch_size=BATCH)
    claim = Claim(
        f"DiLoCo, M = {M}, H = {H}, inner batch x4", "arXiv 2311.08105",
        f"{M} workers synchronising every {H} steps come within a few percent of data "
        f"parallel with an M-times larger batch, each worker's batch {BATCH} windows.",
        Arm(f"DiLoCo, M = {M}, H = {H}, batch {BATCH}", f"diloco[sync_every={H}]", M),
        Arm(f"AdamW DP, M = {M}, batch {BATCH}", "ssgd_adamw", M),
        within=0.03, fewer_bytes=0.9 * H,
    )  # fmt: skip
    return Reproduction(
        config=config,
        claims=[claim],
        tokens=M * BATCH * config.seq_len * 400,  # reproduce's 400 steps at M = 8
        seeds=(0, 1, 2),
        sweep=("x1", "x2"),
        tune_also=base.tune_also,
        sweep_fraction=base.sweep_fraction,
        description=__doc__.split("\n\n")[0],
    )
