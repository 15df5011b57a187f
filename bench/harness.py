"""What the benches share: the machine a run was on and the revision it ran, the page cache, CPU
accounting, bluecached and hostd as processes, and results written as JSON + Markdown (+ PNG)
that name the machine.

The bench scripts run as `python bench/NAME.py`, so bench/ is on sys.path and they import this
as `harness`. Benches import nothing from tests/'s support code: the daemons are started by
bluecached.supervisor, as `bluecachectl up` and the tests start them.
"""

import contextlib
import datetime
import hashlib
import json
import mmap
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))   # the checkout's packages, installed or not

from bluecached.supervisor import NotReady, Supervised, python_module, set_options  # noqa: E402
from bluecached.wire import protocol  # noqa: E402
from bluecached.wire.client import RegionChannel, SyncClient  # noqa: E402

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


# -- the machine and the revision ----------------------------------------------------------------


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _meminfo(field: str) -> int:
    """A /proc/meminfo field in bytes (0 where absent)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * KiB
    return 0


def memory_bytes() -> int:
    return _meminfo("MemTotal")


def machine_info(**extra) -> dict:
    """What the numbers depend on; `extra` adds what one bench also needs (a device, a disk)."""
    return {"host": platform.node(), "platform": platform.platform(),
            "kernel": platform.release(), "cpu_model": cpu_model(), "cores": os.cpu_count(),
            "cores_usable": len(os.sched_getaffinity(0)), "memory_bytes": memory_bytes(),
            "python": platform.python_version(),
            "loadavg_at_start": [round(x, 2) for x in os.getloadavg()], **extra}


def machine_line(machine: dict) -> str:
    """The machine in one Markdown line, for the head of a results file."""
    return (f"Machine: {machine['host']}: {machine['cpu_model']}, {machine['cores']} cores, "
            f"{machine['memory_bytes'] / GiB:.0f} GiB memory, Linux {machine['kernel']}.")


def git_revision() -> dict:
    """The commit, whether the checkout differs from it, and a digest of the daemons' sources
    (a change during a run shows as a different digest at its end)."""
    def git(*args):
        r = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else None
    digest = hashlib.sha256()
    for f in sorted(p for d in ("bluecached", "hostd", "fusefs") for p in (ROOT / d).rglob("*.py")):
        digest.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes())
    changed = git("status", "--porcelain", "--", "bluecached", "hostd", "fusefs") or ""
    return {"commit": git("rev-parse", "HEAD"),
            "tracked_changes": bool(git("status", "--porcelain", "--untracked-files=no")),
            "daemon_sources_changed": changed.splitlines(),
            "daemon_sources_sha256": digest.hexdigest()}


def run_info(bench: str, **extra_machine) -> dict:
    """The head of every results JSON: which bench, when, on what, at which revision."""
    return {"benchmark": bench,
            "created": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": [Path(sys.executable).name, *sys.argv],
            "machine": machine_info(**extra_machine), "git": git_revision()}


# -- the page cache ------------------------------------------------------------------------------


def drop_caches(level: int = 3) -> str | None:
    """sync, then drop the page cache (1: page cache, 3: also dentries and inodes). None on
    success, else why it failed (not root)."""
    os.sync()   # drop_caches only drops clean pages
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write(f"{level}\n")
    except OSError as e:
        return f"echo {level} > /proc/sys/vm/drop_caches: {e.strerror}"
    return None


# -- the guest's memory ---------------------------------------------------------------------------

PAGE_REPORTING_ORDER = Path("/sys/module/page_reporting/parameters/page_reporting_order")
ABOVE_MAX_ORDER = 11   # x86-64's largest buddy order is 10: no free block is that large


@contextlib.contextmanager
def guest_memory_kept(warm_bytes: int):
    """On a VM guest with free page reporting (Firecracker here), freed memory is handed back
    to the host within seconds, and touching it again costs ~10 us a page (a 32 MiB write:
    ~85 ms of CPU instead of ~11). Whichever of two stores runs second then writes such
    memory, and a ratio between them says more about the order than about either (measured:
    0.12-0.17x one way round, 4.5-5.5x the other). Inside this context reporting is held off
    (its order set above the largest free block) and `warm_bytes` of memory were touched and
    freed first, so both sides write memory the guest holds, as on a machine without a
    hypervisor. The order is put back on leaving. Yields what was done, for the results."""
    info: dict = {"page_reporting": "absent"}
    try:
        was = PAGE_REPORTING_ORDER.read_text().strip()
    except OSError:
        was = None
    try:
        if was is not None:
            PAGE_REPORTING_ORDER.write_text(f"{ABOVE_MAX_ORDER}\n")
            info = {"page_reporting": f"held (order {was} -> {ABOVE_MAX_ORDER})"}
            started = time.perf_counter()
            warm = mmap.mmap(-1, warm_bytes, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                             | mmap.MAP_POPULATE)
            warm.close()
            info.update(warmed_gib=round(warm_bytes / GiB, 1),
                        warm_s=round(time.perf_counter() - started, 2))
        yield info
    finally:
        if was is not None:
            with contextlib.suppress(OSError):
                PAGE_REPORTING_ORDER.write_text(f"{was}\n")


def memory_available() -> int:
    return _meminfo("MemAvailable")


# -- CPU accounting ------------------------------------------------------------------------------

TICK = os.sysconf("SC_CLK_TCK")


def proc_counters(pid: int | None) -> tuple[float, float, int, int] | None:
    """(user CPU s, system CPU s, minor faults, voluntary+involuntary context switches) of a
    process (all threads), None if it is gone."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        switches = sum(int(line.split()[1])
                       for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                       if "ctxt_switches" in line)
    except OSError:
        return None
    return int(fields[11]) / TICK, int(fields[12]) / TICK, int(fields[7]), switches


