#!/usr/bin/env bash
# Wheels of pagoda's runtime dependencies that the lent GPU machine (CPython 3.12, x86_64, no
# package index) lacks, for benchmarks/gpu_check.sh to install there. The machine's own list of
# packages is tools/gpu_preinstalled.txt; everything pagoda imports that is not on it is named
# below at the version this checkout is tested with.
#
#   tools/gpu_bundle.sh           # download into .whl/ (ignored), then check it
#   tools/gpu_bundle.sh --check   # check only
#
# The check: one version of each wheel, every wheel installable on cp312 manylinux x86_64 (pip's
# own tag matching, without an index), every non-optional requirement of every wheel (and of
# pyproject.toml) met by another wheel or by the machine's list, the folder under 40 MiB; and,
# where a python3.12 is found here, the wheels imported by it.
#
# Not bundled: model-signing, pyOpenSSL and what they pull in (pagoda.artifacts imports them
# when a signature is made or checked, nothing on the GPU path does); the test and otel extras
# (the CUDA subset imports none of them).
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=(
    fastapi==0.165.0
    starlette==1.10.0
    pydantic==2.14.4
    pydantic-core==2.50.5
    annotated-types==0.8.0
    typing-inspection==0.4.5
    uvicorn==0.54.0
    httptools==0.9.0
    llguidance==1.9.1
    gguf==0.19.0
    sniffio==1.3.1
    msgspec==0.22.0  # the executor channels between ranks
    opentelemetry-api==1.45.2  # fastapi.telemetry imports it
)
DIR=.whl
LIMIT_MIB=40
PYTHON=${PYTHON:-python3}
PLATFORMS=(manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux1_x86_64)
TARGET_ARGS=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none)
for p in "${PLATFORMS[@]}"; do TARGET_ARGS+=(--platform "$p"); done

if [[ "${1:-}" != --check ]]; then
    mkdir -p "$DIR"
    "$PYTHON" -m pip download -q --no-deps "${TARGET_ARGS[@]}" -d "$DIR" "${WHEELS[@]}"
fi

# Only the pinned versions: an older download left beside a newer one would stop the install.
"$PYTHON" - "$DIR" "${WHEELS[@]}" <<'EOF'
import re, sys
from pathlib import Path
folder, pins = Path(sys.argv[1]), sys.argv[2:]
norm = lambda name: re.sub(r"[-_.]+", "_", name).lower()
wanted = {norm(p.split("==")[0]): p.split("==")[1] for p in pins}
for wheel in sorted(folder.glob("*.whl")):
    name, version = wheel.name.split("-")[:2]
    if wanted.get(norm(name)) != version:
        print(f"removing {wheel.name} (not pinned)")
        wheel.unlink()
missing = sorted(set(wanted) - {norm(w.name.split("-")[0]) for w in folder.glob("*.whl")})
if missing:
    sys.exit(f"no wheel for {', '.join(missing)} in {folder}")
EOF

size_kib=$(du -sk "$DIR" | cut -f1)
echo "$DIR: $(ls "$DIR"/*.whl | wc -l) wheels, $((size_kib / 1024)) MiB"
if (( size_kib > LIMIT_MIB * 1024 )); then
    echo "$DIR is over ${LIMIT_MIB} MiB: the working tree travels in 64 MiB" >&2
    exit 1
fi

# pip's tag matching for the target, without an index and without the machine's packages.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PYTHON" -m pip install -q --no-index --no-deps --dry-run "${TARGET_ARGS[@]}" --target "$tmp/site" "$DIR"/*.whl
echo "every wheel installs on cp312 manylinux x86_64"

# Requirements: met by the bundle or the machine's list.
"$PYTHON" tools/gpu_bundle_check.py "$DIR" tools/gpu_preinstalled.txt pyproject.toml

# The wheels imported by a real CPython 3.12, where one is found here (the machine's own
# packages stand in from this interpreter's index: pure-Python ones only matter for import).
py312=
for candidate in python3.12 /root/.pyenv/versions/3.12*/bin/python3.12; do
    if "$candidate" -c pass 2>/dev/null; then py312=$candidate; break; fi
done
if [[ -n "$py312" ]]; then
    "$py312" -m pip install -q --no-index --no-deps --no-compile --target "$tmp/site" "$DIR"/*.whl
    "$py312" -m venv "$tmp/venv"
    "$tmp/venv/bin/python" -m pip install -q typing-extensions anyio h11 click numpy pyyaml tqdm annotated-doc idna
    PYTHONPATH="$tmp/site" "$tmp/venv/bin/python" -c "
import fastapi, starlette, pydantic, pydantic_core, uvicorn, httptools, llguidance, gguf, sniffio, msgspec
import uvicorn.protocols.http.httptools_impl
print('imported by', __import__('sys').version.split()[0] + ':', 'fastapi', fastapi.__version__, 'pydantic',
      pydantic.VERSION, 'llguidance', llguidance.__version__ if hasattr(llguidance, '__version__') else '?')"
else
    echo "no python3.12 here: the import check is skipped"
fi
