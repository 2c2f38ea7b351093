"""The documentation's generated pages, made from the code each time the site is built.

mkdocs-gen-files runs this file (mkdocs.yml) and `pages` writes, in memory only:

- ``getting_started.md``: ``docs/templates/getting_started.md`` with the sections of the
  guide's pages (``docs/guide/*.md``) put in where it names them (a section that is gone
  fails the build);
- ``results/reproduce.md``: ``docs/templates/reproduce.md`` with the README's "Does it
  reproduce?" section, the table of the field's claims measured;
- ``algorithms/<name>.md`` for every registered algorithm (`shoal.experiments.algorithms`),
  each put in the nav after ``algorithms/index.md``, the overview;
- ``api/<package>.md`` for shoal.comms, shoal.optim, shoal.kernels, shoal.costmodel,
  listing their ``__all__``;
- ``cli.md``: ``shoal-run``'s options from its argparse parser and every ``--set`` key
  of `Config`;
- ``mathjax/``: MathJax 2 from the jupyter-server-mathjax package, which renders the
  tutorials' TeX in the browser without loading anything from the network
  (``docs/javascripts/mathjax.js`` configures it);
- ``tutorials/NN_name.ipynb``: the notebooks of ``notebooks/`` as they are committed
  (empty outputs), which mkdocs-jupyter executes top to bottom while it builds their
  pages (a cell that raises fails the build), each put in the nav after
  ``tutorials/index.md``, their list.

tests/test_docs.py imports this file to check that the pages cover the registry.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import html
import importlib
import inspect
import os
import re
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("comms", "optim", "kernels", "costmodel")


# --- Getting started: sections of README.md and the guide's pages ---------------------------


def readme_section(text: str, title: str) -> str:
    """The section of a Markdown text headed ``title`` (``## title``, or ``# title`` for a
    page's own title) up to the next heading of its level or above outside a code fence,
    as a ``## `` section: its headings moved by as many levels. `KeyError` if there is none."""
    out: list[str] = []
    level = 0
    fence = None
    for line in text.splitlines():
        stripped = line.lstrip()
        heading = re.match(r"(#{1,6}) (.*)$", line) if fence is None else None
        if out and heading and len(heading.group(1)) <= level:
            break
        if not out and heading and heading.group(2) == title:
            level = len(heading.group(1))
            out.append(line)
            continue
        if out:
            if heading:
                line = "#" * min(6, len(heading.group(1)) + 2 - level) + " " + heading.group(2)
            out.append(line)
            if stripped.startswith(("```", "~~~")):
                marker = stripped[:3]
                fence = None if fence == marker else (fence or marker)
    if not out:
        raise KeyError(f"no section '{title}'")
    out[0] = f"## {title}"
    return "\n".join(out).rstrip() + "\n"


def relink(text: str, source: str, page: str) -> str:
    """``text``, a section of ``source`` (a path from the repository root), with its
    relative Markdown links to pages under docs/ made relative to ``page`` (a path under
    docs/), where the section is put: ``docs/results/causes.md`` in README.md is
    ``causes.md`` on ``results/reproduce.md``."""
    docs, here = ROOT / "docs", (ROOT / "docs" / page).parent

    def fix(m: re.Match) -> str:
        target, anchor = m.group(2).partition("#")[::2]
        if not target or re.match(r"[a-z]+:", target):
            return m.group(0)  # an anchor on the same page, or a URL
        path = ((ROOT / source).parent / target).resolve()
        if docs not in path.parents:
            return m.group(0)  # not a page of the site: left for the strict build to name
        new = os.path.relpath(path, here) + (f"#{anchor}" if anchor else "")
        return f"[{m.group(1)}]({new})"

    return re.sub(r"\[([^\]]+)\]\(([^)\s]+)\)", fix, text)


def from_template(name: str, page: str) -> str:
    """``docs/templates/<name>`` with every ``<!-- FILE: title -->`` line replaced by that
    section of FILE (a path from the repository root: ``README.md``,
    ``docs/guide/install.md``), its links made relative to ``page``, where it goes."""
    template = (ROOT / "docs" / "templates" / name).read_text()

    def section(m: re.Match) -> str:
        path, title = m.group(1), m.group(2)
        try:
            return relink(readme_section((ROOT / path).read_text(), title), path, page)
        except KeyError:
            raise KeyError(f"{path} has no section '{title}'") from None

    return re.sub(r"^<!-- (\S+\.md): (.+?) -->$", section, template, flags=re.M)


# --- Algorithms -----------------------------------------------------------------------------


def optim_functions(build) -> list[str]:
    """The `shoal.optim` names a builder's code refers to (``optim.diloco(...)``,
    ``p.rule(optim.onebit_lamb, ...)``), in order of first use."""
    import shoal.optim

    tree = ast.parse(textwrap.dedent(inspect.getsource(build)))
    found = sorted(
        (node.lineno, node.col_offset, node.attr)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "optim"
        and node.attr in shoal.optim.__all__
    )
    return list(dict.fromkeys(name for _, _, name in found))


def optim_function(name: str, build) -> str | None:
    """The one `shoal.optim` function an algorithm runs: the only one its builder calls,
    or among several the one of its own name (``sparta`` around ``diloco``); else None."""
    found = optim_functions(build)
    if len(found) == 1:
        return found[0]
    return name if name in found else None


def _check_texts(cls) -> dict[str, str]:
    """Field name -> the allowed values a ``check_field(cond, "field", "allowed")`` states,
    read from the ``check`` methods of ``cls`` and its bases and from the module functions
    they call (``check_clip``)."""
    out: dict[str, str] = {}

    def scan(func, depth: int) -> None:
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
        except (OSError, TypeError):
            return
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            if node.func.id == "check_field" and len(node.args) == 3:
                field, allowed = node.args[1], node.args[2]
                if isinstance(field, ast.Constant) and isinstance(allowed, ast.Constant):
                    out.setdefault(field.value, allowed.value)
            elif depth:
                called = getattr(inspect.getmodule(func), node.func.id, None)
                if inspect.isfunction(called):
                    scan(called, depth - 1)

    for klass in cls.__mro__:
        if "check" in vars(klass):
            scan(vars(klass)["check"], 1)
    return out


@dataclasses.dataclass(frozen=True)
class Param:
    path: str  # "diloco.outer.momentum"
    default: object
    type: str
    allowed: str


def hyper_params(cls, prefix: str) -> list[Param]:
    """Every settable path of a `Hyper` dataclass, nested parts walked recursively."""
    from shoal.experiments.algorithms import Hyper

    allowed = _check_texts(cls)
    rows = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        path = f"{prefix}.{f.name}"
        if isinstance(default, Hyper):
            rows.extend(hyper_params(type(default), path))
        else:
            kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
            rows.append(Param(path, default, kind, allowed.get(f.name, "")))
    return rows


@functools.cache
def _test_index() -> dict[str, tuple[frozenset[str], tuple[str, ...]]]:
    """Per test file: the names it imports from shoal.optim or reads as ``optim.name``,
    and its short string constants."""
    index = {}
    for p in sorted((ROOT / "tests").glob("test_*.py")):
        if p.name == "test_docs.py":  # names algorithms to check these pages, not them
            continue
        names, strings = set(), []
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "shoal.optim":
                names.update(a.name for a in node.names)
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "optim"
            ):
                names.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                if len(node.value) < 200 and not node.value.startswith(("shoal.", "test_")):
                    strings.append(node.value)
        index[p.relative_to(ROOT).as_posix()] = (frozenset(names), tuple(strings))
    return index