def proc_cpu(pid: int | None) -> float | None:
    """User + system CPU seconds of a process so far."""
    c = proc_counters(pid)
    return None if c is None else c[0] + c[1]


def wait_quiet(pid: int | None, window: float = 0.3, busy: float = 0.02,
               timeout: float = 30) -> float:
    """Waits until a process spends less than `busy` CPU seconds in `window` (its background
    work done: map_ahead refilling spares, write-behind), at most `timeout`; the seconds
    waited."""
    t0 = time.monotonic()
    last = proc_cpu(pid)
    while last is not None and time.monotonic() - t0 < timeout:
        time.sleep(window)
        now = proc_cpu(pid)
        if now is None or now - last < busy:
            break
        last = now
    return time.monotonic() - t0


def system_busy() -> tuple[float, float]:
    """(busy, total) jiffies over all CPUs from /proc/stat."""
    parts = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = parts[3] + parts[4]
    return sum(parts) - idle, sum(parts)


def other_busy_processes(ours: set[int]) -> list[str]:
    """Processes other than ours that used CPU recently (ps's lifetime %CPU > 5)."""
    r = subprocess.run(["ps", "-eo", "pid,pcpu,args", "--sort=-pcpu"], capture_output=True,
                       text=True)
    out = []
    for line in r.stdout.splitlines()[1:]:
        pid, pcpu, args = line.split(None, 2)
        if int(pid) in ours or float(pcpu) < 5 or args.startswith("ps "):
            continue
        out.append(f"{pcpu}% {args[:120]}")
    return out[:8]


class CpuMeter:
    """CPU seconds (user + system), minor page faults and context switches of each of our
    processes during a phase, and how busy the whole machine was. `result` after the block."""

    def __init__(self, pids: dict[str, int | None]):
        self.pids = pids

    def __enter__(self):
        self.t0 = time.perf_counter()
        self.before = {k: proc_counters(p) for k, p in self.pids.items()}
        self.self0 = os.times()
        self.sys0 = system_busy()
        return self

    def __exit__(self, *exc):
        wall = time.perf_counter() - self.t0
        busy1, total1 = system_busy()
        self.result = {"wall_s": round(wall, 4)}
        cpu, sys_cpu, faults, switches = {}, {}, {}, {}
        for k, p in self.pids.items():
            a, b = self.before.get(k), proc_counters(p)
            if a is not None and b is not None:
                cpu[k] = round(b[0] + b[1] - a[0] - a[1], 3)
                sys_cpu[k] = round(b[1] - a[1], 3)
                faults[k] = b[2] - a[2]
                switches[k] = b[3] - a[3]
        t1 = os.times()
        cpu["bench"] = round(t1[0] + t1[1] - self.self0[0] - self.self0[1], 3)
        sys_cpu["bench"] = round(t1[1] - self.self0[1], 3)
        self.result.update(cpu_s=cpu, sys_cpu_s=sys_cpu, minor_faults=faults,
                           context_switches=switches)
        if total1 > self.sys0[1]:
            self.result["machine_busy"] = round((busy1 - self.sys0[0]) / (total1 - self.sys0[1]), 3)
            # CPU seconds everything else on the machine used meanwhile (other users' work,
            # kernel threads such as writeback): how much the numbers were disturbed
            ours = sum(cpu.values())
            self.result["other_cpu_s"] = round(max(0.0, (busy1 - self.sys0[0]) / TICK - ours), 3)
        return False


# -- results -------------------------------------------------------------------------------------


