"""Every algorithm's hyper-parameters are its own typed, frozen dataclass in its own module
(`shoal.experiments.algorithms`): the three spellings (a config file's ``params``, ``--set
name.field=...``, an entry's brackets) give the same values; nested parts reach the built
transformation; values are checked from the annotations, naming the key; every old flat
field name is refused naming its new home, which exists; brackets take only the
algorithm's own fields; and a checkpoint compares only the entry's own hyper-parameters
and the run's and task's fields."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import re
import textwrap

import jax
import numpy as np
import optax
import pytest

from shoal import optim
from shoal.comms import AxisCollective, Quantized, TopK, wire_bytes
from shoal.experiments import algorithms
from shoal.experiments.algorithms import (
    ALGORITHMS,
    Context,
    Hyper,
    register,
    resolve,
    resolve_all,
)
from shoal.experiments.algorithms.diloco import DiLoCo
from shoal.experiments.algorithms.parts import Exchange
from shoal.experiments.algorithms.renamed import RENAMED, RENAMED_ENTRIES
from shoal.experiments.config import Config, ConfigError
from shoal.experiments.overrides import apply_overrides, load_file
from shoal.experiments.runner.checkpoint import config_fields

DILOCO = Config(algorithms=("diloco",), workers=2, steps=40, batch_size=8)


def config_file(tmp_path, body: str, name: str = "cfg.py") -> str:
    """A config file whose get_config() returns ``body``."""
    path = tmp_path / name
    path.write_text(
        "from shoal.experiments.config import Config\n\ndef get_config():\n"
        + textwrap.indent(f"return {body}\n", "    ")
    )
    return str(path)


# ------------------------------------------------------------------ 1. one meaning


def test_the_three_spellings_give_the_same_params(tmp_path):
    bracket = resolve("diloco[sync_every=20]", DILOCO).params
    command_line = resolve("diloco", apply_overrides(DILOCO, ["diloco.sync_every=20"])).params
    as_dict = dataclasses.replace(DILOCO, params={"diloco": {"sync_every": 20}})
    as_class = dataclasses.replace(DILOCO, params={"diloco": DiLoCo(sync_every=20)})
    from_file = load_file(config_file(
        tmp_path, "Config(algorithms=('diloco',), workers=2, steps=40, batch_size=8, "
        "params={'diloco': {'sync_every': 20}})"
    ))  # fmt: skip
    assert bracket == command_line == resolve("diloco", as_dict).params
    assert bracket == resolve("diloco", as_class).params == resolve("diloco", from_file).params
    assert bracket == DiLoCo(sync_every=20) and bracket != DiLoCo()
    # The same run: the command line's config is the config file's.
    assert apply_overrides(DILOCO, ["diloco.sync_every=20"]) == from_file


def test_nested_parts_in_the_three_spellings():
    want = DiLoCo(sync_every=20, inner=dataclasses.replace(
        DiLoCo().inner, adamw=dataclasses.replace(DiLoCo().inner.adamw, learning_rate=3e-3)
    ))  # fmt: skip
    sets = ["diloco.sync_every=20", "diloco.inner.adamw.learning_rate=3e-3"]
    nested = {"diloco": {"sync_every": 20, "inner": {"adamw": {"learning_rate": 3e-3}}}}
    got = [
        resolve("diloco[sync_every=20;inner.adamw.learning_rate=3e-3]", DILOCO).params,
        resolve("diloco", apply_overrides(DILOCO, sets)).params,
        resolve("diloco", dataclasses.replace(DILOCO, params=nested)).params,
        resolve("diloco", dataclasses.replace(DILOCO, params={"diloco": want})).params,
    ]
    assert all(p == want for p in got), got
    assert want.inner.adamw.learning_rate == 3e-3 and want.inner.adamw.weight_decay == 0.0
    # A bracket applies on top of the run's values.
    run = apply_overrides(DILOCO, ["diloco.outer.momentum=0.5"])
    both = resolve("diloco[outer.learning_rate=0.5]", run).params.outer
    assert (both.learning_rate, both.momentum) == (0.5, 0.5)


def test_defaults_are_filled_in_for_the_runs_algorithms():
    cfg = Config(algorithms=("ssgd", "gtc[threshold=0.2]"))
    assert set(cfg.params) == {"ssgd", "gtc"}
    assert cfg.params["gtc"] == ALGORITHMS["gtc"].params()  # the bracket is the entry's
    assert resolve("gtc[threshold=0.2]", cfg).params.threshold == 0.2


# ------------------------------------------------------------------ 2. into the transformation


def one_update(entry, theta0, grads):
    """Every worker's params after one update of ``entry`` from ``theta0`` (the same on
    every worker) with its own row of ``grads``, and the bytes it sent."""
    coll = AxisCollective("workers", len(grads))
    tx = entry.build(coll)

    def worker(g):
        state = tx.init(theta0)
        u, state = tx.update(g, state, theta0)
        return optax.apply_updates(theta0, u), wire_bytes(state, "step").sent

    params, sent = jax.jit(jax.vmap(worker, axis_name="workers"))(grads)
    return params, np.asarray(sent)


def test_nested_outer_learning_rate_reaches_the_outer_step():
    """One DiLoCo round of one inner step: inner SGD at rate 1 without momentum reaches
    ``theta0 - g_i``, the outer gradient is ``mean(g)``, and the outer step without
    momentum moves ``theta0`` by ``-lr * mean(g)`` (by hand below)."""
    theta0 = np.array([1.0, -2.0, 0.5], np.float32)
    grads = np.array([[0.2, 0.4, -1.0], [0.6, 0.0, 3.0]], np.float32)  # mean 0.4, 0.2, 1.0
    sgd = "sync_every=1;inner.use=sgd;inner.sgd.learning_rate=1;inner.sgd.momentum=0"
    cfg = apply_overrides(DILOCO, ["diloco.outer.momentum=0"])
    set_half = apply_overrides(cfg, ["diloco.outer.learning_rate=0.5"])
    for entry, lr in [
        (resolve(f"diloco[{sgd}]", cfg), 0.7),  # the default
        (resolve(f"diloco[{sgd};outer.learning_rate=0.5]", cfg), 0.5),
        (resolve(f"diloco[{sgd}]", set_half), 0.5),
    ]:
        assert entry.params.outer.learning_rate == lr
        params, _ = one_update(entry, theta0, grads)
        want = theta0 - lr * np.array([0.4, 0.2, 1.0], np.float32)
        np.testing.assert_allclose(params, np.stack([want, want]), rtol=1e-6)


def test_nested_exchange_codec_reaches_the_exchange():
    codec = Exchange(codec="fp4").make()
    assert isinstance(codec, Quantized) and codec.fmt == "fp4"
    assert Exchange().make() is None  # float32: a plain all-reduce
    topk = Exchange(codec="topk", topk={"fraction": 0.25, "chunk_size": 8}).make()
    assert isinstance(topk, TopK) and (topk.fraction, topk.chunk_size) == (0.25, 8)

    cfg = dataclasses.replace(DILOCO, nonfinite="off")  # only the exchange's bytes
    fp4 = resolve("diloco[sync_every=1;exchange.codec=fp4]", cfg)
    assert fp4.params.exchange == Exchange(codec="fp4")
    assert resolve("diloco[sync_every=1]", apply_overrides(cfg, ["diloco.exchange.codec=fp4"])
                   ).params == fp4.params  # fmt: skip
    theta0 = np.zeros(256, np.float32)
    grads = np.random.default_rng(0).normal(size=(2, 256)).astype(np.float32)
    plain = resolve("diloco[sync_every=1]", cfg)
    _, sent_plain = one_update(plain, theta0, grads)
    _, sent_fp4 = one_update(fp4, theta0, grads)
    assert sent_plain.tolist() == [4 * 256] * 2  # a ring all-reduce of 2: the vector
    assert sent_fp4.tolist() == [Quantized("fp4").wire_bytes(256, 2)[0]] * 2
    assert sent_fp4[0] < sent_plain[0] / 4


# ------------------------------------------------------------------ 3. the registry


def algorithm_modules() -> set[str]:
    return {
        m.name
        for m in pkgutil.iter_modules(algorithms.__path__)
        if not m.name.startswith("_") and m.name not in ("parts", "renamed")
    }


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_algorithm_has_typed_frozen_params_with_defaults(name):
    algo = ALGORITHMS[name]
    cls = algo.params
    assert dataclasses.is_dataclass(cls) and issubclass(cls, Hyper)
    assert cls.__dataclass_params__.frozen
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    assert not missing, f"{name}: fields without a default: {missing}"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cls().__setattr__(dataclasses.fields(cls)[0].name, None)
    # One home: the builder and its hyper-parameters live in the algorithm's own module.
    home = f"shoal.experiments.algorithms.{name}"
    assert algo.build.__module__ == home and cls.__module__ == home
    assert algo.skip_in_place in (None, True, False, "apply")
    if algo.two_tier:
        assert "group_size" in {f.name for f in dataclasses.fields(cls)}


def test_every_algorithm_module_is_one_registered_algorithm():
    assert algorithm_modules() == set(ALGORITHMS)
    for name in ALGORITHMS:
        module = importlib.import_module(f"shoal.experiments.algorithms.{name}")
        registered = [n for n, a in ALGORITHMS.items() if a.build.__module__ == module.__name__]
        assert registered == [name]


def test_register_requires_what_the_runner_needs():
    @dataclasses.dataclass(frozen=True)
    class Params(Hyper):
        rate: float = 0.1

    before = dict(ALGORITHMS)
    with pytest.raises(TypeError, match="skip_in_place"):
        register("x", Params, family="dense")  # the module must say how steps are skipped
    with pytest.raises(TypeError, match="family"):
        register("x", Params, skip_in_place=None)  # ... and which panels reports put it in
    with pytest.raises(ValueError, match="family must be one of"):
        register("x", Params, skip_in_place=None, family="other")
    with pytest.raises(TypeError, match="group_size"):
        register("x", Params, skip_in_place=None, family="local", two_tier=True)
    with pytest.raises(TypeError, match="Hyper"):
        register("x", dict, skip_in_place=None, family="dense")
    with pytest.raises(ValueError, match="skip_in_place"):
        register("x", Params, skip_in_place="sometimes", family="dense")

    @dataclasses.dataclass(frozen=True)
    class NoDefault(Hyper):
        rate: float

    with pytest.raises(TypeError):
        register("x", NoDefault, skip_in_place=None, family="dense")
    with pytest.raises(ValueError, match="already registered"):
        register("ssgd", Params, skip_in_place=None, family="dense")(
            lambda p, ctx: optax.identity()
        )
    assert ALGORITHMS == before


class OwnOnly(dict):
    """``Config.params`` that refuses to hand out another algorithm's hyper-parameters."""

    def __init__(self, name, params):
        super().__init__(params)
        self.name = name

    def __getitem__(self, key):
        assert key == self.name, f"{self.name}'s builder read {key}'s hyper-parameters"
        return super().__getitem__(key)

    def get(self, key, default=None):
        assert key == self.name, f"{self.name}'s builder read {key}'s hyper-parameters"
        return super().get(key, default)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_builders_read_only_their_own_params(name):
    """What ``--resume`` relies on: an algorithm trains from its own hyper-parameters and
    the run's fields, never from another algorithm's (which a resume does not compare)."""
    algo = ALGORITHMS[name]
    params = algo.params()
    cfg = Config(workers=4, steps=20)
    object.__setattr__(cfg, "params", OwnOnly(name, {**cfg.params, name: params}))
    world = AxisCollective("workers", cfg.workers)
    comms = world.split(params.group_size) if algo.two_tier else world
    assert isinstance(algo.build(params, Context(comms, cfg)), optax.GradientTransformation)


