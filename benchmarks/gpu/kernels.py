"""Stage 2, the kernels' correctness on the device: every Pallas kernel against its jnp
reference, bit for bit.

Two parts:

1. **The kernel tests** (``tests/test_{sign,gtc,quant}_kernels.py``) under pytest on
   the device. There ``impl="pallas"`` runs the compiled Triton kernels instead of the
   CPU's interpret mode, so every edge case the CPU tests cover is checked on the GPU:
   fp8 subnormals and rounding ties, NaN and +-Inf inputs and scales, every code byte,
   capacity overflow with offsets, empty buffers, leading dimensions and vmap.
2. **A size sweep** at and off the kernels' block multiples up to ``2**24 + 3`` elements
   (which the CPU tests cannot reach in interpret mode): Pallas and reference outputs
   compared bit for bit on random wide-range values with NaN, +-Inf, +-0 and a
   subnormal mixed in; GTC with nothing qualifying (count 0), with capacity overflow
   from an offset, and with every element qualifying at full capacity.

A row per pytest file (passed / failed, the failing tests) and per sweep case (the
number of elements whose bits differ, which must be 0).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import numpy as np

TEST_FILES = (
    "tests/test_sign_kernels.py",
    "tests/test_gtc_kernels.py",
    "tests/test_quant_kernels.py",
)
# In the rehearsal, a few of the tests (the pipeline is what is rehearsed: the files run
# in full in `make test`).
REHEARSE_TESTS = "test_nan_and_inf or test_nonfinite_inputs_match_reference or test_bit_layout"
PYTEST_SHARE = 0.55  # of the stage's time for part 1

COLUMNS = [
    ("check", "check"),
    ("size", "size"),
    ("result", "result"),
    ("detail", "detail"),
    ("seconds", "s"),
]
_STATUS = re.compile(r"^(tests/\S+?)::(\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


def run(record, ctx) -> bool:
    ok = run_tests(record, ctx)  # first: pytest takes the GPU before this process does
    record.set(device=ctx.device_name())
    return Sweep(record, ctx).run() and ok


def summary(rows) -> str:
    bad = [r for r in rows if r.get("result") not in ("ok", "skipped")]
    skipped = sum(r.get("result") == "skipped" for r in rows)
    text = f"{len(rows) - len(bad) - skipped} of {len(rows)} checks bit-exact or passed"
    return text + (f", {skipped} skipped for time" if skipped else "")


# ------------------------------------------------------------------ part 1: pytest


def run_tests(record, ctx) -> bool:
    cmd = [sys.executable, "-m", "pytest", "-v", "--tb=line", "-p", "no:cacheprovider", *TEST_FILES]
    if ctx.rehearse:
        cmd += ["-k", REHEARSE_TESTS]
    env = dict(os.environ, JAX_PLATFORMS="cpu" if ctx.rehearse else "cuda")
    budget = max(10.0, record.left() * PYTEST_SHARE)
    start = time.monotonic()
    try:
        done = subprocess.run(
            cmd, cwd=ctx.root, env=env, capture_output=True, text=True, timeout=budget
        )
        out, timed_out = done.stdout + done.stderr, False
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        timed_out = True
    seconds = time.monotonic() - start
    counts: dict[str, dict[str, list[str]]] = {f: {} for f in TEST_FILES}
    for line in out.splitlines():
        m = _STATUS.match(line)
        if m and m.group(1) in counts:
            counts[m.group(1)].setdefault(m.group(3), []).append(m.group(2))
    ok = not timed_out
    for f in TEST_FILES:
        got = counts[f]
        passed = len(got.get("PASSED", []))
        bad = got.get("FAILED", []) + got.get("ERROR", [])
        ok = ok and not bad and passed > 0
        detail = f"{passed} passed, {len(bad)} failed"
        if got.get("SKIPPED"):
            detail += f", {len(got['SKIPPED'])} skipped"
        if bad:
            detail += ": " + ", ".join(bad[:6]) + (" ..." if len(bad) > 6 else "")
        record.row(
            check=f"pytest {f}",
            size="the tests' own",
            result="ok" if passed and not bad else "FAILED",
            detail=detail,
            seconds=round(seconds, 1),
        )
    if timed_out:
        record.note(f"pytest stopped after {budget:.0f} s (its share of the stage's budget)")
    errors = [
        line
        for line in out.splitlines()
        if line.startswith(("E ", "/", "tests/")) and ("Error" in line or "assert" in line)
    ]
    for line in errors[:10]:
        record.note(f"pytest: {line[:300]}")
    return ok


# --------------------------------------------------------------- part 2: size sweep


def wide_values(rng, shape, specials: bool) -> np.ndarray:
    """float32 values over a wide range of magnitudes, with NaN (two payloads), +-Inf,
    +-0 and a subnormal at random places when ``specials``."""
    v = rng.standard_normal(shape) * np.exp(2 * rng.standard_normal(shape))
    v = v.astype(np.float32)
    if specials and v.size >= 16:
        flat = v.reshape(-1)
        payload = np.array([0x7FC01234], np.uint32).view(np.float32)[0]
        put = [np.nan, payload, np.inf, -np.inf, 0.0, -0.0, 1e-40, -1e-40]
        flat[rng.choice(flat.size, len(put), replace=False)] = put
    return v


def differing(a, b) -> int:
    """Elements whose bits differ (NaN payloads included), or -1 on a shape or dtype
    mismatch."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return -1
    if a.dtype.kind == "f":
        a, b = a.view(f"u{a.itemsize}"), b.view(f"u{b.itemsize}")
    return int(np.count_nonzero(a != b))


