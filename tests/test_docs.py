"""The documentation site (mkdocs.yml, docs/gen_pages.py): built strictly, it holds every
public name of shoal.comms, shoal.optim, shoal.kernels and shoal.costmodel, and a page for
every registered algorithm with its hyper-parameters; the generator follows the registry.

`make test-docs` runs this file on the site `make docs` built (SHOAL_DOCS_SITE); without
that variable the module builds the site itself into a temporary folder (about 5 minutes:
the tutorials are executed).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import harness
import pytest

from shoal import optim
from shoal.experiments.algorithms import ALGORITHMS, Algorithm, Hyper

pytestmark = pytest.mark.skipif(harness.UNDER_MPI, reason="builds the site in one process")

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("comms", "optim", "kernels", "costmodel")


def _gen_pages():
    spec = importlib.util.spec_from_file_location("gen_pages", ROOT / "docs" / "gen_pages.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


gen = _gen_pages()


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    given = os.environ.get("SHOAL_DOCS_SITE")
    if given:
        path = ROOT / given
        assert (path / "index.html").is_file(), f"SHOAL_DOCS_SITE={given}: no built site there"
        return path
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", DISABLE_MKDOCS_2_WARNING="true")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def missing_names(site: Path, package: str, names) -> list[str]:
    """The ``names`` that have no object heading on the package's API page."""
    html = (site / "api" / package / "index.html").read_text()
    return [n for n in names if f'id="shoal.{package}.{n}"' not in html]


def missing_pages(site: Path, names) -> list[str]:
    """The algorithm ``names`` that have no page on the site."""
    return [n for n in names if not (site / "algorithms" / n / "index.html").is_file()]


@pytest.mark.parametrize("package", PACKAGES)
def test_every_public_name_is_on_its_api_page(site, package):
    names = importlib.import_module(f"shoal.{package}").__all__
    assert names
    assert missing_names(site, package, names) == []


def test_every_registered_algorithm_has_a_page(site):
    assert missing_pages(site, sorted(ALGORITHMS)) == []
    index = (site / "algorithms" / "index.html").read_text()
    for name in ALGORITHMS:
        assert f'href="{name}/"' in index, name


def test_every_hyper_parameter_is_in_its_table(site):
    for name, algo in ALGORITHMS.items():
        html = (site / "algorithms" / name / "index.html").read_text()
        for p in gen.hyper_params(algo.params, name):
            assert f"<code>{p.path}</code>" in html, (name, p.path)
        func = gen.optim_function(name, algo.build)
        if func is not None:  # its transformation, rendered by mkdocstrings
            assert f'id="shoal.optim.{func}"' in html, (name, func)


def test_the_checks_fail_on_a_missing_page_or_name(site):
    assert missing_pages(site, ["diloco", "no_such_algorithm"]) == ["no_such_algorithm"]
    assert missing_names(site, "optim", ["diloco", "no_such_name"]) == ["no_such_name"]


def test_diloco_page():
    text = gen.pages()["algorithms/diloco.md"]
    assert "| `diloco.outer.momentum` | `0.9` | a float in [0, 1) |" in text
    assert "| `diloco.inner.use` | `'adamw'` | one of `'adamw'`, `'sgd'` |" in text
    assert "arXiv:2311.08105" in text  # the paper, from the transformation's References
    assert "`tests/test_diloco.py`" in text
    assert "::: shoal.optim.diloco" in text


def test_registry_maps_to_optim_functions():
    found = {n: gen.optim_function(n, a.build) for n, a in ALGORITHMS.items()}
    assert found["diloco"] == found["muloco"] == "diloco"
    assert found["ssgd"] == "allreduce_gradients"
    assert found["lamb"] == "onebit_lamb"  # through p.rule(optim.onebit_lamb, ...)
    assert found["sparta"] == "sparta"  # around diloco: the one of its own name
    assert found["async_diloco"] is None  # simulated on the clock, no one transformation


@dataclasses.dataclass(frozen=True)
class _Fake(Hyper):
    rate: float = 0.5


def _build_fake(p, ctx):
    return optim.allreduce_gradients(collective=ctx.comms)


def test_the_generator_follows_the_registry(monkeypatch):
    pages = gen.algorithm_pages()
    assert {f"algorithms/{n}.md" for n in ALGORITHMS} <= set(pages)
    # A newly registered algorithm gets its page with no edit to the docs.
    fake = Algorithm("fake_algorithm", _Fake, _build_fake, None, family="dense")
    monkeypatch.setitem(ALGORITHMS, "fake_algorithm", fake)
    page = gen.algorithm_pages()["algorithms/fake_algorithm.md"]
    assert "| `fake_algorithm.rate` | `0.5` |" in page
    assert "::: shoal.optim.allreduce_gradients" in page
    nav = [{"Algorithms": [{"Overview": "algorithms/index.md"}]}]
    gen.add_to_nav(nav, gen.algorithm_pages())
    assert {"fake_algorithm": "algorithms/fake_algorithm.md"} in nav[0]["Algorithms"]


def test_readme_sections_are_on_getting_started(site):
    html = (site / "getting_started" / "index.html").read_text()
    for title in ("Use shoal in your own project", "Compose shoal with optax"):
        assert title in html
    assert "AxisCollective" in html and "MPICollective" in html
    with pytest.raises(KeyError):  # a section the guide no longer has fails the build
        gen.readme_section("# x\n\n## Other\n", "Compose shoal with optax")


