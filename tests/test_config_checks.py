"""Config values are checked by type and range wherever they come from (config files,
``--set``, direct construction), and ``shoal-run`` reports a bad one in one line (exit 2)
before anything trains: field types, non-finite floats, the seed's range, the run's name
as a folder, ``inject_nonfinite``'s step and worker, and how CONFIG names a file."""

from __future__ import annotations

import dataclasses
import textwrap

import harness
import jax
import numpy as np
import pytest

from shoal.experiments.config import MAX_SEED, Config, ConfigError
from shoal.experiments.overrides import apply_overrides, load_file
from shoal.experiments.runner.cli import main

QUICKSTART = str(harness.QUICKSTART)
PREFIX = "shoal-run: error:"


def run_main(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code, out, err, words):
    assert "Traceback" not in out + err
    assert code == 2, (code, err)
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(PREFIX), lines[0]
    for word in words:
        assert word in lines[0], (word, lines[0])


def config_file(tmp_path, body, name="cfg.py", header=""):
    """A config file whose get_config() runs ``body`` (Config imported)."""
    path = tmp_path / name
    path.write_text(
        "from shoal.experiments.config import Config\n"
        + textwrap.dedent(header)
        + "\ndef get_config():\n"
        + textwrap.indent(textwrap.dedent(body), "    ")
    )
    return str(path)


# ------------------------------------------------------------------ 1. types

# (Config(...) arguments in a config file, words the error must contain)
FILE_CASES = {
    "str for int": ("steps='10'", ["'steps'", "an int", "str '10'"]),
    "float for int": ("steps=10.7", ["'steps'", "an int", "float 10.7"]),
    "bool for int": ("steps=True", ["'steps'", "an int", "bool True"]),
    "str for tuple": ("algorithms='ssgd'", ["'algorithms'", "tuple", "str 'ssgd'"]),
    "bad tuple item": ("hidden=[8, 'x']", ["'hidden'", "of int", "[8, 'x']"]),
    "not a choice": ("nonfinite='never'", ["'nonfinite'", "'skip'", "str 'never'"]),
    "int for bool": ("params={'bmuf': {'nesterov': 1}}", ["'nesterov'", "a bool", "int 1"]),
    "str for float": (
        "params={'ssgd': {'local': {'learning_rate': '0.1'}}}",
        ["'learning_rate'", "float", "str '0.1'"],
    ),
    "float for optional int": (
        "params={'onebit_lamb': {'freeze_step': 2.0}}",
        ["'freeze_step'", "or None"],
    ),
}


@pytest.mark.parametrize("name", list(FILE_CASES))
def test_config_file_types_are_checked_in_one_line(name, tmp_path, capsys):
    args, words = FILE_CASES[name]
    path = config_file(tmp_path, f"return Config({args})")
    code, out, err = run_main([path, "--out", str(tmp_path / "run")], capsys)
    assert_one_line_error(code, out, err, ["config field", *words])
    assert not (tmp_path / "run").exists()


def test_types_are_converted_as_annotated():
    cfg = Config(
        algorithms=["ssgd", "gtc"],
        hidden=[8, 4],
        params={"ssgd": {"local": {"learning_rate": 1}}},
        seed=np.int64(3),
    )
    assert cfg.algorithms == ("ssgd", "gtc") and cfg.hidden == (8, 4)
    rate = cfg.params["ssgd"].local.learning_rate
    assert type(rate) is float and rate == 1.0
    assert type(cfg.seed) is int
    # Literal: the value's type must match too (True == 1, but is not a bit width).
    with pytest.raises(ConfigError, match="'value_bits' must be one of"):
        Config(params={"topk": {"value_bits": True}})
    assert Config(params={"bmuf": {"block_momentum": None}}).params["bmuf"].block_momentum is None
    with pytest.raises(ConfigError, match="'steps' must be an int, got str '10'"):
        dataclasses.replace(Config(), steps="10")


