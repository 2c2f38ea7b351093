"""Does it reproduce? The field's headline claims, each measured on the byte-level
transformer of ``task="text"`` (the standard library's whole source, split by file), at
equal tokens, over 3 seeds, every arm's learning rate tuned on the validation files
first (`shoal.experiments.runner.claims`).

Run it with ``make reproduce`` (``shoal-run reproduce``). The claims, as their papers
state them:

1. DiLoCo scaling laws (arXiv 2503.09799): DiLoCo with one replica (M = 1: the outer
   Nesterov step on the H-step pseudo-gradient) reaches a lower loss than AdamW data
   parallel at equal tokens.
2. DiLoCo (arXiv 2311.08105): M = 4 and 8 workers, H in {10, 50, 100}, within a few
   percent (3%) of data parallel with an M-times larger batch at equal tokens, with about
   H times fewer bytes.
3. Streaming DiLoCo (arXiv 2501.18512): DiLoCo's loss (within 1%) with about F times
   lower peak bytes per step; an fp4 exchange loses nothing (within 1%).
4. SparseLoCo (arXiv 2508.15706): at 1-3% density with 2-bit values, no worse than
   DiLoCo at 30x fewer bytes or more.
5. MuLoCo (arXiv 2505.23725): no worse than DiLoCo at the same H.
6. PowerSGD (Vogels et al., NeurIPS 2019): rank 4 within 1% of momentum S-SGD.
7. 1-bit Adam (Tang et al., ICML 2021) and 1-bit LAMB (Li et al., HiPC 2022): within 1%
   of Adam / LAMB after the warm-up, with 4x less volume or more.
8. DeMo (arXiv 2411.19870): no worse than AdamW data parallel.

"No worse" is read as within 1%. Each arm's main learning rate is tuned (x0.5, x1, x2),
then the DiLoCo family's outer momentum (0.3, 0.6, 0.9), on half the run and the
validation files; DiLoCo at H = 10 and 100 takes the values tuned at H = 50, and fp4
Streaming DiLoCo those of float32. The size (0.22M parameters, 409,600 tokens per arm,
120 runs in all) is what lets the study finish in about 80 minutes on 2 CPU cores: most of
a run's 40 s is tracing and compiling, so the programs stay vmapped (``in_turn`` would
compile two more). ``shoal-run reproduce --resume`` continues a stopped study.
"""

from shoal.experiments.config import Config
from shoal.experiments.runner.claims import Arm, Claim, Reproduction

# The transformer and its data; every arm trains TOKENS tokens.
MODEL = dict(lm_width=64, lm_layers=4, lm_heads=4, seq_len=32)  # 0.22M parameters
BATCH = 4  # windows per worker and step
TOKENS = 8 * BATCH * 32 * 400  # 400 steps at 8 workers, 800 at 4, 3200 at 1
M = 8  # workers of the claims that do not vary it
H = 50  # the DiLoCo family's round, where a claim does not vary it
ADAMW = {"learning_rate": 3e-3, "schedule": {"kind": "cosine", "warmup_steps": 20},
         "clip": 1.0}  # fmt: skip
INNER = {"inner": {"adamw": ADAMW}}
# The LAMB family's own schedule fields, set to AdamW's: a 20-step warm-up (of 400), a
# cosine decay to 0 and the clip. Their defaults (a constant rate, no clip) would
# compare 1-bit Adam with a better-scheduled Adam.
LAMB_SCHEDULE = {"lr_warmup": 20 / 400, "lr_decay": "cosine", "clip": 1.0}
# The rates each grid (x0.5, x1, x2) is centred on, where a default would put it off the
# mark (docs/results/causes.md). 1-bit Adam has no bias correction: frozen early its steps
# are about 4x its rate's, so it gets AdamW's grid (0.0015-0.006), not 0.01-0.04 around its
# default. DeMo, LAMB and 1-bit LAMB chose their first grid's top: it moves up one step.
ONEBIT_ADAM = {**LAMB_SCHEDULE, "learning_rate": ADAMW["learning_rate"]}
LAMBS = {**LAMB_SCHEDULE, "learning_rate": 0.04}
DEMO = {"learning_rate": 0.004, "schedule": ADAMW["schedule"], "clip": 1.0}


def dp(workers: int) -> Arm:
    return Arm(f"AdamW DP, M = {workers}", "ssgd_adamw", workers)


def diloco(workers: int, h: int) -> Arm:
    # Every H of one M takes the rates tuned at H = 50: a third of the tuning runs.
    tuned_as = "" if h == H else f"DiLoCo, M = {workers}, H = {H}"
    return Arm(f"DiLoCo, M = {workers}, H = {h}", f"diloco[sync_every={h}]", workers, tuned_as)


