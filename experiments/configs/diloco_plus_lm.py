"""DiLoCo + X on the byte-level LM: the field's 2025-2026 methods side by side with S-SGD
and DiLoCo, 8 simulated workers, the same tokens for every entry.

Run with ``shoal-run diloco_plus_lm --seeds 0,1,2 --sweep learning_rate=x0.3,x1,x3``
(about 30 minutes on 2 CPU cores): each entry's main learning rate is tuned on the
validation split first, then trained over 3 seeds. Task: the 2-block transformer of
`diloco_lm` (width 64, about 120k parameters) on the Python standard library's sources.

Entries (every round-based method with H = 25 inner steps, 16 rounds in 400 steps):

- ``ssgd_adamw``: the gradients all-reduced every step, then AdamW (the reference);
- ``diloco``: inner AdamW, outer Nesterov SGD (0.7, 0.9);
- ``streaming_diloco``: 4 fragments in turn, merged with mix 0.5;
- ``sparseloco``: a 2-bit top-k (1.6% of each chunk of 4096) of a decaying
  error-feedback accumulator, outer SGD at 1;
- ``muloco``: DiLoCo with Muon inside;
- ``overlapped_diloco``: eager and delayed outer steps (the all-reduce hidden behind the
  next round);
- ``desloc``: local Adam, params every 25 steps, moments every 75 and 150;
- ``sparta``: 0.5% of each leaf averaged after every step, alone and with DiLoCo;
- ``noloco``: DiLoCo's rounds averaged with one random peer.

The projection: 64 workers, one per site, over 1 Gbps links (``wan-1gbps``), where the
bytes decide the step time. Every inner AdamW runs the DiLoCo paper's recipe as in
``diloco_lm`` (warm-up, cosine decay to 0, clip 1.0).
"""

from shoal.experiments.config import Config

H = 25
ADAMW = {
    "learning_rate": 3e-3,
    "schedule": {"kind": "cosine", "warmup_steps": 20},
    "clip": 1.0,
}
INNER = {"inner": {"adamw": ADAMW}}
# The task and its workers, shared with `heterogeneous`.
LM = dict(task="lm", workers=8, batch_size=4, seq_len=128, train_size=20000, test_size=512,
          lm_width=64, lm_layers=2, lm_heads=4)  # fmt: skip


def get_config() -> Config:
    return Config(
        name="diloco_plus_lm",
        algorithms=(
            "ssgd_adamw",
            f"diloco[sync_every={H}]",
            f"streaming_diloco[sync_every={H}]",
            f"sparseloco[sync_every={H}]",
            f"muloco[sync_every={H}]",
            f"overlapped_diloco[sync_every={H}]",
            f"overlapped_diloco[sync_every={H};variant=delayed]",
            f"desloc[sync_every={H}]",
            "sparta",
            f"sparta[sync_every={H}]",
            f"noloco[sync_every={H}]",
        ),
        **LM,
        steps=400,
        eval_every=50,
        project_workers=64,
        project_cluster="wan-1gbps",
        params={
            "ssgd_adamw": {"adamw": ADAMW},
            "diloco": INNER,
            "streaming_diloco": INNER,
            "sparseloco": INNER,
            "overlapped_diloco": INNER,
            "sparta": INNER,
            "noloco": INNER,
            "muloco": {"inner": {"schedule": ADAMW["schedule"], "clip": 1.0}},
            "desloc": {
                "learning_rate": 3e-3,
                "schedule": ADAMW["schedule"],
                "clip": 1.0,
            },
        },
    )