def tests_of_function(func: str) -> list[str]:
    """The test files that import ``func`` from shoal.optim or call ``optim.func``."""
    return [path for path, (names, _) in _test_index().items() if func in names]


def tests_of_entry(name: str) -> list[str]:
    """The test files that name the runner entry ``name`` in a string (``"diloco"``,
    ``"diloco[sync_every=20]"``, ``"ssgd,diloco"``)."""
    word = re.compile(rf"(?<![\w.]){re.escape(name)}(?![\w])")
    return [
        path for path, (_, strings) in _test_index().items() if any(word.search(s) for s in strings)
    ]


def references(doc: str) -> str:
    """A docstring's ``References:`` (or ``Reference:``) section, else its author-year
    citations, else ""."""
    m = re.search(r"^( *)References?:[ \t]*(.*?)(?=\n\1\S|\n\s*\n\1\S|\Z)", doc, re.S | re.M)
    if m:
        return " ".join(m.group(2).split())
    cites = re.findall(r"\b[A-Z][\w-]+(?: et al\.)?,? (?:19|20)\d\d\b", doc)
    return "; ".join(dict.fromkeys(cites))


def _markdown_docstring(doc: str) -> str:
    """A module docstring as Markdown: reST's ``::`` before a literal block becomes ``:``
    (the indented block is a Markdown code block as it stands)."""
    return re.sub(r"::$", ":", inspect.cleandoc(doc), flags=re.M)


def _code(value) -> str:
    """``value`` as inline code (a table cell's pipes are safe inside backticks)."""
    return f"`{value!r}`"


