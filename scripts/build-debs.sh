#!/usr/bin/env bash
# Builds the Debian packages from this checkout: bluecache-host (amd64) and bluecache-dpu (arm64).
#
#   scripts/build-debs.sh [--out DIR]
#
# The source tree (git's tracked and untracked-but-not-ignored files, as they are in the work tree)
# is copied into a temporary directory with packaging/debian as debian/ and built natively with
# dpkg-buildpackage -b: on amd64 that gives bluecache-host, on arm64 (a DPU, an arm64 machine or
# an arm64 qemu-user chroot: docs/packaging.md) bluecache-dpu.
# Needs: debhelper dh-python pybuild-plugin-pyproject python3-all-dev python3-setuptools
# python3-cffi libfuse3-dev pkg-config. The .deb, .buildinfo and .changes files land in DIR
# (default dist/debs).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

out=$root/dist/debs
while [ $# -gt 0 ]; do
  case $1 in
    --out) out=$2; shift 2 ;;
    --out=*) out=${1#--out=}; shift ;;
    --host-only) shift ;;  # accepted for compatibility: the build machine's arch decides
    -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "build-debs: unknown argument $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
out=$(cd "$out" && pwd)

work=$(mktemp -d /tmp/bluecache-debs.XXXXXX)
trap 'rm -rf "$work"' EXIT
src=$work/bluecache

# The source: what git knows of (tracked, plus new files not ignored), never build outputs.
mkdir -p "$src"
git ls-files -z --cached --others --exclude-standard \
  | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done \
  | grep -zv '^packaging/debian/' \
  | xargs -0 cp --parents -t "$src"
cp -r packaging/debian "$src/debian"

# pyenv/venv Pythons earlier on PATH break dh-python: build with the system's tools only.
clean_env=(env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME="$work" LANG=C.UTF-8
           DEB_BUILD_OPTIONS="${DEB_BUILD_OPTIONS:-nocheck}")

arch=$(dpkg --print-architecture)
case $arch in
  amd64) want=bluecache-host ;;
  arm64) want=bluecache-dpu ;;
  *) echo "build-debs: no package is built for $arch (amd64: bluecache-host, arm64: bluecache-dpu)" >&2
     exit 2 ;;
esac
echo "build-debs: $want ($arch)" >&2
(cd "$src" && "${clean_env[@]}" dpkg-buildpackage -us -uc -b) >"$work/build.log" 2>&1 \
  || { tail -40 "$work/build.log" >&2; echo "build-debs: build failed" >&2; exit 1; }

# dpkg-buildpackage writes next to the source directory.
find "$work" -maxdepth 1 -type f \( -name '*.deb' -o -name '*.buildinfo' -o -name '*.changes' \) \
  -exec cp -t "$out" {} +
ls -1 "$out"/*.deb
