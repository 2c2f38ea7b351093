#!/usr/bin/env bash
# `make wheel-check` (not part of `make test`: a minute or more, mostly installing jax):
# what a user gets from `pip install shoal-*.whl`, checked outside the repository.
#
#   bash tests/jobs/wheel_check.sh [BUILD_PYTHON]   default: .venv/bin/python (has `build`)
#
# 1. Copies the working tree (tracked and untracked files that git does not ignore; the
#    links shoal/comms -> ../comms, ... stay links) to a temporary folder: no stale
#    *.egg-info or build/ of the checkout reaches the build.
# 2. `python -m build` there: the sdist, then the wheel built from that sdist. The sdist must
#    hold the linked folders as plain files (no link), and the wheel must hold every .py
#    file under shoal/ (links followed): a folder without __init__.py would be missing.
# 3. Installs the wheel into a fresh venv with an empty pip cache (dependencies from the
#    registry, without the mpi extra) and, from a folder outside the repository, imports
#    every module pkgutil.walk_packages finds in shoal. A module may be skipped only when
#    its import fails because mpi4jax (the optional `mpi` extra) is missing. Then
#    `shoal-run --help` through the installed console script.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
BUILD_PY="${1:-$ROOT/.venv/bin/python}"
VENV_PY="${PYTHON:-python3}"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
export PIP_NO_CACHE_DIR=1 XDG_CACHE_HOME="$TMP/cache" JAX_PLATFORMS=cpu
start=$SECONDS

echo "== copy of the working tree: $TMP/src"
mkdir "$TMP/src"
(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard |
    while IFS= read -r -d '' f; do
        if [ -e "$f" ] || [ -L "$f" ]; then printf '%s\0' "$f"; fi # not deleted files
    done |
    tar --null -T - -cf -) | tar -xf - -C "$TMP/src"

echo "== python -m build (sdist, then the wheel from it)"
"$BUILD_PY" -m build --outdir "$TMP/dist" "$TMP/src" > "$TMP/build.log" 2>&1 ||
    { cat "$TMP/build.log"; exit 1; }
SDIST=("$TMP"/dist/shoal-*.tar.gz)
WHEEL=("$TMP"/dist/shoal-*.whl)
echo "built $(basename "${SDIST[0]}") $(basename "${WHEEL[0]}")"

"$BUILD_PY" - "$TMP/src" "${SDIST[0]}" "${WHEEL[0]}" <<'EOF'
import os, sys, tarfile, zipfile
src, sdist, wheel = sys.argv[1:]
tree = set()
for dirpath, _, files in os.walk(os.path.join(src, "shoal"), followlinks=True):
    rel = os.path.relpath(dirpath, src)
    tree |= {os.path.join(rel, f) for f in files if f.endswith(".py")}
with tarfile.open(sdist) as tar:
    links = [m.name for m in tar.getmembers() if m.issym() or m.islnk()]
    # The sdist holds the package under src/ (src/shoal is the link to shoal/).
    in_sdist = {m.name.split("/", 1)[1].removeprefix("src/") for m in tar.getmembers()
                if m.isfile()}
with zipfile.ZipFile(wheel) as whl:
    in_wheel = {n for n in whl.namelist() if n.endswith(".py")}
problems = []
if links:
    problems.append(f"the sdist holds links, not files: {links}")
for name, got in (("sdist", in_sdist), ("wheel", in_wheel)):
    if missing := sorted(tree - got):
        problems.append(f"the {name} lacks {missing}")
if extra := sorted(in_wheel - tree):
    problems.append(f"the wheel holds files that shoal/ does not: {extra}")
if problems:
    sys.exit("\n".join(problems))
print(f"sdist and wheel: the {len(tree)} .py files under shoal/, as plain files")
EOF

echo "== fresh venv, pip install the wheel (empty pip cache)"
"$VENV_PY" -m venv "$TMP/venv"
"$TMP/venv/bin/python" -m pip install -q "${WHEEL[0]}" > "$TMP/pip.log" 2>&1 ||
    { cat "$TMP/pip.log"; exit 1; }

echo "== import every module of shoal"
cd "$TMP"
"$TMP/venv/bin/python" - "$TMP/venv" <<'EOF'
import importlib, os, pkgutil, sys
venv = os.path.realpath(sys.argv[1])
import shoal
assert os.path.realpath(shoal.__file__).startswith(venv), shoal.__file__
failed, skipped, imported = [], [], []

def walk_error(name):
    failed.append((name, repr(sys.exc_info()[1])))

names = ["shoal"] + [m.name for m in pkgutil.walk_packages(shoal.__path__, "shoal.", walk_error)]
for name in names:
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name == "mpi4jax":
            skipped.append(name)
        else:
            failed.append((name, repr(e)))
        continue
    except Exception as e:
        failed.append((name, repr(e)))
        continue
    if not os.path.realpath(module.__file__).startswith(venv):
        failed.append((name, f"imported from {module.__file__}, not the venv"))
    imported.append(name)
print(f"imported {len(imported)} modules; skipped (mpi4jax missing): {skipped or 'none'}")
for name, err in failed:
    print(f"FAILED {name}: {err}")
sys.exit(1 if failed or not imported else 0)
EOF
"$TMP/venv/bin/shoal-run" --help > /dev/null
echo "shoal-run --help: ok"
echo "wheel check passed in $((SECONDS - start)) s"