def test_the_reproduction_table_is_on_its_results_page(site):
    html = (site / "results" / "reproduce" / "index.html").read_text()
    readme = (ROOT / "README.md").read_text().split("## Does it reproduce?\n", 1)[1]
    table = [line for line in readme.split("\n## ", 1)[0].splitlines() if line.startswith("|")]
    assert "Does it reproduce?" in html and len(table) >= 10  # claims, header and rule
    for claim in (row.split("|")[1].split("`")[0].strip(" (") for row in table[2:]):
        assert claim.replace("&", "&amp;") in html  # its words, without the code after them


def test_cli_page_has_every_option_and_config_key(site):
    from shoal.experiments.config import Config
    from shoal.experiments.runner.arguments import build_parser

    html = (site / "cli" / "index.html").read_text()
    for action in build_parser()._actions:
        for option in action.option_strings:
            assert option in html, option
    for f in dataclasses.fields(Config):
        assert f"<code>{f.name}</code>" in html, f.name


def unexecuted_tutorials(site: Path) -> list[str]:
    """The committed notebooks that have no tutorial page with outputs on the site."""
    out = []
    for nb in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        page = site / "tutorials" / nb.stem / "index.html"
        # The committed notebooks have no outputs: any on the page, the build ran them.
        if not (page.is_file() and 'class="jp-OutputArea-child"' in page.read_text()):
            out.append(nb.name)
    return out


def test_every_notebook_is_an_executed_tutorial(site):
    import json

    assert unexecuted_tutorials(site) == []
    committed = json.loads((ROOT / "notebooks" / "01_tour.ipynb").read_text())
    assert all(not c.get("outputs") for c in committed["cells"])  # so the outputs are new
    index = (site / "tutorials" / "index.html").read_text()
    assert "A tour of shoal" in index and 'href="01_tour/"' in index
    # ... and the check fails on a site where a tutorial's page is missing.
    assert unexecuted_tutorials(site / "api") != []


def test_a_tutorial_that_raises_fails_the_build(tmp_path):
    """The site's own mkdocs-jupyter settings (from mkdocs.yml) on a one-notebook site: a
    cell that raises fails the build, and names the error."""
    import json

    import yaml

    class Loader(yaml.SafeLoader):  # mkdocs.yml may hold !!python tags: read them as text
        pass

    Loader.add_multi_constructor("", lambda loader, tag, node: None)
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)
    plugin = next(p["mkdocs-jupyter"] for p in config["plugins"]
                  if isinstance(p, dict) and "mkdocs-jupyter" in p)  # fmt: skip
    assert plugin["execute"] is True and plugin["allow_errors"] is False
    assert plugin["cache"] is False  # every build runs them: none is read from a cache
    docs = tmp_path / "docs" / "tutorials"
    docs.mkdir(parents=True)
    cells = [{"cell_type": "markdown", "metadata": {}, "source": "# Broken"},
             {"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [],
              "source": "raise ValueError('this tutorial is broken')"}]  # fmt: skip
    nb = {"cells": cells, "metadata": {"kernelspec": {"name": "python3", "language": "python",
          "display_name": "Python 3"}}, "nbformat": 4, "nbformat_minor": 5}  # fmt: skip
    (docs / "broken.ipynb").write_text(json.dumps(nb))
    (tmp_path / "docs" / "index.md").write_text("# Home\n")
    site = {"site_name": "t", "strict": True, "plugins": [{"mkdocs-jupyter": plugin}],
            "nav": [{"Home": "index.md"}, {"Broken": "tutorials/broken.ipynb"}]}  # fmt: skip
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(site))
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", DISABLE_MKDOCS_2_WARNING="true")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode != 0
    assert "this tutorial is broken" in proc.stdout + proc.stderr


def test_the_tutorials_maths_is_rendered_from_local_files(site):
    """Every script a tutorial page loads is on the site (MathJax's own files, copied in
    from jupyter-server-mathjax), none from the network, and MathJax is configured to
    read the tutorials' TeX."""
    import re

    page = site / "tutorials" / "07_diloco" / "index.html"
    html = page.read_text()
    scripts = re.findall(r'<script src="([^"]+)"', html)
    assert "../../mathjax/MathJax.js" in scripts
    for src in filter(None, scripts):
        assert not src.startswith(("http:", "https:", "//")), src
        assert (page.parent / src.split("?")[0]).resolve().is_file(), src
    config = (site / "javascripts" / "mathjax.js").read_text()
    combined = re.search(r'config: \["([^"]+)"\]', config).group(1)
    assert (site / "mathjax" / "config" / combined).is_file()
    assert "$\\theta_g$" in html or "\\theta_g" in html  # the TeX MathJax typesets


def test_a_copied_sections_links_point_from_its_new_page():
    text = "See [causes](docs/results/causes.md#dilo), [x](https://a.b/c) and [y](#here)."
    moved = gen.relink(text, "README.md", "results/reproduce.md")
    assert moved == "See [causes](causes.md#dilo), [x](https://a.b/c) and [y](#here)."
    assert gen.relink("[m](mesh.md)", "docs/guide/mpi.md", "getting_started.md") == (
        "[m](guide/mesh.md)"
    )