# ------------------------------------------------------------------ 4. typed checks


def test_values_are_checked_from_the_annotations():
    with pytest.raises(ConfigError, match="gtc.threshold: 'abc' is not a float"):
        apply_overrides(Config(), ["gtc.threshold=abc"])
    with pytest.raises(ConfigError, match="'threshold' must be a finite float, got str 'x'"):
        Config(params={"gtc": {"threshold": "x"}})
    with pytest.raises(ConfigError, match="'sync_every' must be an int, got float 2.5"):
        Config(params={"diloco": {"sync_every": 2.5}})
    with pytest.raises(ConfigError, match="'codec' must be one of"):
        Config(params={"diloco": {"exchange": {"codec": "fp3"}}})
    with pytest.raises(ConfigError, match="bad value for diloco.exchange.codec: 'fp3'"):
        apply_overrides(Config(), ["diloco.exchange.codec=fp3"])
    # Ranges: the parts' own checks.
    with pytest.raises(ConfigError, match="'momentum' must be a float in \\[0, 1\\)"):
        Config(params={"diloco": {"outer": {"momentum": 1.0}}})
    # An int given for a float is stored as a float.
    lr = Config(params={"ssgd": {"local": {"learning_rate": 1}}}).params["ssgd"].local.learning_rate
    assert type(lr) is float and lr == 1.0