def claims() -> list[Claim]:
    out = [
        Claim("DiLoCo, M = 1", "arXiv 2503.09799",
              "DiLoCo with a single replica reaches a lower loss than AdamW data parallel "
              "at equal tokens.", diloco(1, H), dp(1)),
    ]  # fmt: skip
    for workers in (4, 8):
        for h in (50, 10, 100):  # H = 50 first: the others are tuned as it
            out.append(Claim(
                f"DiLoCo, M = {workers}, H = {h}", "arXiv 2311.08105",
                f"{workers} workers synchronising every {h} steps come within a few percent "
                f"of data parallel with an M-times ({workers}x) larger batch, with about {h}x "
                "fewer bytes.",
                diloco(workers, h), dp(workers), within=0.03, fewer_bytes=0.9 * h,
            ))  # fmt: skip
    streaming = Arm("Streaming DiLoCo, F = 4", f"streaming_diloco[sync_every={H};fragments=4]", M)
    fp4 = Arm("Streaming DiLoCo, F = 4, fp4",
              f"streaming_diloco[sync_every={H};fragments=4;exchange.codec=fp4]", M,
              tuned_as=streaming.label)  # fmt: skip
    sparse = Arm("SparseLoCo", f"sparseloco[sync_every={H}]", M)
    adam, lamb = dp(M), Arm("LAMB DP", "lamb", M)
    out += [
        Claim("Streaming DiLoCo", "arXiv 2501.18512",
              "Streaming DiLoCo with F fragments matches DiLoCo with about F times lower "
              "peak bandwidth.", streaming, diloco(M, H), within=0.01, fewer_bytes=3.5,
              peak=True),
        Claim("Streaming DiLoCo, fp4", "arXiv 2501.18512",
              "Exchanging the outer gradients in 4 bits loses nothing.", fp4, streaming,
              within=0.01),
        Claim("SparseLoCo", "arXiv 2508.15706",
              "Top-k at 1-3% density with 2-bit values is no worse than DiLoCo at 30x fewer "
              "bytes or more.", sparse, diloco(M, H), within=0.01, fewer_bytes=30),
        Claim("MuLoCo", "arXiv 2505.23725",
              "DiLoCo with Muon inside is no worse than DiLoCo with AdamW at the same H.",
              Arm("MuLoCo", f"muloco[sync_every={H}]", M), diloco(M, H), within=0.01),
        Claim("PowerSGD", "NeurIPS 2019",
              "Rank-4 PowerSGD is within 1% of momentum S-SGD.",
              Arm("PowerSGD, rank 4", "powersgd[rank=4]", M), Arm("momentum S-SGD", "ssgd", M),
              within=0.01),
        Claim("1-bit Adam", "ICML 2021",
              "1-bit Adam is within 1% of Adam after the warm-up, with up to 5x less volume.",
              Arm("1-bit Adam", "onebit_adam", M), adam, within=0.01, fewer_bytes=4),
        Claim("1-bit LAMB", "HiPC 2022",
              "1-bit LAMB is within 1% of LAMB after the warm-up, with 4.6x less volume.",
              Arm("1-bit LAMB", "onebit_lamb", M), lamb, within=0.01, fewer_bytes=4),
        Claim("DeMo", "arXiv 2411.19870",
              "DeMo is no worse than AdamW data parallel.", Arm("DeMo", "demo", M), adam,
              within=0.01),
    ]  # fmt: skip
    return out


def get_config() -> Reproduction:
    return Reproduction(
        config=Config(
            name="reproduce",
            task="text",
            text_corpus="stdlib_tree",
            workers=M,
            batch_size=BATCH,
            test_size=256,
            validation_size=256,
            project_workers=0,
            scan_steps=10,
            algorithms=("ssgd_adamw",),
            **MODEL,
            params={
                "ssgd_adamw": {"adamw": ADAMW},
                "diloco": INNER,
                "streaming_diloco": INNER,
                "sparseloco": INNER,
                "muloco": {"inner": {"schedule": ADAMW["schedule"], "clip": 1.0}},
                "lamb": LAMBS,
                "onebit_adam": ONEBIT_ADAM,
                "onebit_lamb": LAMBS,
                "demo": DEMO,
            },
        ),  # fmt: skip
        claims=claims(),
        tokens=TOKENS,
        # DiLoCo's outer momentum, tuned after the inner rate: at a few dozen rounds the
        # paper's 0.9 costs DiLoCo with one replica 29% more loss
        # (docs/results/causes.md).
        tune_also=(("outer.momentum", ("0.3", "0.6", "0.9")),),
        description=__doc__.split("\n\n")[0],
    )
