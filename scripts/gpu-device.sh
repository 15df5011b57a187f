#!/usr/bin/env bash
# Runs tests/gpu and bench/gpu_bench.py on a lent GPU machine (no network, its own Python),
# from the repo root, with what scripts/gpu-bundle.sh put in .devgpu/ (carried along). Prints
# diagnostics first; each step has a time limit and a failed step does not stop the next.
# Logs and the bench's results go to $OUT: device.log (everything), gpu-tests.log,
# gpu-bench.log, gpu.json, gpu.md, gpu.png, and logs.tar.gz (the daemons' logs) if a step
# failed. Exit status 0 only if the tests and the bench both passed.
#
# Environment (all optional):
#   OUT                where results go (default /tmp/bluecache-gpu-out)
#   PY                 the Python to run (default python3)
#   BLUECACHE_CUDA     gpu (default: insist on a real GPU) or simulator (the CUDA driver
#                      simulator: a dry run on a machine without a GPU)
#   GPU_BENCH_ARGS     arguments for bench/gpu_bench.py (default: its own, 16 x 32 MiB, 3 rounds)
#   GPU_TEST_TIMEOUT   seconds for the tests (default 200)
#   GPU_BENCH_TIMEOUT  seconds for the bench (default 150)
#   GPU_BUNDLE         the bundle (default .devgpu)
#   GPU_STEPS          which steps to run (default "tests bench"; also "parts": the CUDA
#                      path's parts timed apart, bench/gpu_parts.py, into gpu-parts.json;
#                      "profile": the bench under py-spy, into gpu-profile.txt)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
PY=${PY:-python3}
OUT=${OUT:-/tmp/bluecache-gpu-out}
BUNDLE=${GPU_BUNDLE:-$ROOT/.devgpu}
CUDA=${BLUECACHE_CUDA:-gpu}
BENCH_ARGS=${GPU_BENCH_ARGS:-}
TEST_TIMEOUT=${GPU_TEST_TIMEOUT:-200}
BENCH_TIMEOUT=${GPU_BENCH_TIMEOUT:-150}
STEPS=${GPU_STEPS:-tests bench}
mkdir -p "$OUT"
SCRATCH=$(mktemp -d /tmp/bcdev-XXXXXX)   # the installed wheels, the stand-ins for cc and git
RUN_ID=${SCRATCH#/tmp/}
exec > >(tee -a "$OUT/device.log") 2>&1
TEE=$!
T0=$(date +%s)
say() { echo "gpu-device [+$(( $(date +%s) - T0 ))s]: $*"; }
show() {   # a diagnostic command, never more than 20 s, never fatal
  echo "\$ $*"
  timeout -k 5 20 "$@" 2>&1 | head -40
}

say "run $RUN_ID in $ROOT, OUT=$OUT, BLUECACHE_CUDA=$CUDA, PY=$PY"
[ "$CUDA" = gpu ] || [ "$CUDA" = simulator ] || { say "BLUECACHE_CUDA must be gpu or simulator"; exit 2; }
[ -d "$BUNDLE/wheels" ] || say "WARNING: no bundle at $BUNDLE (run scripts/gpu-bundle.sh here and carry .devgpu)"

# -- diagnostics ---------------------------------------------------------------------------
show date -u
show uname -a
show id
show nproc
show free -g
show nvidia-smi -L
show nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
show "$PY" -VV
show "$PY" -c 'import sys; print(sys.executable, sys.prefix)'
show "$PY" - <<'EOF'
import importlib.metadata as m
for n in ("cuda-bindings", "cuda-core", "cuda-pathfinder", "pytest", "hypothesis", "numpy",
          "matplotlib", "msgpack", "PyYAML", "attrs", "idna", "sortedcontainers", "cffi",
          "pip"):
    try:
        print(f"  {n} {m.version(n)}")
    except m.PackageNotFoundError:
        print(f"  {n} -")
EOF
show sh -c 'ldconfig -p | grep -E "libfuse3|libcuda\.so"'
show ls -l /dev/fuse
show grep -w fuse /proc/filesystems
show sh -c 'command -v cc gcc fusermount3 umount setpriv chattr sha256sum || true'
show df -h /tmp /var/tmp /dev/shm
show findmnt -T /tmp
show sh -c 'git rev-parse HEAD 2>&1; git status --porcelain --untracked-files=no | head -5'
[ -f "$BUNDLE/MANIFEST" ] && show head -1 "$BUNDLE/MANIFEST"

# -- setup ---------------------------------------------------------------------------------
if ! grep -qw fuse /proc/filesystems; then
  say "fuse is not in /proc/filesystems: modprobe fuse"
  timeout 20 modprobe fuse || say "modprobe fuse failed"
fi
if [ ! -e /dev/fuse ]; then
  say "making /dev/fuse (char 10,229)"
  mknod -m 0666 /dev/fuse c 10 229 || say "mknod /dev/fuse failed"
fi

SITE=$SCRATCH/site
mkdir -p "$SITE"
install_wheels() {   # wheels into $SITE: pip where this Python has it, else unzipped
  [ $# -gt 0 ] || return 0
  if timeout 30 "$PY" -m pip --version >/dev/null 2>&1; then
    timeout -k 5 120 "$PY" -m pip install -q --no-index --no-deps --no-compile \
      --disable-pip-version-check --target "$SITE" "$@" && return 0
    say "pip install failed: unzipping instead"
  fi
  "$PY" - "$SITE" "$@" <<'EOF'
import sys, zipfile
for wheel in sys.argv[2:]:   # none of the bundle's wheels has a .data directory
    with zipfile.ZipFile(wheel) as z:
        z.extractall(sys.argv[1])
EOF
}
say "installing the bundle's wheels into $SITE"
install_wheels "$BUNDLE"/wheels/*.whl || say "installing the wheels failed"
fallback=()
for w in "$BUNDLE"/fallback/*.whl; do
  [ -e "$w" ] || continue
  name=$(basename "$w"); name=${name%%-*}
  case $name in pyyaml|PyYAML) module=yaml ;; *) module=$name ;; esac
  if ! "$PY" -c "import $module" 2>/dev/null; then
    say "$module is missing here: installing $(basename "$w")"
    fallback+=("$w")
  fi
done
install_wheels "${fallback[@]}" || say "installing the fallback wheels failed"

# the project's native modules (git-ignored, so they did not travel with the tree), built by
# gpu-bundle.sh from native/ as it was then
native_digest() {
  find native setup.py -type f \( -name '*.c' -o -name '*.h' -o -name '*.py' -o -name '*.map' \) \
    -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1
}
if [ -f "$BUNDLE/native.sha256" ] && [ "$(native_digest)" != "$(cat "$BUNDLE/native.sha256")" ]; then
  say "WARNING: native/ differs from what the bundle's modules were built from: rerun"
  say "WARNING: scripts/gpu-bundle.sh before carrying .devgpu (failures may come from that)"
fi
if [ -d "$BUNDLE/ext" ]; then
  while IFS= read -r -d '' so; do
    rel=${so#"$BUNDLE"/ext/}
    [ -e "$ROOT/$rel" ] || { cp "$so" "$ROOT/$rel" && say "placed $rel"; }
  done < <(find "$BUNDLE/ext" -name '*.so' -print0)
fi

export PYTHONPATH=$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}
export BLUECACHE_GPU_RUN=$RUN_ID          # marks our processes for the cleanup at the end
export PYTHONDONTWRITEBYTECODE=1
if ! ldconfig -p 2>/dev/null | grep -q 'libfuse3\.so\.3 '; then
  say "no libfuse3.so.3 on this system: the bundle's"
  export LD_LIBRARY_PATH=$BUNDLE/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
command -v fusermount3 >/dev/null || export PATH=$PATH:$BUNDLE/bin
mkdir -p "$SCRATCH/bin"
if ! command -v git >/dev/null; then
  # bench/harness.py records the revision with git, which must then fail, not be missing
  say "no git: the revision goes unrecorded"
  printf '#!/bin/sh\nexit 1\n' > "$SCRATCH/bin/git"
  chmod +x "$SCRATCH/bin/git"
fi
export PATH=$SCRATCH/bin:$PATH
if ! command -v cc >/dev/null; then
  # tests/cuda_sim.py compiles the CUDA driver simulator with cc (test_gpu_bench runs the
  # bench on it): with no compiler here, hand it the one gpu-bundle.sh compiled, for exactly
  # that source
  say "no C compiler: cc gives the bundle's prebuilt CUDA driver simulator"
  cat > "$SCRATCH/bin/cc" <<EOF
#!/bin/sh
out=; src=
while [ \$# -gt 0 ]; do
  case "\$1" in -o) out=\$2; shift ;; *.c) src=\$1 ;; esac
  shift
done
if [ -z "\$out" ] || [ "\$(basename "\$src")" != cuda_sim.c ]; then
  echo "cc: no C compiler on this machine (gpu-device.sh's stand-in builds only cuda_sim.c)" >&2
  exit 1
fi
if [ "\$(sha256sum < "\$src" | cut -d' ' -f1)" != "\$(cat "$BUNDLE/cuda-sim/source.sha256")" ]; then
  echo "cc: \$src differs from the one the bundle's simulator was built from" >&2
  exit 1
fi
exec cp "$BUNDLE/cuda-sim/libcuda.so.1" "\$out"
EOF
  chmod +x "$SCRATCH/bin/cc"
fi

show "$PY" -c '
import hostd._fuse_shim   # (hostd loads it before pyfuse3)
import pyfuse3, trio, zmq, crc32c, sdnotify, cffi, msgpack, yaml
import cuda.bindings.driver
import bluecached.dma._stream_copy, bluecached.dma._doca_sim
print("imports ok: pyfuse3", pyfuse3.__version__, "trio", trio.__version__, "zmq",
      zmq.__version__, "libzmq", zmq.zmq_version(), "cffi", cffi.__version__,
      "fuse", hostd._fuse_shim.lib.fuse_version())'

# pytest's temp dirs: where the mounts' directories can be made immutable (hostd guards the
# bare mountpoint with chattr +i and warns where it cannot, which fails the test)
BASETEMP=$("$PY" - /tmp /var/tmp /dev/shm "$ROOT" <<'EOF'
import array, fcntl, os, sys, tempfile
GET, SET, IMMUTABLE = 0x80086601, 0x40086602, 0x10
for d in sys.argv[1:]:
    try:
        t = tempfile.mkdtemp(prefix="bcdev-probe-", dir=d)
    except OSError:
        continue
    fd = os.open(t, os.O_RDONLY | os.O_DIRECTORY)
    try:
        flags = array.array("i", [0, 0])
        fcntl.ioctl(fd, GET, flags, True)
        fcntl.ioctl(fd, SET, array.array("i", [flags[0] | IMMUTABLE, 0]), True)
        fcntl.ioctl(fd, SET, array.array("i", [flags[0], 0]), True)
        print(d)
        break
    except OSError as e:
        print(f"gpu-device: {d}: no immutable attribute ({e})", file=sys.stderr)
    finally:
        os.close(fd)
        os.rmdir(t)
EOF
)
BASETEMP=${BASETEMP:-/tmp}/$RUN_ID.t   # short: the daemons' sockets are in it
say "pytest's temp dirs: $BASETEMP"

# -- the steps -----------------------------------------------------------------------------
declare -A result
bench_dirs() { find /var/tmp -maxdepth 1 -name 'bcgpu-*' 2>/dev/null | sort; }   # its mkdtemp
bench_dirs_before=$(bench_dirs)

if [[ " $STEPS " == *" tests "* ]]; then
  say "step tests: BLUECACHE_CUDA=$CUDA pytest tests/gpu (limit ${TEST_TIMEOUT}s)"
  t=$(date +%s)
  BLUECACHE_CUDA=$CUDA timeout -k 15 "$TEST_TIMEOUT" "$PY" -m pytest tests/gpu -q -rA \
    -p no:cacheprovider --durations=10 --basetemp "$BASETEMP" 2>&1 | tee "$OUT/gpu-tests.log"
  result[tests]=${PIPESTATUS[0]}
  say "step tests: exit ${result[tests]} in $(( $(date +%s) - t ))s"
fi

if [[ " $STEPS " == *" bench "* ]]; then
  sim=(); [ "$CUDA" = simulator ] && sim=(--simulator)
  # shellcheck disable=SC2086   # GPU_BENCH_ARGS are words
  say "step bench: gpu_bench.py ${sim[*]} $BENCH_ARGS --out-dir $OUT (limit ${BENCH_TIMEOUT}s)"
  t=$(date +%s)
  # shellcheck disable=SC2086
  timeout -k 15 "$BENCH_TIMEOUT" "$PY" bench/gpu_bench.py "${sim[@]}" $BENCH_ARGS \
    --out-dir "$OUT" 2>&1 | tee "$OUT/gpu-bench.log"
  result[bench]=${PIPESTATUS[0]}
  say "step bench: exit ${result[bench]} in $(( $(date +%s) - t ))s"
fi

if [[ " $STEPS " == *" parts "* ]]; then
  # where a block's time goes: bench/gpu_parts.py times each part of the CUDA path apart
  sim=(); [ "$CUDA" = simulator ] && sim=(--simulator)
  say "step parts: gpu_parts.py ${sim[*]} (limit ${BENCH_TIMEOUT}s)"
  t=$(date +%s)
  timeout -k 15 "$BENCH_TIMEOUT" "$PY" bench/gpu_parts.py "${sim[@]}" --out-dir "$OUT" \
    2>&1 | tee "$OUT/gpu-parts.log"
  result[parts]=${PIPESTATUS[0]}
  say "step parts: exit ${result[parts]} in $(( $(date +%s) - t ))s"
fi

if [[ " $STEPS " == *" profile "* ]]; then
  # The bench again under py-spy (every process: the bench, bluecached, hostd), Python and
  # native frames, raw collapsed stacks in $OUT/gpu-profile.txt. Slower than the bench alone:
  # its numbers are not results.
  sim=(); [ "$CUDA" = simulator ] && sim=(--simulator)
  say "step profile: py-spy record -- gpu_bench.py ${sim[*]} $BENCH_ARGS (limit ${BENCH_TIMEOUT}s)"
  t=$(date +%s)
  if [ -x "$BUNDLE/bin/py-spy" ]; then
    # shellcheck disable=SC2086
    timeout -k 15 "$BENCH_TIMEOUT" "$BUNDLE/bin/py-spy" record --subprocesses --native \
      --rate 250 --format raw --output "$OUT/gpu-profile.txt" -- \
      "$PY" bench/gpu_bench.py "${sim[@]}" $BENCH_ARGS --out-dir "$SCRATCH/profiled" \
      2>&1 | tail -40 | tee "$OUT/gpu-profile.log"
    result[profile]=${PIPESTATUS[0]}
  else
    say "step profile: no py-spy in the bundle"
    result[profile]=1
  fi
  say "step profile: exit ${result[profile]} in $(( $(date +%s) - t ))s"
fi

# -- cleanup: only what this run started or mounted ----------------------------------------
for p in /proc/[0-9]*; do
  pid=${p#/proc/}
  [ "$pid" = $$ ] && continue
  { tr '\0' '\n' < "$p/environ"; } 2>/dev/null | grep -qx "BLUECACHE_GPU_RUN=$RUN_ID" || continue
  cmd=$({ tr '\0' ' ' < "$p/cmdline"; } 2>/dev/null)
  case $cmd in
    *bluecached.daemon*|*hostd.daemon*|*pytest*|*gpu_bench*)
      say "killing leftover $pid: $cmd"; kill -9 "$pid" 2>/dev/null ;;
  esac
done
mapfile -t bench_dirs_new < <(comm -13 <(echo "$bench_dirs_before") <(bench_dirs))
for d in "$BASETEMP" "${bench_dirs_new[@]}"; do
  [ -d "$d" ] || continue
  awk -v d="$d/" 'index($5, d) == 1 {print $5}' /proc/self/mountinfo | sort -r | \
    while read -r m; do say "unmounting leftover $m"; umount -l "$m"; done
done
failed=0
for step in $STEPS; do [ "${result[$step]:-1}" = 0 ] || failed=1; done
if [ $failed = 1 ] && [ -d "$BASETEMP" ]; then
  (cd "$BASETEMP" && find . -name '*.log' -size -4M -print0 | \
     tar -czf "$OUT/logs.tar.gz" --null -T - 2>/dev/null) && say "daemons' logs: logs.tar.gz"
fi
"$PY" - "$BASETEMP" "${bench_dirs_new[@]}" <<'EOF' 2>/dev/null
import os, sys
from hostd.mount import unguard_bare   # lifts chattr +i and mode 000 of bare mountpoints
for top in sys.argv[1:]:
    for d, dirs, _ in os.walk(top):
        for name in dirs:
            if name.startswith("mnt"):
                try:
                    unguard_bare(os.path.join(d, name))
                except Exception:
                    pass
EOF
rm -rf "$SCRATCH" "$BASETEMP" "${bench_dirs_new[@]}"

summary=""
for step in $STEPS; do summary+=" $step=${result[$step]:-not run}"; done
say "done:$summary; results in $OUT:" "$(cd "$OUT" && find . -type f -printf '%P ')"
exec >&- 2>&-
wait "$TEE" 2>/dev/null || sleep 1    # device.log complete before the files go back
exit $failed