def test_subclass_fields_are_checked(tmp_path, capsys):
    header = """
        import dataclasses

        @dataclasses.dataclass(frozen=True)
        class Extra(Config):
            factor: float = 1.0
            tags: tuple[str, ...] = ()
        """
    path = config_file(tmp_path, "return Extra(factor='big')", header=header)
    code, out, err = run_main([path], capsys)
    assert_one_line_error(code, out, err, ["'factor'", "float", "str 'big'"])
    cfg = load_file(config_file(tmp_path, "return Extra(factor=2, tags=['a'])", "ok.py", header))
    assert cfg.factor == 2.0 and type(cfg.factor) is float and cfg.tags == ("a",)
    # --set on the subclass's field is converted, then checked the same way.
    with pytest.raises(ConfigError, match="'factor' must be a finite float"):
        apply_overrides(cfg, ["factor=inf"])


def test_unknown_key_in_a_config_file_is_the_set_error(tmp_path, capsys):
    path = config_file(tmp_path, "return Config(stepz=5)")
    code, out, err = run_main([path], capsys)
    assert_one_line_error(code, out, err, [path, "unknown config key 'stepz'", "'steps'"])
    # dataclasses.replace with an unknown field: the same error.
    path = config_file(tmp_path, "return dataclasses.replace(Config(), stepz=5)", "r.py",
                       "import dataclasses\n")  # fmt: skip
    code, out, err = run_main([path], capsys)
    assert_one_line_error(code, out, err, ["unknown config key 'stepz'", "did you mean"])


def test_other_type_errors_of_a_config_file_keep_their_traceback(tmp_path):
    header = """
        class Mine:
            def __init__(self):
                pass
        """
    with pytest.raises(TypeError, match="unexpected keyword argument 'x'"):
        load_file(config_file(tmp_path, "Mine(x=1)\nreturn Config()", header=header))
    with pytest.raises(TypeError, match="unsupported operand"):
        load_file(config_file(tmp_path, "return Config(steps=1 + 'a')", "b.py"))


# ------------------------------------------------------------------ 2. finite floats


def nested(key: str, value) -> dict:
    """``"ssgd.local.learning_rate"`` -> ``{"ssgd": {"local": {"learning_rate": value}}}``."""
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


@pytest.mark.parametrize(
    "key",
    [
        "ssgd.local.learning_rate",
        "diloco.inner.adamw.learning_rate",
        "demo.learning_rate",
        "lamb.weight_decay",
        "diloco.inner.adamw.weight_decay",
        "adaptive.threshold",
    ],
)
@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
def test_non_finite_floats_are_refused(key, value, capsys, tmp_path):
    field = key.split(".")[-1]
    code, out, err = run_main([QUICKSTART, "--set", f"{key}={value}",
                               "--out", str(tmp_path / "run")], capsys)  # fmt: skip
    assert_one_line_error(code, out, err, [f"{key}={value}", f"'{field}'", "finite"])
    with pytest.raises(ConfigError, match=f"'{field}' must be a finite float"):
        Config(params=nested(key, float(value)))


def test_non_finite_optional_float_is_refused_none_is_not():
    with pytest.raises(ConfigError, match="'block_momentum' must be a finite float or None"):
        Config(params={"bmuf": {"block_momentum": float("nan")}})
    cfg = apply_overrides(Config(), ["bmuf.block_momentum=none"])
    assert cfg.params["bmuf"].block_momentum is None


# ------------------------------------------------------------------ 3. seeds


def test_largest_seed_works_where_the_seed_is_used():
    # numpy refuses negative seeds; jax.random.key keeps only 32 bits without x64, so 2**32
    # would silently train as seed 0.
    assert MAX_SEED == 2**32 - 1
    np.random.default_rng([MAX_SEED, 1, 0]).integers(10)
    key = jax.random.key(MAX_SEED)
    assert int(jax.random.key_data(key)[-1]) == MAX_SEED
    jax.random.fold_in(jax.random.PRNGKey(MAX_SEED), 3)
    assert Config(seed=MAX_SEED).seed == MAX_SEED and Config(seed=0).seed == 0


