#!/bin/bash
# The bluecache images' entrypoint (/usr/local/bin/bluecache-entrypoint). The mode is the first
# argument, else $BLUECACHE_MODE, else the image's default (embedded in the host image,
# bluecached in the DPU image):
#
#   embedded            bluecached and bluecache-hostd, supervised here: if either exits the
#                       other is stopped and the container exits with its status; SIGTERM stops
#                       hostd first (it unmounts), then bluecached (it persists the cache).
#   hostd               bluecache-hostd alone (DPU mode: bluecached runs on the BlueField).
#   bluecached          bluecached alone (the DPU image; or one container of a two-container pod).
#   wait-mount [DIR]    waits until DIR (default $BLUECACHE_MOUNT or /mnt/kv-cache) is a
#                       fuse.bluecache mount that answers, then exits 0; after
#                       $BLUECACHE_WAIT_TIMEOUT seconds (default 300; 0: forever) exits 1.
#   check-mount [DIR]   the same check once: exit 0 if mounted and answering, else 1.
#   anything else       run as a command (e.g. `bluecachectl stats`).
#
# Further arguments go to the daemon of a one-daemon mode, e.g. `hostd --set mount.read_ahead=8`;
# $BLUECACHED_ARGS and $HOSTD_ARGS (split on spaces) are given to each daemon in every mode.
# Configs are /etc/bluecache/bluecached.yaml and /etc/bluecache/hostd.yaml (BLUECACHED_CONFIG and
# HOSTD_CONFIG move them); a Kubernetes ConfigMap mounts its own there.
set -uo pipefail

bluecached_config=${BLUECACHED_CONFIG:-/etc/bluecache/bluecached.yaml}
hostd_config=${HOSTD_CONFIG:-/etc/bluecache/hostd.yaml}
default_mode=${BLUECACHE_DEFAULT_MODE:-embedded}

read -r -a bluecached_args <<< "${BLUECACHED_ARGS:-}"
read -r -a hostd_args <<< "${HOSTD_ARGS:-}"

log() { echo "bluecache-entrypoint: $*" >&2; }

# True if $1 is a fuse.bluecache mount (the top one there, in this mount namespace) and hostd
# answers through it: the lookup of a name never used before must reach hostd and say ENOENT
# (a mount whose hostd died says ENOTCONN; a stat of the directory itself may be answered from
# the kernel's attribute cache even then).
is_served() {
  local dir fstype
  dir=$(realpath -m "$1")
  fstype=$(awk -v d="$dir" '$5 == d { for (i = 7; $i != "-"; i++); t = $(i + 1) } END { print t }' \
           /proc/self/mountinfo)
  [ "$fstype" = fuse.bluecache ] || return 1
  python3 -c 'import os, sys
try:
    os.stat(sys.argv[1])
except FileNotFoundError:
    sys.exit(0)
except OSError:
    sys.exit(1)
sys.exit(1)' "$dir/.bluecache-probe-$$-$RANDOM"
}

wait_mount() {
  local dir=${1:-${BLUECACHE_MOUNT:-/mnt/kv-cache}} timeout=${BLUECACHE_WAIT_TIMEOUT:-300}
  local start=$SECONDS
  log "waiting for the cache to be mounted at $dir"
  until is_served "$dir"; do
    if [ "$timeout" != 0 ] && [ $((SECONDS - start)) -ge "$timeout" ]; then
      log "$dir is not a bluecache mount after ${timeout}s: not starting on a bare directory"
      return 1
    fi
    sleep 1
  done
  log "$dir is mounted (fuse.bluecache)"
}

# Waits for one of the given pids; sets `exited` and `status`. A trap interrupting the wait
# (SIGTERM) runs its handler and the wait goes on.
wait_one() {
  exited=
  while [ -z "${exited:-}" ]; do
    wait -n -p exited "$@"
    status=$?
  done
}

embedded() {
  if [ $# -gt 0 ]; then
    log "embedded mode takes no arguments (use BLUECACHED_ARGS and HOSTD_ARGS): $*"
    exit 2
  fi
  bluecached --config "$bluecached_config" "${bluecached_args[@]}" &
  daemon=$!
  bluecache-hostd --config "$hostd_config" "${hostd_args[@]}" &
  hostd=$!
  stopping=0
  stop_all() {
    stopping=1
    kill -TERM "$hostd" 2>/dev/null
  }
  trap stop_all TERM INT
  wait_one "$daemon" "$hostd"
  first=$exited first_status=$status
  if [ "$first" = "$hostd" ]; then
    [ $stopping = 1 ] || log "bluecache-hostd exited with status $status: stopping bluecached"
    kill -TERM "$daemon" 2>/dev/null
    wait_one "$daemon"
  else
    log "bluecached exited with status $status: stopping bluecache-hostd"
    kill -TERM "$hostd" 2>/dev/null
    wait_one "$hostd"
  fi
  if [ $stopping = 1 ] && [ "$first" = "$hostd" ]; then
    # A requested stop: the container's status is the worse of the two.
    [ "$first_status" != 0 ] && exit "$first_status"
    exit "$status"
  fi
  [ "$first_status" != 0 ] && exit "$first_status"
  exit 1    # a daemon that stops by itself is a failure of the container
}

mode=${BLUECACHE_MODE:-$default_mode}
case ${1:-} in
  embedded|hostd|bluecached|wait-mount|check-mount) mode=$1; shift ;;
  "") ;;
  -*) ;;                       # options for the default mode's daemon(s)
  *) exec "$@" ;;
esac

case $mode in
  embedded) embedded "$@" ;;
  hostd) exec bluecache-hostd --config "$hostd_config" "${hostd_args[@]}" "$@" ;;
  bluecached) exec bluecached --config "$bluecached_config" "${bluecached_args[@]}" "$@" ;;
  wait-mount) wait_mount "$@"; exit ;;
  check-mount) is_served "${1:-${BLUECACHE_MOUNT:-/mnt/kv-cache}}"; exit ;;
  *) log "unknown mode '$mode' (embedded, hostd, bluecached, wait-mount, check-mount)"; exit 2 ;;
esac
