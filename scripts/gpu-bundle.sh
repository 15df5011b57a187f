#!/usr/bin/env bash
# Builds .devgpu/: what tests/gpu and bench/gpu_bench.py need on a lent GPU machine that has
# no network and a different Python (3.12) from this checkout's .venv. Run it here (it needs
# the network, Python 3.12, gcc, libfuse3-dev and pkg-config); then carry .devgpu to the
# device and run scripts/gpu-device.sh there (bench/README.md, "On a lent GPU machine").
#
#   .devgpu/wheels/    cp312 wheels the device lacks (installed there always)
#   .devgpu/fallback/  wheels of what the device is said to have (installed only if missing)
#   .devgpu/ext/       the project's cffi modules (abi3) built here, copied into the tree there
#   .devgpu/lib/       libfuse3.so.3 (used there only where the system has none)
#   .devgpu/bin/       fusermount3 (likewise)
#   .devgpu/cuda-sim/  the CUDA driver simulator prebuilt, for a device without a C compiler
#                      (tests/gpu/test_gpu_bench.py runs the bench on the simulator)
#
# Versions are those of .venv where it has the package (what the tests ran with here), else
# the pins below. Environment: PY312 (the Python 3.12 to build with), GPU_BUNDLE (the output
# directory, default .devgpu).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY312=${PY312:-}
if [ -z "$PY312" ]; then
  for p in /root/.pyenv/versions/3.12*/bin/python3.12 python3.12; do
    # (a pyenv shim answers `command -v` but may not run)
    if "$p" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      PY312=$(command -v "$p"); break
    fi
  done
fi
[ -n "$PY312" ] || { echo "gpu-bundle: no Python 3.12 (set PY312)" >&2; exit 1; }
OUTDIR=${GPU_BUNDLE:-$ROOT/.devgpu}

# name==version: .venv's version where it has the package, else this pin
pins=(cffi==2.1.1 pycparser==3.12 trio==0.35.0 outcome==1.3.0.post0 sniffio==1.3.1
      pyzmq==27.3.0 crc32c==2.9.post0 sdnotify==0.3.2 pyfuse3==3.5.0)
fallback_pins=(attrs==26.1.0 idna==3.20 sortedcontainers==2.4.0 msgpack==1.2.4
               PyYAML==6.0.4)
# Not carried: boto3/botocore/s3transfer/jmespath (imported only where a remote tier is
# configured, bluecached/compose.py), exceptiongroup (trio needs it below Python 3.11 only).

venv_version() {   # the version .venv has of $1, or nothing
  [ -x .venv/bin/python ] || return 0
  .venv/bin/python - "$1" <<'EOF' 2>/dev/null || true
import importlib.metadata as m, sys
print(m.version(sys.argv[1]))
EOF
}

resolve() {   # name==pin -> name==version
  local name=${1%%==*} pin=${1#*==} have
  have=$(venv_version "$name")
  echo "$name==${have:-$pin}"
}

work=$(mktemp -d "${TMPDIR:-/tmp}/bc-gpu-bundle.XXXXXX")
trap 'rm -rf "$work"' EXIT
new=$work/devgpu
mkdir -p "$new"/{wheels,fallback,ext,lib,bin,cuda-sim}

pip312() {   # (less the noise of index locations in pip's configuration that are missing)
  "$PY312" -m pip --disable-pip-version-check "$@" 2> >(grep -v "^WARNING: Location " >&2)
}
binary=(--only-binary=:all: --no-deps --python-version 3.12 --implementation cp --abi cp312
        --abi abi3 --abi none --platform manylinux_2_28_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
        --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)

# 1. wheels: binary ones downloaded; sdist-only ones (pyfuse3: its C extension against this
#    machine's libfuse3; sdnotify: pure Python) built with Python 3.12
from_source=(pyfuse3 sdnotify)
for spec in "${pins[@]}"; do
  spec=$(resolve "$spec")
  name=${spec%%==*}
  if [[ " ${from_source[*]} " == *" $name "* ]]; then
    echo "gpu-bundle: building $spec with $("$PY312" -V)" >&2
    pip312 wheel -q --no-deps -w "$new/wheels" "$spec"
  else
    echo "gpu-bundle: downloading $spec" >&2
    pip312 download -q "${binary[@]}" -d "$new/wheels" "$spec"
  fi
done
for spec in "${fallback_pins[@]}"; do
  spec=$(resolve "$spec")
  echo "gpu-bundle: downloading $spec (fallback)" >&2
  pip312 download -q "${binary[@]}" -d "$new/fallback" "$spec"
done

# 2. the project's cffi modules for Python 3.12 (abi3), built from a copy of the work tree's
#    files that would travel (the tree's own build products are left alone)
src=$work/src
mkdir -p "$src"
git ls-files -z --cached --others --exclude-standard | \
  (while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done) | \
  xargs -0 cp --parents -t "$src"
# what the native modules were built from (gpu-device.sh warns where the tree differs)
(cd "$src" && find native setup.py -type f \( -name '*.c' -o -name '*.h' -o -name '*.py' \
   -o -name '*.map' \) -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1) \
  > "$new/native.sha256"
cffi_version=$(resolve cffi==2.1.1)
"$PY312" -m venv "$work/build-venv"
"$work/build-venv/bin/pip" install -q --disable-pip-version-check setuptools wheel \
  "$cffi_version" "$(resolve pycparser==3.12)"
echo "gpu-bundle: building the project's native modules with $cffi_version" >&2
(cd "$src" && "$work/build-venv/bin/pip" wheel -q --no-deps --no-build-isolation \
   -w "$work/project" .)
(cd "$new/ext" && "$work/build-venv/bin/python" - "$work"/project/bluecache-*.whl <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    sos = [n for n in z.namelist() if n.endswith(".so")]
    for n in sos:
        z.extract(n, ".")
    print("gpu-bundle: native modules:", ", ".join(sos), file=sys.stderr)
    if len(sos) < 3:
        sys.exit("gpu-bundle: expected the fuse shim, the DOCA simulator and stream_copy")
EOF
)

# 3. libfuse3 and fusermount3 of this machine
cp -L /usr/lib/x86_64-linux-gnu/libfuse3.so.3 "$new/lib/"   # a plain file (links may not travel)
cp "$(command -v fusermount3)" "$new/bin/"
# py-spy (a static binary) for the profile step, where this machine's venv has it
[ -x .venv/bin/py-spy ] && cp .venv/bin/py-spy "$new/bin/"

# 4. the CUDA driver simulator, compiled as tests/cuda_sim.py compiles it
cc -O2 -Wall -Wextra -Werror -shared -fPIC -Wl,-soname,libcuda.so.1 \
   -o "$new/cuda-sim/libcuda.so.1" "$src/native/cuda_sim/cuda_sim.c" -lpthread
sha256sum < "$src/native/cuda_sim/cuda_sim.c" | cut -d' ' -f1 > "$new/cuda-sim/source.sha256"

{
  echo "built $(date -u +%FT%TZ) from $(git rev-parse HEAD) by $("$PY312" -V)"
  (cd "$new" && find . -type f -printf '%s\t%p\n' | sort -k2)
} > "$new/MANIFEST"
rm -rf "$OUTDIR"
mv "$new" "$OUTDIR"
echo "gpu-bundle: $OUTDIR: $(du -sh "$OUTDIR" | cut -f1)" >&2
