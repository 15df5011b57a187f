#!/usr/bin/env bash
# Prepares an arm64 Debian bookworm root that runs on this amd64 machine under qemu-user:
#
#   scripts/arm64-root.sh [--build | --minimal] ROOT
#
# --build   (default) debootstrap's buildd variant plus what packaging/debian/control's
#           Build-Depends names: scripts/build-debs.sh builds bluecache-dpu in it.
# --minimal a minbase root to install bluecache-dpu into with apt, as a DPU's Debian would.
#
# An existing ROOT with the marker file .bluecache-root-<variant> is reused as it is.
# The mirror is BLUECACHE_DEBIAN_MIRROR, or the one this machine's apt uses.
# Needs root, qemu-user-static, binfmt-support and debootstrap (scripts/setup.sh --test installs
# them). On an arm64 machine no emulation is involved.
set -euo pipefail

variant=build
case ${1:-} in
  --build) shift ;;
  --minimal) variant=minimal; shift ;;
  -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
esac
[ $# -eq 1 ] || { echo "usage: $0 [--build|--minimal] ROOT" >&2; exit 2; }
root=$1
marker=$root/.bluecache-root-$variant

apt_mirror() {
  local f
  if [ -n "${BLUECACHE_DEBIAN_MIRROR:-}" ]; then echo "$BLUECACHE_DEBIAN_MIRROR"; return; fi
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -e "$f" ] || continue
    awk '/^URIs:/ && !/security/ {print $2; exit}' "$f" | grep . && return
  done
  if [ -e /etc/apt/sources.list ]; then
    awk '$1 == "deb" && $2 !~ /security/ {print $2; exit}' /etc/apt/sources.list | grep . && return
  fi
  echo "arm64-root: no Debian mirror in apt's sources; set BLUECACHE_DEBIAN_MIRROR" >&2
  return 1
}

# Runs arm64 binaries through qemu. The F flag (set by Debian's qemu-user-static) opens the
# interpreter at registration, so it also works inside chroots and containers.
enable_qemu_binfmt() {
  [ "$(dpkg --print-architecture)" = arm64 ] && return 0
  local misc=/proc/sys/fs/binfmt_misc
  [ -e $misc/register ] || mount -t binfmt_misc binfmt_misc $misc
  if [ ! -e $misc/qemu-aarch64 ]; then
    update-binfmts --enable qemu-aarch64 2>/dev/null || true
  fi
  if [ ! -e $misc/qemu-aarch64 ]; then
    [ -e /usr/lib/binfmt.d/qemu-aarch64.conf ] \
      || { echo "arm64-root: qemu-user-static is not installed" >&2; return 1; }
    cat /usr/lib/binfmt.d/qemu-aarch64.conf > $misc/register
  fi
  grep -q '^enabled' $misc/qemu-aarch64 \
    || { echo "arm64-root: binfmt entry qemu-aarch64 is disabled" >&2; return 1; }
}

enable_qemu_binfmt
if [ -e "$marker" ]; then
  echo "arm64-root: reusing $root" >&2
  exit 0
fi

if [ $variant = build ]; then
  # The Build-Depends of packaging/debian/control, without version constraints.
  control=$(dirname "$0")/../packaging/debian/control
  deps=$(sed -n '/^Build-Depends:/,/^[A-Z]/p' "$control" | sed '1s/^Build-Depends://;$d' \
         | tr ',' '\n' | sed 's/(.*)//; s/[[:space:]]//g' | grep . | grep -v '^debhelper-compat' \
         | paste -sd, -)
  args=(--variant=buildd)
else
  args=(--variant=minbase)
fi
mirror=$(apt_mirror)
rm -rf "$root"
echo "arm64-root: debootstrap arm64 ($variant) into $root from $mirror (a few minutes under qemu)" >&2
log=$(mktemp /tmp/arm64-root.XXXXXX.log)
if ! debootstrap --arch=arm64 "${args[@]}" bookworm "$root" "$mirror" >"$log" 2>&1; then
  tail -30 "$log" >&2
  echo "arm64-root: debootstrap failed (log: $log)" >&2
  exit 1
fi
if [ $variant = build ]; then
  # apt, not debootstrap's --include: that resolver misses virtual packages (python3-ply-lex-3.10)
  # and leaves such packages unconfigured.
  echo "arm64-root: installing the build dependencies: debhelper,$deps" >&2
  if ! chroot "$root" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive \
      sh -ec "apt-get update -q && apt-get install -y -q --no-install-recommends \
              debhelper $(echo "$deps" | tr , ' ')" >"$log" 2>&1; then
    tail -30 "$log" >&2
    echo "arm64-root: installing the build dependencies failed (log: $log)" >&2
    exit 1
  fi
fi
rm -f "$log"
touch "$marker"
echo "arm64-root: ready: $root" >&2