def pyplot():
    """matplotlib.pyplot drawing to files, or None (with a note) where it is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG (pip install -e '.[bench]')", file=sys.stderr)
        return None
    return plt


def write_results(out_dir: Path, name: str, results: dict, markdown: str, plot=None,
                  indent: int = 2) -> None:
    """NAME.json, NAME.md and, where `plot(plt, path)` draws one, NAME.png in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(results, indent=indent) + "\n")
    (out_dir / f"{name}.md").write_text(markdown.rstrip() + "\n")
    plt = pyplot() if plot else None
    if plt is not None:
        plot(plt, out_dir / f"{name}.png")
    print(f"results in {out_dir}/{name}.*", flush=True)


def markdown_head(title: str, results: dict, what: str = "") -> list[str]:
    """The first lines of a results file: title, machine, revision, what was run."""
    git = results["git"]
    commit = (git["commit"] or "unknown")[:12] + (" + local changes" if git["tracked_changes"]
                                                   else "")
    return [f"# {title}", "", machine_line(results["machine"]),
            f"Produced by `bench/{results['benchmark']}.py` at git {commit}, "
            f"{results['created']}. {what}".rstrip(), ""]


def pattern(seed: str, size: int) -> bytes:
    """Deterministic bytes that differ per seed."""
    return random.Random(seed).randbytes(size)


# -- bluecache's daemons as processes ------------------------------------------------------------


def is_mounted(path: Path) -> bool:
    return any(line.split()[4] == str(path)
               for line in Path("/proc/self/mountinfo").read_text().splitlines())


def mount_options(path: str) -> str | None:
    """The filesystem type and options of the mount that holds `path` (findmnt; of mounts
    stacked there, the last is the one seen)."""
    found = subprocess.run(["findmnt", "-no", "FSTYPE,OPTIONS", "--target", path],
                           capture_output=True, text=True)
    lines = found.stdout.splitlines()
    return " ".join(lines[-1].split()) if found.returncode == 0 and lines else None


def force_unmount(path: Path) -> None:
    """Unmounts whatever is at `path` and lifts hostd's guard of the bare directory, so that
    the bench's work directory can go."""
    from hostd.mount import MountError, unguard_bare

    if is_mounted(path):
        subprocess.run(["umount", "-l", str(path)], check=False)
    with contextlib.suppress(OSError, MountError):
        unguard_bare(path)


def _package_env() -> dict:
    """The daemons run as `python -m`: this checkout's packages first, installed or not."""
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                        os.environ.get("PYTHONPATH")]))}


def _log_problems(log: Path, allowed=()) -> list[str]:
    """WARNING/ERROR lines and tracebacks not matching any of `allowed`."""
    if not log.exists():
        return []
    return [line for line in log.read_text(errors="replace").splitlines()
            if (" WARNING " in line or " ERROR " in line or "Traceback" in line)
            and not any(a in line for a in allowed)]


class Bluecached:
    """bluecached in `root`: state, NVMe tier and log there, `settings` (dotted keys) as --set
    over the built-in defaults (never /etc/bluecache), READY=1 from its notify socket."""

    def __init__(self, root: Path, **settings):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        state = root / "state"
        self._own_state = None
        if len(str(state)) > 80:   # ipc:// and unix socket paths must stay under 108 bytes
            state = self._own_state = Path(tempfile.mkdtemp(prefix="bcb-", dir="/tmp"))
        self.state_dir = state
        self.settings = {"state_dir": str(state), "tiers.dram.size": "256MiB",
                         "tiers.nvme.path": str(root / "nvme"), "tiers.nvme.size": "1GiB",
                         "tiers.nvme.segment_size": "256MiB", "metrics.listen": "",
                         **settings}
        self.endpoints = protocol.state_dir_endpoints(str(state))
        self.log = root / "bluecached.log"
        self.process: Supervised | None = None

    def start(self, timeout: float = 60, env: dict | None = None,
              wait: bool = True) -> "Bluecached":
        """Starts it and (unless not `wait`) waits for READY=1."""
        argv = python_module("bluecached.daemon", "--config", os.devnull,
                             *set_options(self.settings))
        self.process = Supervised("bluecached", argv, self.root / "notify.sock", log=self.log,
                                  env={**_package_env(), **(env or {})}, cwd="/").start()
        if wait:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 60) -> float:
        """When READY=1 came (time.time()); raises RuntimeError with the log if it did not."""
        try:
            return self.process.wait_ready(timeout)
        except NotReady as e:
            raise RuntimeError(f"{e}:\n" + self.log.read_text(errors="replace")) from None

    @property
    def proc(self) -> subprocess.Popen | None:
        return self.process.proc if self.process else None

    def client(self, timeout: float = 10, name: str = "bench") -> SyncClient:
        return SyncClient(self.endpoints["control"], timeout=timeout, client_name=name)

    def regions(self) -> RegionChannel:
        return RegionChannel(self.endpoints["regions"])

    def settle(self, timeout: float = 600) -> float:
        """Waits until it has written every stored file behind to NVMe, so that loads are
        measured as hits on blocks stored a while ago, not against the write-behind of the
        burst just stored (on 2 cores that halves a read). Returns the seconds waited."""
        t0 = time.monotonic()
        client = self.client()
        try:
            while client.call("stats")["dirty_bytes"]:
                if time.monotonic() - t0 > timeout:
                    raise RuntimeError("write-behind did not finish")
                time.sleep(0.05)
        finally:
            client.close()
        return time.monotonic() - t0

    def stop(self, sig=signal.SIGTERM, timeout: float = 120) -> int | None:
        """Signals it and waits, SIGKILL after `timeout`; its exit status."""
        return self.process.stop(sig, timeout) if self.process else None

    def unexpected_log_lines(self, allowed=()) -> list[str]:
        return _log_problems(self.log, allowed)

    def cleanup(self) -> None:
        with contextlib.suppress(Exception):
            self.stop(signal.SIGKILL, timeout=30)
        if self._own_state is not None:
            shutil.rmtree(self._own_state, ignore_errors=True)