def test_unknown_keys_name_the_fields_there_are():
    fields = "OuterSGD has: learning_rate, momentum"
    with pytest.raises(ConfigError, match=f"'outer.lr'; {fields}"):
        Config(params={"diloco": {"outer": {"lr": 0.5}}})
    with pytest.raises(ConfigError, match=f"unknown config key 'diloco.outer.lr'; {fields}"):
        apply_overrides(Config(), ["diloco.outer.lr=0.5"])
    with pytest.raises(ConfigError, match="'outer.lr'; OuterSGD has"):
        resolve("diloco[outer.lr=0.5]", DILOCO)
    diloco_fields = "DiLoCo has: sync_every, inner, outer, exchange"
    with pytest.raises(ConfigError, match=f"'params.diloco.foo'; {diloco_fields}"):
        Config(params={"diloco": {"foo": 1}})
    with pytest.raises(ConfigError) as e:
        Config(params={"nope": {}})
    assert "unknown algorithm 'nope'; registered: " in str(e.value)
    assert all(name in str(e.value) for name in ALGORITHMS)
    with pytest.raises(ConfigError, match="must be a .*diloco.DiLoCo or a dict of its fields"):
        Config(params={"diloco": ALGORITHMS["gtc"].params()})
    with pytest.raises(ConfigError, match="names an algorithm"):
        apply_overrides(Config(), ["diloco=1"])