def _cell(text: str) -> str:
    """Prose for a table cell: one line, and outside code spans (where the table reads
    them as they are) its pipes escaped and its ``<`` and ``>`` too (``runs/<name>`` is
    not an HTML tag)."""
    parts = " ".join(text.split()).split("`")
    parts[::2] = [html.escape(p, quote=False).replace("|", "\\|") for p in parts[::2]]
    return "`".join(parts)


def _allowed(p: Param) -> str:
    """What a value may be: its ``check()`` text, else a ``Literal``'s values, else its type."""
    if p.allowed:
        return _cell(p.allowed)
    literal = re.fullmatch(r"Literal\[(.*)\]", p.type)
    if literal:
        return "one of " + ", ".join(f"`{v.strip()}`" for v in literal.group(1).split(","))
    return f"`{p.type}`"


def _files(paths: list[str]) -> str:
    return ": " + ", ".join(f"`{p}`" for p in paths) + "." if paths else ": none found."


def algorithm_page(algo) -> str:
    """One algorithm's page: its module's docstring, hyper-parameters, paper, tests and
    the `shoal.optim` function it runs, rendered by mkdocstrings."""
    import shoal.optim
    from shoal.experiments.algorithms import FAMILIES

    module = inspect.getmodule(algo.build)
    module_doc = inspect.getdoc(module) or ""
    func = optim_function(algo.name, algo.build)
    func_doc = inspect.getdoc(getattr(shoal.optim, func)) if func else ""
    flags = [f"family **{algo.family}** ({FAMILIES[algo.family]})"]
    if algo.reference:
        flags.append("the reference every other entry is compared with")
    if algo.two_tier:
        flags.append("two-tier (`group_size` workers per group)")
    if algo.compares_to:
        flags.append(f"compared with [`{algo.compares_to}`]({algo.compares_to}.md)")
    if algo.churn:
        flags.append("runs under `churn`")
    if algo.turns:
        flags.append("takes turns with `in_turn`")
    if algo.asynchronous:
        flags.append("asynchronous outer steps, simulated on the clock")
    src = Path(module.__file__).resolve().relative_to(ROOT).as_posix()
    lines = [
        f"# {algo.name}",
        "",
        f"Registered in `{src}` ({module.__name__}): " + "; ".join(flags) + ".",
        "",
        _markdown_docstring(module_doc),
        "",
        "## Select it",
        "",
        "A config names it in `algorithms`; on the command line, `--set` replaces the"
        " config's list (CONFIG: a config file or a bundled config's name):",
        "",
        "```sh",
        f"shoal-run CONFIG --set algorithms={algo.name}",
        "```",
        "",
        "## Hyper-parameters",
        "",
        f"Each path is a `--set` key for the whole run (`--set {algo.name}.<path>=VALUE`),"
        f" or, without the leading `{algo.name}.`, a bracketed override of one entry"
        f' (`--set "algorithms={algo.name}[<path>=VALUE]"`). The allowed values are what'
        f" the parameters' `check()` states; `{algo.params.__name__}`'s annotations are"
        " checked too.",
        "",
        "| `--set` key | default | allowed |",
        "|---|---|---|",
    ]
    for p in hyper_params(algo.params, algo.name):
        lines.append(f"| `{p.path}` | {_code(p.default)} | {_allowed(p)} |")
    ref = references(func_doc) or references(module_doc)
    lines += ["", "## Paper", "", ref or "None given in the docstrings.", "", "## Tests", ""]
    entry_tests = tests_of_entry(algo.name)
    if func:
        tested = _files(tests_of_function(func))
        lines += [f"The transformation `shoal.optim.{func}` is checked by{tested}", ""]
    lines += [f"The runner entry `{algo.name}` is named by{_files(entry_tests)}", ""]
    if func:
        lines += [
            "## The transformation",
            "",
            f"::: shoal.optim.{func}",
            "    options:",
            "      heading_level: 3",
            "",
        ]
    else:
        lines += [
            "## The transformation",
            "",
            "No single `shoal.optim` function runs this entry (its builder calls "
            + (", ".join(f"`shoal.optim.{n}`" for n in optim_functions(algo.build)) or "none")
            + "): the module docstring above describes it.",
            "",
        ]
    return "\n".join(lines)


