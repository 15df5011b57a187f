#!/usr/bin/env bash
# Builds the container images without any registry: a debootstrapped Debian 12 (bookworm) root
# with the project's own .deb installed, imported with podman, saved as an OCI archive.
#
#   scripts/build-images.sh [--arch amd64|arm64|all] [--out DIR] [--debs DIR] [--cache DIR]
#
# amd64: localhost/bluecache-host:VERSION (bluecache-host: bluecached, bluecache-hostd,
#        bluecachectl; entrypoint mode `embedded` by default, `hostd` or `bluecached` by argument
#        or BLUECACHE_MODE; see deploy/image/entrypoint.sh).
# arm64: localhost/bluecache-dpu:VERSION (bluecache-dpu: bluecached, bluecachectl; mode
#        `bluecached`), built on amd64 under qemu-user as scripts/build-debs.sh does.
# Default --arch: this machine's. Each image is loaded into podman's local storage and written to
# DIR/bluecache-{host,dpu}_VERSION_ARCH.oci.tar (default DIR: dist/images), the artefact to copy
# to a node (docs/kubernetes.md loads it into containerd or CRI-O there).
# The .debs come from --debs DIR if it holds them, else scripts/build-debs.sh builds them.
# The minimal root with the package's Debian dependencies is kept in --cache DIR (default
# /var/cache/bluecache/images) as base-ARCH and reused while the dependencies are the same, so a
# rebuild downloads nothing. The mirror is BLUECACHE_DEBIAN_MIRROR, or apt's own.
# Needs root, debootstrap and podman (with qemu-user-static and binfmt-support for arm64).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

out=$root/dist/images
debs=
cache=/var/cache/bluecache/images
arches=native
while [ $# -gt 0 ]; do
  case $1 in
    --out) out=$2; shift 2 ;;
    --out=*) out=${1#--out=}; shift ;;
    --debs) debs=$2; shift 2 ;;
    --debs=*) debs=${1#--debs=}; shift ;;
    --cache) cache=$2; shift 2 ;;
    --cache=*) cache=${1#--cache=}; shift ;;
    --arch) arches=$2; shift 2 ;;
    --arch=*) arches=${1#--arch=}; shift ;;
    -h|--help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "build-images: unknown argument $1" >&2; exit 2 ;;
  esac
done
native=$(dpkg --print-architecture)
case $arches in
  native) arches=$native ;;
  all) arches="amd64 arm64" ;;
  amd64|arm64) ;;
  *) echo "build-images: --arch must be native, amd64, arm64 or all, not '$arches'" >&2; exit 2 ;;
esac
for t in debootstrap podman; do
  command -v $t >/dev/null || { echo "build-images: $t is not installed" >&2; exit 1; }
done
mkdir -p "$out" "$cache"
out=$(cd "$out" && pwd)

work=$(mktemp -d /tmp/bluecache-images.XXXXXX)
trap 'rm -rf "$work"' EXIT

mirror() {
  if [ -n "${BLUECACHE_DEBIAN_MIRROR:-}" ]; then echo "$BLUECACHE_DEBIAN_MIRROR"; return; fi
  local f
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -e "$f" ] || continue
    awk '/^URIs:/ && !/security/ {print $2; exit}' "$f" | grep . && return
  done
  awk '$1 == "deb" && $2 !~ /security/ {print $2; exit}' /etc/apt/sources.list 2>/dev/null | grep .
}

package_of() { case $1 in amd64) echo bluecache-host ;; arm64) echo bluecache-dpu ;; esac; }

# Runs a command in ROOT with a clean environment (apt and dpkg as on a fresh Debian).
in_root() {
  local r=$1; shift
  chroot "$r" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 \
    DEBIAN_FRONTEND=noninteractive "$@"
}

# The .deb's Depends as apt arguments: versions dropped, the first of alternatives.
deb_depends() {
  dpkg-deb -f "$1" Depends | tr ',' '\n' | sed 's/|.*//; s/(.*)//; s/[[:space:]]//g' | grep . \
    | sort -u | paste -sd' ' -
}