@pytest.mark.parametrize("seed", ["-5", str(2**32), "12345678901234567890"])
def test_seed_out_of_range_is_one_line(seed, capsys, tmp_path):
    code, out, err = run_main([QUICKSTART, "--set", f"seed={seed}",
                               "--out", str(tmp_path / "run")], capsys)  # fmt: skip
    assert_one_line_error(code, out, err, [f"seed={seed}", "'seed'", str(MAX_SEED)])


# ------------------------------------------------------------------ 4. names


@pytest.mark.parametrize("name", ["..", ".", "a/b", "a\0b", "x" * 256])
def test_name_must_be_one_folder_name(name, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no runs/ folder: the output would be runs/<name>
    code, out, err = run_main([QUICKSTART, "--set", f"name={name}"], capsys)
    assert_one_line_error(code, out, err, ["'name'", "folder name"])
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ConfigError, match="'name'"):
        Config(name=name)


def test_ordinary_names_are_fine():
    assert Config(name="x" * 255).name == "x" * 255
    assert Config(name="run-2.b_c").name == "run-2.b_c"


# ------------------------------------------------------------------ 5. inject_nonfinite


def test_injection_past_the_last_step_is_refused(capsys, tmp_path):
    argv = [QUICKSTART, "--set", "steps=5", "inject_nonfinite=99:0", "--out", str(tmp_path)]
    code, out, err = run_main(argv, capsys)
    assert_one_line_error(code, out, err, ["'inject_nonfinite'", "steps = 5", "'99:0'"])
    assert Config(steps=5, inject_nonfinite="5:0").injection() == (5, 0)


@pytest.mark.parametrize(
    "args",
    [
        ["--workers", "16", "--set", "inject_nonfinite=1:10"],
        ["--set", "inject_nonfinite=1:10", "workers=16"],
        ["--set", "workers=16", "inject_nonfinite=1:10"],
    ],
)
def test_injection_sees_the_runs_workers(args, capsys, tmp_path):
    # An unknown algorithm fails after the config's checks passed: nothing trains.
    code, out, err = run_main([QUICKSTART, *args, "--set", "algorithms=nope", "--out",
                               str(tmp_path / "run")], capsys)  # fmt: skip
    assert_one_line_error(code, out, err, ["unknown algorithm 'nope'"])
    code, out, err = run_main([QUICKSTART, *args, "--workers", "4", "--out",
                               str(tmp_path / "run")], capsys)  # fmt: skip
    assert_one_line_error(code, out, err, ["'inject_nonfinite'", "workers = 4", "'1:10'"])


def test_workers_and_batch_size_checked_together(capsys, tmp_path):
    # 512 workers of 32 rows exceed the 8192 rows; of 16 rows they fit: the override and
    # --workers are checked together, not the workers against the config's batch first.
    argv = [QUICKSTART, "--workers", "512", "--set", "steps=5", "batch_size=16", "algorithms=nope"]
    code, out, err = run_main([*argv, "--out", str(tmp_path / "run")], capsys)
    assert_one_line_error(code, out, err, ["unknown algorithm 'nope'"])
    code, out, err = run_main([QUICKSTART, "--workers", "1000", "--out", str(tmp_path)], capsys)
    assert_one_line_error(code, out, err, ["with workers = 1000", "'batch_size'"])


# ------------------------------------------------------------------ 6. CONFIG lookup


def test_bare_name_is_a_bundled_config_even_with_a_file_of_that_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "quickstart").write_text("x\n")
    from shoal.experiments.runner.arguments import load_argument

    assert load_argument("quickstart").name == "quickstart"


def test_bare_name_of_a_file_says_configs_end_in_py(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine").write_text("x\n")
    code, out, err = run_main(["mine"], capsys)
    assert_one_line_error(code, out, err, ["not found: mine", "quickstart", "end in .py"])
    code, out, err = run_main(["./mine"], capsys)  # a path: a file, but not a config
    assert_one_line_error(code, out, err, ["./mine", "end in .py"])


def test_missing_py_path_is_not_found(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(["quickstart.py"], capsys)  # a path, not the bundled name
    assert_one_line_error(code, out, err, ["config file not found: quickstart.py"])