def algorithm_pages() -> dict[str, str]:
    """``algorithms/<name>.md`` for every registered algorithm, the index and the nav."""
    from shoal.experiments.algorithms import ALGORITHMS

    pages = {f"algorithms/{n}.md": algorithm_page(a) for n, a in sorted(ALGORITHMS.items())}
    rows = ["| algorithm | family | runs | summary |", "|---|---|---|---|"]
    for name, algo in sorted(ALGORITHMS.items()):
        func = optim_function(name, algo.build)
        runs = f"`shoal.optim.{func}`" if func else "(see its page)"
        doc = inspect.getdoc(inspect.getmodule(algo.build)) or ""
        first = _cell(doc.split("\n\n")[0])
        rows.append(f"| [{name}]({name}.md) | {algo.family} | {runs} | {first} |")
    pages["algorithms/index.md"] = "\n".join(
        [
            "# Algorithms",
            "",
            "Every algorithm `shoal-run` can train, one page each, generated from the registry"
            " (`shoal.experiments.algorithms`) when the site is built. A config names them in"
            " `algorithms` (`--set algorithms=ssgd,diloco`).",
            "",
            *rows,
            "",
        ]
    )
    return pages


def add_to_nav(nav: list, pages: dict[str, str], folder: str = "algorithms",
               title=lambda path: Path(path).stem) -> None:  # fmt: skip
    """Put every page of ``pages`` under ``folder/`` in mkdocs.yml's nav, after the
    section's ``Overview: folder/index.md``, each named ``title(path)``."""
    index = f"{folder}/index.md"
    for item in nav:
        for value in item.values() if isinstance(item, dict) else ():
            if isinstance(value, list) and {"Overview": index} in value:
                names = sorted(p for p in pages if p.startswith(f"{folder}/") and p != index)
                value[1:] = [{title(p): p} for p in names]
                return
    raise KeyError(f"mkdocs.yml's nav has no section with Overview: {index}")


# --- Tutorials: the notebooks, executed while the site is built --------------------------------


def notebook_title(text: str) -> str:
    """A notebook's first Markdown heading (its ``.ipynb`` JSON ``text``)."""
    import json

    for cell in json.loads(text)["cells"]:
        if cell["cell_type"] == "markdown":
            for line in "".join(cell["source"]).splitlines():
                if line.startswith("#"):
                    return line.lstrip("#").strip()
    raise ValueError("a tutorial notebook needs a Markdown heading for its title")


def tutorial_pages() -> dict[str, str]:
    """``tutorials/NN_name.ipynb`` for every committed notebook, and their index."""
    notebooks = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    pages = {f"tutorials/{nb.name}": nb.read_text() for nb in notebooks}
    rows = [f"- [{notebook_title(text)}]({Path(path).name})" for path, text in pages.items()]
    pages["tutorials/index.md"] = "\n".join([
        "# Tutorials",
        "",
        "The notebooks of `notebooks/`, executed top to bottom each time this site is built"
        " (a cell that raises fails the build), with their outputs. Open them in Jupyter"
        " from a clone (`.venv/bin/jupyter lab notebooks/`); each runs in about a minute on"
        " a laptop's CPU.",
        "",
        *rows,
        "",
    ])  # fmt: skip
    return pages


# --- API reference ---------------------------------------------------------------------------


def api_page(package: str) -> str:
    """One package's page: its docstring and every name of its ``__all__``."""
    module = importlib.import_module(f"shoal.{package}")
    members = "\n".join(f"        - {name}" for name in module.__all__)
    return "\n".join(
        [
            f"# shoal.{package}",
            "",
            f"Every public name of `shoal.{package}` (its `__all__`), with its source.",
            "",
            f"::: shoal.{package}",
            "    options:",
            "      show_root_heading: false",
            "      show_root_toc_entry: false",
            "      summary: true",
            "      members_order: alphabetical",
            "      members:",
            members,
            "",
        ]
    )


# --- CLI reference ---------------------------------------------------------------------------


def _field_comments(cls) -> dict[str, str]:
    """Field name -> the comment block above it in the class body, or for a field with
    none, the block above the fields before it (up to a blank line) if it names it
    (``speeds``' comment also says what ``compute_ms`` is)."""
    lines, _ = inspect.getsourcelines(cls)
    out: dict[str, str] = {}
    comment: list[str] = []
    above = ""
    for line in lines[1:]:
        s = line.strip()
        if s.startswith("#"):
            comment.append(s.lstrip("# ").rstrip())
            continue
        m = re.match(r"([a-z_]\w*)\s*:", s)
        if m and "(" not in s.split(":")[0]:
            name = m.group(1)
            if comment:
                above = " ".join(comment)
                out[name] = above
            elif re.search(rf"(?<![\w.]){name}(?!\w)", above):
                out[name] = above
        elif not s:
            above = ""
        comment = []
    return out


