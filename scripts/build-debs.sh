#!/usr/bin/env bash
# Builds the Debian packages from this checkout: bluecache-host (amd64) and bluecache-dpu (arm64).
#
#   scripts/build-debs.sh [--arch native|amd64|arm64|all] [--arm64-root DIR] [--out DIR]
#
# The source tree (git's tracked and untracked-but-not-ignored files, as they are in the work tree)
# is copied into a temporary directory with packaging/debian as debian/ and built with
# dpkg-buildpackage -b for each architecture asked for (default: this machine's): amd64 gives
# bluecache-host, arm64 bluecache-dpu. A foreign arm64 build runs natively inside an arm64
# bookworm root under qemu-user (scripts/arm64-root.sh prepares it in DIR, default
# /var/cache/bluecache/arm64-build, and reuses it). `--arch all` builds both.
# Needs: debhelper dh-python pybuild-plugin-pyproject python3-all-dev python3-setuptools
# python3-cffi libfuse3-dev pkg-config; for arm64 on amd64 also qemu-user-static binfmt-support
# debootstrap. The .deb, .buildinfo and .changes files land in DIR (default dist/debs).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

out=$root/dist/debs
arches=native
arm64_root=/var/cache/bluecache/arm64-build
while [ $# -gt 0 ]; do
  case $1 in
    --out) out=$2; shift 2 ;;
    --out=*) out=${1#--out=}; shift ;;
    --arch) arches=$2; shift 2 ;;
    --arch=*) arches=${1#--arch=}; shift ;;
    --arm64-root) arm64_root=$2; shift 2 ;;
    --arm64-root=*) arm64_root=${1#--arm64-root=}; shift ;;
    -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "build-debs: unknown argument $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
out=$(cd "$out" && pwd)

work=$(mktemp -d /tmp/bluecache-debs.XXXXXX)
trap 'rm -rf "$work"' EXIT
src=$work/source

# The source: what git knows of (tracked, plus new files not ignored), never build outputs.
mkdir -p "$src"
git ls-files -z --cached --others --exclude-standard \
  | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done \
  | grep -zv '^packaging/debian/' \
  | xargs -0 cp --parents -t "$src"
cp -r packaging/debian "$src/debian"

native=$(dpkg --print-architecture)
case $arches in
  native) arches=$native ;;
  all) arches="amd64 arm64" ;;
  amd64|arm64) ;;
  *) echo "build-debs: --arch must be native, amd64, arm64 or all, not '$arches'" >&2; exit 2 ;;
esac

# pyenv/venv Pythons earlier on PATH break dh-python: build with the system's tools only.
clean_env=(env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8
           DEB_BUILD_OPTIONS="${DEB_BUILD_OPTIONS:-nocheck}")

package_of() { case $1 in amd64) echo bluecache-host ;; arm64) echo bluecache-dpu ;; esac; }

# dpkg-buildpackage writes next to the source directory: DIR/bluecache -> DIR/*.deb
collect() {
  find "$1" -maxdepth 1 -type f \( -name '*.deb' -o -name '*.buildinfo' -o -name '*.changes' \) \
    -exec cp -t "$out" {} +
}

build_native() {
  local arch=$1
  echo "build-debs: $(package_of "$arch") ($arch)" >&2
  mkdir "$work/$arch" && cp -a "$src" "$work/$arch/bluecache"
  (cd "$work/$arch/bluecache" && "${clean_env[@]}" dpkg-buildpackage -us -uc -b) \
    >"$work/build-$arch.log" 2>&1 \
    || { tail -40 "$work/build-$arch.log" >&2; echo "build-debs: $arch build failed" >&2; exit 1; }
  collect "$work/$arch"
}

# arm64 on amd64: the same native build inside an arm64 root, every binary run by qemu-user.
build_in_arm64_root() {
  bash "$root/scripts/arm64-root.sh" --build "$arm64_root"
  local job
  job=$(mktemp -d "$arm64_root/tmp/bluecache-build.XXXXXX")
  cp -a "$src" "$job/bluecache"
  mountpoint -q "$arm64_root/proc" || { mount -t proc proc "$arm64_root/proc"; mounted_proc=1; }
  echo "build-debs: bluecache-dpu (arm64, in $arm64_root under qemu-user)" >&2
  if ! chroot "$arm64_root" "${clean_env[@]}" sh -c "cd '${job#"$arm64_root"}/bluecache' &&
          dpkg-buildpackage -us -uc -b" >"$work/build-arm64.log" 2>&1; then
    tail -40 "$work/build-arm64.log" >&2
    echo "build-debs: arm64 build failed" >&2
    exit 1
  fi
  collect "$job"
  rm -rf "$job"
}

mounted_proc=0
trap 'if [ $mounted_proc = 1 ]; then umount "$arm64_root/proc"; fi; rm -rf "$work"' EXIT
for arch in $arches; do
  if [ "$arch" = "$native" ]; then
    build_native "$arch"
  elif [ "$arch" = arm64 ] && [ "$native" = amd64 ]; then
    build_in_arm64_root
  else
    echo "build-debs: cannot build $arch packages on $native" >&2
    exit 2
  fi
done
for arch in $arches; do
  ls -1 "$out"/"$(package_of "$arch")"_*_"$arch".deb
done