def differing_nan_lenient(a, b) -> int:
    """As `differing`, a NaN meeting a NaN counting as equal whatever its payload (the
    product of a NaN code and a NaN scale keeps either operand's: IEEE 754 leaves it
    open)."""
    a, b = np.asarray(a), np.asarray(b)
    both = np.isnan(a) & np.isnan(b)
    return differing(np.where(both, 0, a), np.where(both, 0, b))


class Sweep:
    def __init__(self, record, ctx):
        self.record, self.ctx = record, ctx
        self.rng = np.random.default_rng(2026)
        self.ok = True
        big = 2**13 + 3 if ctx.rehearse else 2**24 + 3
        self.sign_sizes = [1, 4095, 4096, 3 * 4096 + 5, big]
        self.gtc_sizes = [1000, 5 * 1024, 5 * 1024 + 77, big]
        self.quant_blocks = [1, 37, -(-big // 128)]  # blocks of 128: 128 to ~2**24 values
        if ctx.rehearse:  # interpret mode is slow: the sizes' shapes, fewer of them
            self.sign_sizes, self.gtc_sizes = [4095, big], [5 * 1024 + 77, big]
            self.quant_blocks = [37]

    def check(self, name: str, size: str, compare) -> None:
        """One row: ``compare()`` returns the differing elements of each output."""
        if self.record.left() < 5:
            self.record.row(
                check=name, size=size, result="skipped", detail="out of time", seconds=0
            )
            return
        start = time.monotonic()
        try:
            diffs = compare()
        except Exception as err:  # a crash is a result too: recorded, the sweep goes on
            self.ok = False
            self.record.row(
                check=name,
                size=size,
                result="ERROR",
                detail=f"{type(err).__name__}: {str(err)[:300]}",
                seconds=round(time.monotonic() - start, 2),
            )
            return
        bad = {k: v for k, v in diffs.items() if v != 0}
        self.ok = self.ok and not bad
        detail = ", ".join(
            f"{k} {v} differ" if v > 0 else f"{k} shape/dtype differ" for k, v in bad.items()
        ) or "bit-exact: " + ", ".join(diffs)
        self.record.row(
            check=name,
            size=size,
            result="FAILED" if bad else "ok",
            detail=detail,
            seconds=round(time.monotonic() - start, 2),
        )

    def run(self) -> bool:
        for n in self.sign_sizes:
            self.check("sign_pack / sign_unpack", f"{n:,}", lambda n=n: self.sign(n))
        for n in self.gtc_sizes:
            for case in ("none qualify", "overflow from offset", "all qualify, full capacity"):
                self.check(
                    f"gtc_pack / gtc_unpack: {case}",
                    f"{n:,}",
                    lambda n=n, case=case: self.gtc(n, case),
                )
        n = self.gtc_sizes[-1]
        self.check("gtc_pack_parts", f"{n:,} in 3 parts", lambda: self.gtc_parts(n))
        for fmt in ("int8", "fp8", "fp4"):
            for blocks in self.quant_blocks:
                self.check(
                    f"quantize / dequantize {fmt}, block 128",
                    f"{128 * blocks:,}",
                    lambda fmt=fmt, blocks=blocks: self.quant(fmt, 128, blocks),
                )
        return self.ok

    def both(self, fn, *args, **kwargs):
        """``fn`` with ``impl="pallas"`` and ``impl="reference"``, as NumPy arrays."""
        import jax

        tree = jax.tree
        got = tree.map(np.asarray, fn(*args, impl="pallas", **kwargs))
        want = tree.map(np.asarray, fn(*args, impl="reference", **kwargs))
        return got, want

    def sign(self, n: int) -> dict[str, int]:
        from shoal.kernels import sign_pack, sign_unpack

        v = wide_values(self.rng, (2, n), specials=True)
        (bits, scale), (bits_ref, scale_ref) = self.both(sign_pack, v)
        dense, dense_ref = self.both(sign_unpack, bits_ref, np.float32([1.5, -0.25]), n)
        return {
            "bits": differing(bits, bits_ref),
            "scale": differing(scale, scale_ref),
            "unpacked": differing(dense, dense_ref),
        }

    def gtc(self, n: int, case: str) -> dict[str, int]:
        from shoal.kernels import gtc_pack, gtc_unpack

        v = wide_values(self.rng, n, specials=case == "overflow from offset")
        if case == "none qualify":
            v[self.rng.choice(n, 3, replace=False)] = np.nan  # NaN never qualifies
            tau, capacity, offset = np.float32(np.nanmax(np.abs(v)) * 2), max(1, n // 100), 0
        elif case == "overflow from offset":
            finite = np.abs(v[np.isfinite(v)])
            tau = np.float32(np.quantile(finite, 0.99))
            capacity, offset = max(1, n // 200), n // 3
        else:
            v = np.where(v >= 0, 1 + np.abs(v), -1 - np.abs(v)).astype(np.float32)
            tau, capacity, offset = np.float32(0.5), n, n // 2
        got, want = self.both(gtc_pack, v, tau, capacity, offset)
        diffs = {k: differing(a, b) for k, a, b in zip(("words", "count", "remainder"), got, want)}
        if case == "none qualify" and int(want[1]) != 0:
            diffs["count (expected 0)"] = int(want[1])
        if case.startswith("all") and int(want[1]) != n:
            diffs["count (expected n)"] = abs(int(want[1]) - n)
        words = np.stack([want[0], want[0][::-1]])
        counts = np.array([int(want[1]), int(want[1]) // 2], np.int32)
        dense, dense_ref = self.both(gtc_unpack, words, counts, tau, n)
        diffs["unpacked"] = differing(dense, dense_ref)
        return diffs

    def gtc_parts(self, n: int) -> dict[str, int]:
        from shoal.kernels import gtc_pack_parts

        a = n // 2
        b = (n - a) // 8
        parts = [
            wide_values(self.rng, a, True),
            wide_values(self.rng, (b, 8), True),
            wide_values(self.rng, n - a - 8 * b, True),
        ]
        tau = np.float32(np.quantile(np.abs(parts[0][np.isfinite(parts[0])]), 0.98))
        (w, c, rem), (w_ref, c_ref, rem_ref) = self.both(
            gtc_pack_parts, parts, tau, max(1, n // 100), n // 5
        )
        out = {"words": differing(w, w_ref), "count": differing(c, c_ref)}
        out["remainder"] = sum(differing(x, y) for x, y in zip(rem, rem_ref))
        return out

    def quant(self, fmt: str, block: int, blocks: int) -> dict[str, int]:
        from shoal.kernels import dequantize, quantize

        v = wide_values(self.rng, (2, block * blocks), specials=True)
        # An fp8 block whose largest value puts the others in e4m3's subnormal range.
        v[0, :block] = np.linspace(-1e-3, 1e-3, block, dtype=np.float32)
        v[0, 0] = 448.0
        (codes, scales), (codes_ref, scales_ref) = self.both(quantize, v, fmt, block)
        dense, dense_ref = self.both(dequantize, codes_ref, scales_ref, fmt, block)
        return {
            "codes": differing(codes, codes_ref),
            "scales": differing(scales, scales_ref),
            "dequantized": differing_nan_lenient(dense, dense_ref),
        }
