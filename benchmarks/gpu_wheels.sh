#!/usr/bin/env bash
# Download the wheels benchmarks/gpu_check.sh installs on a GPU machine without network.
#
# Run where pip reaches PyPI, from the repository root; the wheels land in .whl/ (ignored by
# git), which travels with the checkout. The GPU machine needs only a CUDA torch:
# gpu_check.sh installs these with --no-index into /tmp/site.
#
#   bash benchmarks/gpu_wheels.sh                     # CPython 3.12, x86-64 Linux
#   PY_VERSIONS="3.11 3.12" bash benchmarks/gpu_wheels.sh
#
# The pins are versions the test suite passes with. Requires-Dist of each wheel is checked at
# the end: a dependency missing from .whl/ is printed (and fails the script).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.whl
PY_VERSIONS=${PY_VERSIONS:-3.12}
# Plugin runtime (pydantic, pyyaml) and the test runner (pytest, hypothesis) with their deps.
PINS=(
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing_extensions==4.16.0 pyyaml==6.0.4
  pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4 pygments==2.21.0
  hypothesis==6.170.17 sortedcontainers==2.4.0
  # NeMo-RL's loss module (the comparison): pyzmq, which the image lacks, and a transformers
  # below the 5.12 that NeMo-RL asserts (the image has 5.17) with the tokenizers it accepts.
  pyzmq==27.3.0 transformers==5.8.1 tokenizers==0.22.2
)
mkdir -p "$DEST"
for py in $PY_VERSIONS; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$DEST" "${PINS[@]}"
done
# Every dependency that applies on Linux CPython >= 3.11 must be among the wheels (attrs is
# not: hypothesis 6.170 dropped it; colorama is Windows-only).
# Packages the GPU image already has (transformers' other needs) count as present.
python3 - "$DEST" <<'PY'
import pathlib, re, sys, zipfile
dest = pathlib.Path(sys.argv[1])
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
IMAGE = {"huggingface-hub", "numpy", "regex", "typer", "safetensors", "tqdm"}
have = {norm(w.name.split("-")[0]) for w in dest.glob("*.whl")} | IMAGE
missing = set()
for w in dest.glob("*.whl"):
    with zipfile.ZipFile(w) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for line in z.read(meta).decode().splitlines():
            if line.startswith("Requires-Dist:") and "extra ==" not in line:
                name = norm(re.split(r"[ ;<>=!~\[(]", line.split(":", 1)[1].strip())[0])
                marker = line.replace("'", '"')
                if any(m in marker for m in ('sys_platform == "win32"', 'python_version < "3.1', 'implementation_name == "pypy"')):
                    continue  # Windows only, Python < 3.10/3.11 (exceptiongroup, tomli), or PyPy only (cffi)
                if name not in have:
                    missing.add(f"{name} (needed by {w.name})")
print(f"{len(list(dest.glob('*.whl')))} wheels in {dest}/")
if missing:
    print("missing:", *sorted(missing), sep="\n  ")
    sys.exit(1)
PY