# base-ARCH: minbase bookworm plus the package's dependencies, made once per dependency list.
base_root() {
  local arch=$1 deb=$2 base=$cache/base-$arch deps
  deps=$(deb_depends "$deb")
  if [ -e "$base/.bluecache-image-base" ] && [ "$(cat "$base/.bluecache-image-base")" = "$deps" ]
  then
    echo "build-images: reusing $base" >&2
    return
  fi
  local log=$work/base-$arch.log
  if [ ! -e "$base/.bluecache-bootstrapped" ]; then
    rm -rf "$base"
    echo "build-images: debootstrap minbase bookworm $arch into $base" >&2
    if [ "$arch" = "$native" ]; then
      debootstrap --variant=minbase bookworm "$base" "$(mirror)" >"$log" 2>&1 \
        || { tail -30 "$log" >&2; echo "build-images: debootstrap failed" >&2; exit 1; }
    else
      bash "$root/scripts/arm64-root.sh" --minimal "$base"
    fi
    touch "$base/.bluecache-bootstrapped"
  fi
  echo "build-images: installing the dependencies into $base: $deps" >&2
  cp /etc/resolv.conf "$base/etc/resolv.conf"
  # shellcheck disable=SC2086   # $deps: one argument per package
  if ! in_root "$base" sh -ec "apt-get update -q && apt-get install -y -q \
        --no-install-recommends $deps" >"$log" 2>&1; then
    tail -30 "$log" >&2
    echo "build-images: installing the dependencies failed" >&2
    exit 1
  fi
  echo "$deps" > "$base/.bluecache-image-base"
}

build_image() {
  local arch=$1 package deb version name tag rootfs
  package=$(package_of "$arch")
  deb=$(find "$debs" -maxdepth 1 -name "${package}_*_${arch}.deb" | sort | tail -1)
  [ -n "$deb" ] || { echo "build-images: no ${package}_*_${arch}.deb in $debs" >&2; exit 1; }
  version=$(dpkg-deb -f "$deb" Version)
  base_root "$arch" "$deb"

  rootfs=$work/root-$arch
  echo "build-images: $package $version ($arch)" >&2
  cp -a "$cache/base-$arch" "$rootfs"
  rm -f "$rootfs"/.bluecache-*
  cp "$deb" "$rootfs/tmp/"
  in_root "$rootfs" dpkg -i "/tmp/$(basename "$deb")" >"$work/install-$arch.log" 2>&1 \
    || { tail -30 "$work/install-$arch.log" >&2; echo "build-images: dpkg -i failed" >&2; exit 1; }
  install -m 0755 "$root/deploy/image/entrypoint.sh" "$rootfs/usr/local/bin/bluecache-entrypoint"
  # What a container does not need: package lists, caches, documentation, logs.
  in_root "$rootfs" apt-get clean
  rm -rf "$rootfs"/tmp/* "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin \
         "$rootfs"/var/cache/debconf/*-old "$rootfs"/var/log/*.log "$rootfs"/var/log/apt/* \
         "$rootfs"/usr/share/man "$rootfs"/usr/share/info "$rootfs"/usr/share/locale \
         "$rootfs"/usr/share/doc/*/changelog* "$rootfs"/root/.cache
  : > "$rootfs/etc/resolv.conf"
  : > "$rootfs/etc/hostname"

  name=localhost/$package
  tag=$version
  local mode=embedded
  [ "$arch" = arm64 ] && mode=bluecached
  tar --numeric-owner --xattrs -C "$rootfs" -cf "$work/rootfs-$arch.tar" .
  podman rmi -f "$name:$tag" >/dev/null 2>&1 || true
  podman import --arch "$arch" \
    --change "ENTRYPOINT [\"/usr/local/bin/bluecache-entrypoint\"]" \
    --change "ENV BLUECACHE_DEFAULT_MODE=$mode" \
    --change "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
    --change "EXPOSE 9464" --change "EXPOSE 9465" \
    --change "STOPSIGNAL SIGTERM" \
    --change "LABEL org.opencontainers.image.title=$package" \
    --change "LABEL org.opencontainers.image.version=$version" \
    --change "LABEL org.opencontainers.image.description=bluecache ($package, Debian 12, $mode mode by default)" \
    --message "$package $version on Debian 12 (bookworm) $arch" \
    "$work/rootfs-$arch.tar" "$name:$tag" >/dev/null
  rm -f "$work/rootfs-$arch.tar"
  local archive=$out/${package}_${version}_${arch}.oci.tar
  rm -f "$archive"
  podman save -q --format oci-archive -o "$archive" "$name:$tag"
  echo "build-images: $name:$tag ($(podman image inspect -f '{{.Size}}' "$name:$tag" \
        | numfmt --to=iec-i --suffix=B)) -> $archive ($(du -h "$archive" | cut -f1))" >&2
  echo "$archive"
}

if [ -z "$debs" ]; then
  debs=$work/debs
  for arch in $arches; do
    bash "$root/scripts/build-debs.sh" --arch "$arch" --out "$debs" >/dev/null
  done
fi
debs=$(cd "$debs" && pwd)
for arch in $arches; do
  build_image "$arch"
done