# ------------------------------------------------------------------ 5. the old names


# The old flat fields' defaults (shoal.experiments.fields.HyperParameters before each
# algorithm got its own module): every new home starts from the same value.
OLD_DEFAULTS = {
    "learning_rate": 0.05, "momentum": 0.9, "lamb_learning_rate": 0.02, "lamb_b1": 0.9,
    "lamb_b2": 0.999, "weight_decay": 0.0, "lamb_lr_warmup": 0.0, "lamb_lr_decay": "constant",
    "onebit_freeze_fraction": 0.15, "onebit_freeze_step": None, "gtc_threshold": 0.1,
    "gtc_capacity": 0.08, "block_size": 10, "block_lr": 1.0, "block_momentum": None,
    "nesterov": True, "nbm": "seed", "warmup_steps": 0, "reset_inner_state": True,
    "group_size": 2, "diloco_sync_every": 10, "diloco_outer_lr": 0.7,
    "diloco_outer_momentum": 0.9, "diloco_inner": "adamw", "diloco_inner_lr": 0.001,
    "diloco_exchange": "float32", "streaming_fragments": 4, "streaming_overlap": 0,
    "streaming_mix": 0.5, "topk_fraction": 0.01, "topk_chunk_size": 64, "topk_value_bits": 0,
    "powersgd_rank": 4, "powersgd_start_step": 0, "demo_momentum": 0.999,
    "demo_chunk_size": 64, "demo_topk": 32, "demo_sign": True, "demo_lr": 0.001,
    "bfb_buffer_bytes": 0, "pgx_fraction": 0.3, "peer_strategy": "round_robin",
    "peer_staleness": 0, "sma_alpha": 0.1, "noise_ema": 0.9, "policy_every": 10,
    "policy_after": 0, "noise_threshold": 1000.0, "adaptive_fraction": 0.1,
    "adaptive_sync": "full",
}  # fmt: skip


def test_renamed_covers_every_old_name_and_no_current_one():
    assert set(RENAMED) == set(OLD_DEFAULTS)
    run = {f.name for f in dataclasses.fields(Config)}
    assert not set(RENAMED) & run and not set(RENAMED) & set(ALGORITHMS)


def walk(home: str):
    """The value at ``home`` ("algorithm.part.field") in the algorithm's defaults."""
    name, *path = home.split(".")
    assert name in ALGORITHMS, f"{home}: {name} is not a registered algorithm"
    value = ALGORITHMS[name].params()
    for part in path:
        assert dataclasses.is_dataclass(value), f"{home}: {part!r} is below a plain value"
        fields = {f.name for f in dataclasses.fields(value)}
        assert part in fields, f"{home}: {type(value).__name__} has no {part!r}"
        value = getattr(value, part)
    assert not dataclasses.is_dataclass(value), f"{home} is a part, not a field"
    return value


@pytest.mark.parametrize("old", sorted(RENAMED))
def test_every_new_home_exists(old):
    homes = RENAMED[old]
    assert homes and len(set(homes)) == len(homes)
    for home in homes:
        walk(home)
    # The defaults are the old defaults, in every home.
    got = {h: walk(h) for h in homes}
    want = OLD_DEFAULTS[old]
    assert all(v == want and type(v) is type(want) for v in got.values()), (want, got)