def cli_page() -> str:
    """``shoal-run``'s options (its argparse parser) and every ``--set`` key of `Config`."""
    import argparse

    from shoal.experiments.config import Config, RunFields, TaskFields
    from shoal.experiments.runner.arguments import build_parser

    parser = build_parser()
    lines = [
        "# CLI reference: `shoal-run`",
        "",
        "Generated from the parser (`experiments/runner/arguments.py`, `build_parser`) and"
        " the `Config` dataclass (`experiments/config.py`) when the site is built.",
        "",
        "```text",
        parser.format_usage().strip(),
        "```",
        "",
        _cell(parser.description or ""),
        "",
        "## Options",
        "",
        "| option | default | help |",
        "|---|---|---|",
    ]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            flag = "`-h`, `--help`"
        elif action.option_strings:
            meta = action.metavar or (
                "{" + ",".join(action.choices) + "}" if action.choices else action.dest.upper()
            )
            value = "" if action.nargs == 0 else f" {meta}"
            flag = ", ".join(f"`{o}{value}`" for o in action.option_strings)
        else:
            flag = f"`{action.metavar or action.dest.upper()}` (positional)"
        default = action.default
        unset = default is None or default is False or default == [] or default == argparse.SUPPRESS
        shown = "" if unset else _code(default)
        text = _cell(action.help or "")
        lines.append(f"| {flag} | {shown} | {text} |")
    lines += ["", _cell(parser.epilog or ""), ""]

    lines += [
        "## `--set` keys of the config",
        "",
        "`--set KEY=VALUE` overrides one field of the config's `Config` (a config file may"
        " return a subclass with more). Algorithms' hyper-parameters are"
        " `--set NAME.PATH=VALUE`: every path is listed on"
        " [its algorithm's page](algorithms/index.md).",
        "",
    ]
    for title, group in (("Run", RunFields), ("Task", TaskFields)):
        comments = _field_comments(group)
        lines += [
            f"### {title} fields",
            "",
            "| key | default | meaning |",
            "|---|---|---|",
        ]
        names = {f.name for f in dataclasses.fields(group)}
        for f in dataclasses.fields(Config):
            if f.name not in names:
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            comment = _cell(comments.get(f.name, ""))
            meaning = f"`{f.type}`" + (f": {comment}" if comment else "")
            tasks = f.metadata.get("tasks")
            if tasks:
                meaning += f" Read by the tasks {', '.join(tasks)} only."
            lines.append(f"| `{f.name}` | {_code(default)} | {meaning} |")
        lines.append("")
    lines += [
        "### `params`",
        "",
        " ".join(_field_comments(Config).get("params", "").split()),
        "",
    ]
    return "\n".join(lines)


# --- MathJax, for the tutorials' TeX ----------------------------------------------------------


def mathjax_files() -> dict[str, bytes]:
    """``mathjax/<path>`` for what MathJax 2 needs to render TeX (its loader, the
    combined TeX-in, HTML-CSS-out configuration, the extensions, the STIX-Web fonts;
    English only)."""
    import jupyter_server_mathjax

    static = Path(jupyter_server_mathjax.__file__).parent / "static"
    keep = ("MathJax.js", "LICENSE", "config/", "extensions/", "jax/", "fonts/HTML-CSS/",
            "localization/en/")  # fmt: skip
    out = {}
    for path in sorted(static.rglob("*")):
        rel = path.relative_to(static).as_posix()
        if path.is_file() and rel.startswith(keep):
            out[f"mathjax/{rel}"] = path.read_bytes()
    if "mathjax/MathJax.js" not in out:
        raise FileNotFoundError(f"no MathJax.js in {static}")
    return out


# --- All of them -----------------------------------------------------------------------------


def pages() -> dict[str, str]:
    """Every generated page: path under docs/ -> its Markdown (a tutorial's: its JSON)."""
    out = {
        "getting_started.md": from_template("getting_started.md", "getting_started.md"),
        "results/reproduce.md": from_template("reproduce.md", "results/reproduce.md"),
        "cli.md": cli_page(),
    }
    out.update(algorithm_pages())
    out.update({f"api/{p}.md": api_page(p) for p in PACKAGES})
    out.update(tutorial_pages())
    return out


if __name__ == "<run_path>":  # run by mkdocs-gen-files (runpy.run_path)
    import mkdocs_gen_files

    generated = pages()
    for path, text in generated.items():
        with mkdocs_gen_files.open(path, "w") as f:
            f.write(text)
    for path, data in mathjax_files().items():
        with mkdocs_gen_files.open(path, "wb") as f:
            f.write(data)
    add_to_nav(mkdocs_gen_files.config.nav, generated)
    titles = {p: notebook_title(t) for p, t in generated.items() if p.endswith(".ipynb")}
    add_to_nav(mkdocs_gen_files.config.nav, generated, "tutorials", titles.__getitem__)
