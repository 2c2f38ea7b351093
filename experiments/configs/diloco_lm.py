"""DiLoCo and Streaming DiLoCo against S-SGD with AdamW on the byte-level LM, 8 simulated
workers, the same tokens for every entry (about 5 minutes a seed on 2 CPU cores).

Run with ``shoal-run experiments/configs/diloco_lm.py``. Task (`shoal.experiments.tasks.lm`):
next-byte prediction on the running Python's standard library source (nothing is
downloaded), a 2-block causal transformer of width 64 (about 120k parameters). Entries:

- ``ssgd_adamw``: the gradients all-reduced every step, then AdamW (the baseline);
- ``diloco`` with H = 10, 50 and 100 inner AdamW steps per round and the paper's outer
  Nesterov SGD (learning rate 0.7, momentum 0.9);
- ``streaming_diloco`` with H = 100, 4 byte-balanced fragments syncing in turn (one every
  25 steps), overlap tau = 0 and 2 (mix 0.5), the outer gradient exchanged in float32 or
  in fp4 (`shoal.comms.Quantized`, blocks of 128 with error feedback).

Every AdamW (the baseline's and the inner ones) runs the DiLoCo paper's inner recipe: a
linear warm-up, then cosine decay to 0 at the last step, the gradient clipped at global
norm 1.0 (each worker's own in DiLoCo, the all-reduced one in the baseline).

The papers' claims to test at this scale: DiLoCo within a few percent of S-SGD's loss at
100x or more fewer bytes (Douillard et al. 2023), and Streaming DiLoCo cutting the peak
bytes of one step by about the number of fragments at similar loss (Douillard et al.
2025). The summary's table has the final validation loss, the total MB and the peak kB of
one step per worker; ``loss_vs_mb.png`` plots loss against bytes on a log axis.
"""

from shoal.experiments.config import Config

H = (10, 50, 100)
STREAMING_H = 100
# The DiLoCo paper's inner recipe (Douillard et al. 2023, section 3 and its hyper-parameter
# table): AdamW with a linear warm-up of 1,000 steps, then cosine decay, gradients clipped
# at global norm 1.0. Its warm-up is a small share of a run of tens of thousands of steps;
# the same share of these 400 would be a handful, too short to steady AdamW's early
# moments, so the warm-up here is 5% of the run, 20 steps (all inside the first outer
# round at H = 50 and 100, the first two at H = 10). The peak rate stays this study's 3e-3
# with no weight decay, not the paper's values for its far larger models.
WARMUP = 20
ADAMW = {
    "learning_rate": 3e-3,
    "schedule": {"kind": "cosine", "warmup_steps": WARMUP},
    "clip": 1.0,
}


def get_config() -> Config:
    streaming = [
        f"streaming_diloco[sync_every={STREAMING_H};overlap={tau};exchange.codec={exchange}]"
        for exchange in ("float32", "fp4")
        for tau in (0, 2)
    ]
    return Config(
        name="diloco_lm",
        algorithms=(
            "ssgd_adamw",
            *(f"diloco[sync_every={h}]" for h in H),
            *streaming,
        ),
        task="lm",
        workers=8,
        steps=400,  # a multiple of every H: each run ends on a full outer step
        batch_size=4,  # windows of seq_len bytes per worker and step
        seq_len=128,
        train_size=20000,
        test_size=512,
        eval_every=50,
        lm_width=64,
        lm_layers=2,
        lm_heads=4,
        # ADAMW for the baseline and as DiLoCo's inner optimizer, so that they differ
        # only in how often they synchronise; the rest are the defaults: outer Nesterov
        # SGD at 0.7 and 0.9 (constant), Streaming DiLoCo's 4 fragments and mix 0.5.
        params={
            "ssgd_adamw": {"adamw": ADAMW},
            "diloco": {"inner": {"adamw": ADAMW}},
            "streaming_diloco": {"inner": {"adamw": ADAMW}},
        },
    )