class Hostd:
    """bluecache-hostd mounting `mountpoint`, connected to a Bluecached."""

    def __init__(self, daemon: Bluecached, mountpoint: Path, **settings):
        self.daemon = daemon
        self.mountpoint = mountpoint
        self.settings = {"mountpoint": str(mountpoint), "state_dir": str(daemon.state_dir),
                         "daemon.request_timeout": "20s", "metrics.listen": "", **settings}
        self.log = daemon.root / "hostd.log"
        self.process: Supervised | None = None

    def start(self, timeout: float = 60) -> "Hostd":
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        argv = python_module("hostd.daemon", "--config", os.devnull,
                             *set_options(self.settings))
        self.process = Supervised("hostd", argv, self.daemon.root / "hostd-notify.sock",
                                  log=self.log, env=_package_env(), cwd="/").start()
        try:
            self.process.wait_ready(timeout)
        except NotReady as e:
            raise RuntimeError(f"{e}:\n" + self.log.read_text(errors="replace")) from None
        return self

    @property
    def proc(self) -> subprocess.Popen | None:
        return self.process.proc if self.process else None

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> int | None:
        return self.process.stop(sig, timeout) if self.process else None

    def unexpected_log_lines(self, allowed=()) -> list[str]:
        return _log_problems(self.log, allowed)



# -- store/load results of the block benches (ioctl_bench, gpu_bench) ---------------------------


def write_block_results(out_dir: Path, name: str, out: dict, heading: str, labels: list[str],
                        phases: tuple[str, str], chart_title: str, notes: list[str] = (),
                        aggregate: str = "best of") -> None:
    """NAME.json/.md/.png of a bench that stores and loads `out["blocks"]` blocks per target:
    out["results_mib_s"][target] = {"store_mib_s", "load_mib_s"}, one `labels` entry each
    (`aggregate` of out["rounds"] rounds); `phases` names store and load in the legend."""
    results = out["results_mib_s"]
    lines = markdown_head(heading, out, f"{out['blocks']} blocks of {out['block_mib']} MiB, "
                                        f"{aggregate} {out['rounds']}, "
                                        f"on {out['machine']['device']}.")
    lines += ["| target | store MiB/s | load MiB/s |", "|---|---|---|"]
    lines += [f"| {label} | {r['store_mib_s']} | {r['load_mib_s']} |"
              for label, r in zip(labels, results.values(), strict=True)]
    lines += [""] + [f"- {goal}: {'met' if met else 'NOT met'}"
                     for goal, met in out["targets_met"].items()] + [""] + list(notes)

    def bars(plt, path: Path) -> None:
        fig, ax = plt.subplots(figsize=(7, 4))
        for i, (key, phase) in enumerate(zip(("store_mib_s", "load_mib_s"), phases,
                                             strict=True)):
            vals = [r[key] for r in results.values()]
            drawn = ax.bar([x + i * 0.38 for x in range(len(vals))], vals, 0.38, label=phase)
            ax.bar_label(drawn, fmt="%.0f", fontsize=8)
        ax.set_xticks([x + 0.19 for x in range(len(labels))], labels)
        ax.set_ylabel("MiB/s")
        ax.set_title(chart_title, fontsize=9)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=110)

    write_results(out_dir, name, out, "\n".join(lines), bars)