@pytest.mark.parametrize("old", sorted(RENAMED))
def test_every_old_name_is_refused_naming_the_new_spelling(old, tmp_path):
    homes = RENAMED[old]
    # A config file: Config(old=...), through load_file's unknown-keyword path.
    with pytest.raises(ConfigError) as e:
        load_file(config_file(tmp_path, f"Config({old}=1)"))
    assert f"'{old}'" in str(e.value) and all(h in str(e.value) for h in homes), str(e.value)
    # --set old=...
    with pytest.raises(ConfigError) as e:
        apply_overrides(Config(), [f"{old}=1"])
    assert f"'{old}'" in str(e.value) and all(h in str(e.value) for h in homes), str(e.value)
    # A bracket of each algorithm that has it, where the old name is not its new one.
    for home in homes:
        name, _, path = home.partition(".")
        cfg = Config(algorithms=(name,), workers=4, steps=20)
        if path == old:  # e.g. bmuf[block_size=...]: the old bracket is the new one
            assert resolve(f"{name}[{old}={walk(home)}]", cfg).params == cfg.params[name]
            continue
        with pytest.raises(ConfigError) as e:
            resolve(f"{name}[{old}=1]", cfg)
        assert f"'{old}'" in str(e.value), str(e.value)
        mine = [h.partition(".")[2] for h in homes if h.partition(".")[0] == name]
        assert f"{name}[{mine[0]}=...]" in str(e.value), str(e.value)


def test_entries_speak_the_librarys_vocabulary():
    # An entry that runs one shoal.optim transformation carries its name; any other is a
    # recipe named for its paper's method, whose docstring names what it chains.

    for name, algo in ALGORITHMS.items():
        module = importlib.import_module(algo.build.__module__)
        assert module.__name__.rpartition(".")[2] == name, (name, module.__name__)
        if name in optim.__all__:
            continue
        if algo.asynchronous is not None:  # its rounds are the simulator's
            assert "`shoal.experiments.asynchronous.simulate`" in (module.__doc__ or ""), name
            continue
        chained = re.findall(r"`shoal\.optim\.(\w+)`", module.__doc__ or "")
        assert chained and set(chained) <= set(optim.__all__), (name, chained)


@pytest.mark.parametrize("old", sorted(RENAMED_ENTRIES))
def test_an_old_entry_name_is_refused_naming_the_new_one(old, tmp_path):
    new = RENAMED_ENTRIES[old]
    assert new in ALGORITHMS and new in optim.__all__
    said = f"algorithm {old!r} is now {new!r}"
    for attempt in (
        lambda: resolve_all(Config(algorithms=("ssgd", old), workers=4)),
        lambda: resolve(f"{old}[local.learning_rate=0.1]", Config(workers=4)),
        lambda: apply_overrides(Config(), [f"{old}.local.learning_rate=0.1"]),
        lambda: Config(params={old: {}}),
        lambda: load_file(config_file(tmp_path, f"Config(params={{{old!r}: {{}}}})")),
    ):
        with pytest.raises(ConfigError, match=re.escape(said)):
            attempt()


def test_an_old_name_in_another_algorithms_bracket_names_its_homes():
    with pytest.raises(ConfigError, match="'gtc_threshold' is not a hyper-parameter of ssgd"):
        resolve("ssgd[gtc_threshold=0.2]", Config())
    with pytest.raises(ConfigError, match="gtc.threshold, bmuf_gtc.threshold"):
        resolve("ssgd[gtc_threshold=0.2]", Config())


# ------------------------------------------------------------------ 6. brackets


@pytest.mark.parametrize("key, value", [("seed", "1"), ("steps", "10"), ("batch_size", "8"),
                                        ("hidden", "16"), ("workers", "2")])  # fmt: skip
def test_brackets_refuse_run_and_task_fields(key, value):
    with pytest.raises(ConfigError) as e:
        resolve(f"ssgd[{key}={value}]", Config())
    assert f"'{key}' is a field of the whole run" in str(e.value)
    assert f"--set {key}=..." in str(e.value)


# ------------------------------------------------------------------ 7. resume


def test_resume_compares_the_entrys_params_and_the_runs_fields():
    cfg = Config(algorithms=("ssgd", "gtc"))
    ssgd = config_fields(cfg, "ssgd")
    assert not [k for k in ssgd if k.startswith("gtc.")]
    assert {"ssgd.local.learning_rate", "ssgd.local.momentum", "steps", "hidden", "seed",
            "workers", "batch_size", "task"} <= set(ssgd)  # fmt: skip
    gtc = config_fields(cfg, "gtc[threshold=0.3]")
    assert gtc["gtc.threshold"] == "0.1"  # the run's value; the bracket is the label's
    assert not [k for k in gtc if k.startswith("ssgd.")]
    changed = apply_overrides(cfg, ["gtc.threshold=0.3"])
    assert config_fields(changed, "ssgd") == ssgd
    assert config_fields(changed, "gtc") != config_fields(cfg, "gtc")
    assert config_fields(changed, "gtc")["gtc.threshold"] == "0.3"
    # The run's own fields concern every algorithm.
    assert config_fields(apply_overrides(cfg, ["seed=1"]), "ssgd") != ssgd
