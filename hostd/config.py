"""hostd's table: every key of /etc/bluecache/hostd.yaml, on bluecached's schema machinery (so
its errors, --set and SIGHUP reload work the same way)."""

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from bluecached.config import BLUECACHED
from bluecached.config.schema import ConfigError as ConfigError  # re-exported for hostd's callers
from bluecached.config.schema import (
    Field,
    Schema,
    apply_live_changes,
    as_choice,
    as_count,
    as_doca_library,
    as_duration,
    as_endpoint,
    as_flag,
    as_host_port,
    as_path,
    as_pci_address,
    as_text,
    changed_keys,
    load_yaml,
    render_defaults,
    set_log_level,
)

DEFAULT_PATH = Path("/etc/bluecache/hostd.yaml")


def _kernel_timeout_outlasts_hostd(cfg) -> tuple[str, str] | None:
    """hostd answers a request within a few daemon.request_timeout even with bluecached gone
    (one request may wait for writes in flight, then for its own call); a kernel timeout
    shorter than that would abort a healthy mount."""
    kernel, daemon = cfg.mount.kernel_request_timeout, cfg.daemon.request_timeout
    if 0 < kernel < 3 * daemon:
        return ("mount.kernel_request_timeout",
                f"{kernel} s is less than 3 x daemon.request_timeout ({daemon:g} s): the kernel "
                f"would abort the mount while hostd still waits for bluecached (0 turns it off)")
    return None


HOSTD = Schema("HostdConfig", (
    "hostd configuration: the FUSE mount at /mnt/kv-cache and its link to bluecached.\n"
    "Durations are seconds or a number with a unit: ms, s, m, h, d.\n"
    "`systemctl reload bluecache-hostd` (SIGHUP) applies the keys marked as reloaded on SIGHUP;\n"
    "changes to any other key are logged as needing a restart.\n"
    "Any key can also be set over this file on the command line, the value written as here:\n"
    "bluecache-hostd --set mount.read_ahead=8 --set mount.allow_other=false"
), {
    "mountpoint": Field(as_path(), "/mnt/kv-cache", "Where the cache is mounted."),
    # The same directory as bluecached's state_dir (embedded mode), so the same default.
    "state_dir": Field(as_path(), BLUECACHED.fields["state_dir"].default,
                       "Embedded mode: bluecached's state directory, where its ipc sockets are."),
    "log_level": Field(as_choice("debug", "info", "warning", "error"), "info",
                       "Log verbosity: debug, info, warning or error.", live=set_log_level),
    "daemon": Schema("DaemonLink", "How to reach bluecached.", {
        "control": Field(as_endpoint(), "ipc",
                         '"ipc" (embedded: the socket in state_dir) or "tcp://DPU:PORT".'),
        "events": Field(as_endpoint(), "ipc", '"ipc" or "tcp://DPU:PORT".'),
        "curve_dir": Field(as_path(), "/etc/bluecache/curve",
                           "tcp only: this host's CURVE key pair and the daemon's public key."),
        "curve_name": Field(as_text(pattern=r"[^/]+", wanted="a key pair name (no '/')"),
                            "client", "tcp only: this host's key pair name."),
        "request_timeout": Field(as_duration(minimum=0.1), "5s",
                                 "The deadline of a request through the mount that needs "
                                 "bluecached: while bluecached is stopped, hung or restarting, "
                                 "it fails with EIO once this has passed (a connector's miss; "
                                 "docs/operations.md, Bounded I/O time). Also how long hostd "
                                 "waits for bluecached at start."),
    }),
    "doca": Schema("HostDocaConfig", (
        "Used when bluecached runs the doca engine: hostd exports its staging memory and "
        "zero-copy client buffers to the DPU with DOCA."), {
        "pci_address": Field(as_pci_address(), "b1:00.0",
                             "The host-side PCI function of the BlueField (`lspci -d 15b3:` on "
                             "the host)."),
        "library": Field(as_doca_library(), "system",
                         "system (the DOCA SDK), simulator (the DOCA API simulator: no "
                         "BlueField involved) or the absolute path of a library."),
    }),
    "mount": Schema("MountConfig", "FUSE mount options.", {
        "allow_other": Field(as_flag(), True,
                             "Let other users (vLLM often runs as its own user) use the mount; "
                             "permissions are still checked (default_permissions)."),
        "write_ack": Field(as_choice("staged", "stored"), "staged",
                           "When a write is answered: staged (its bytes are in hostd's staging "
                           "slot; the daemon call goes on in the background, a failure is "
                           "reported at close and the file dropped) or stored (once the "
                           "daemon has it; one daemon round trip per 1 MiB on the writer's "
                           "path)."),
        "receive_in_place": Field(as_flag(), True,
                                  "Read each FUSE write request straight into a staging slot "
                                  "(the fuse shim), so hostd copies no byte of a POSIX write; "
                                  "false: pyfuse3 hands hostd a copy of the bytes, which hostd "
                                  "copies into a slot (for comparison)."),
        "reader_thread": Field(as_flag(), True,
                               "Read requests from /dev/fuse in a thread of the fuse shim, "
                               "ahead of the event loop: the kernel's copy of each write's "
                               "bytes then runs beside hostd's Python work, on another core; "
                               "false: the event loop reads each request itself (one hand-over "
                               "between threads less per request)."),
        "read_ahead": Field(as_count(minimum=0, maximum=64), 4,
                            "How many 1 MiB pieces past a sequential reader's last full read "
                            "hostd asks bluecached for before the reader does (each in a spare "
                            "staging slot), while at most 2 files are open for reading (more "
                            "readers keep the daemons busy themselves); never for a file open "
                            "for writing. 0: none."),
        "passthrough": Field(as_flag(), True,
                             "Let the kernel read a complete cached file straight from the "
                             "memory bluecached keeps it in, and write a new file straight "
                             "into it (FUSE passthrough, kernel 6.9+, embedded mode): no read "
                             "or write of it reaches hostd. Where that cannot be (a file "
                             "being written by another, not in DRAM, DPU mode) reads and "
                             "writes go through hostd as with false."),
        "kept_opens": Field(as_count(minimum=0, maximum=4096), 256,
                            "How many files' DRAM memory hostd keeps (an fd each) after their "
                            "last passthrough reader closed, so that the next read-only open "
                            "of one is answered by hostd alone, bluecached told right after "
                            "(docs/architecture.md, What a hit costs). bluecached says when "
                            "one leaves DRAM; hostd lets it go then. The read-only open "
                            "of a file only on NVMe that its lookup said lends nothing is "
                            "answered by hostd alone too. 0: every open asks bluecached "
                            "first."),
        "kept_idle": Field(as_duration(), "60s",
                           "A kept file unopened this long is let go (kept_opens)."),
        "max_pages": Field(as_count(minimum=0, maximum=65535), 1024,
                           "Largest FUSE read request the kernel may send, in 4 KiB pages "
                           "(1024, the default: 4 MiB); 0 or 256 keeps libfuse's 1 MiB, the "
                           "size of hostd's staging slots. Above 256 hostd raises the "
                           "fs.fuse.max_pages_limit sysctl at startup where it is lower, and "
                           "serves each larger read whole from one of 16 buffers that size "
                           "(read ahead by that size). It matters for reads served by hostd "
                           "(NVMe hits; passthrough reads use no requests): 1024 against 256 "
                           "in the same session, NVMe hits at 8 threads llm-d 0.73x vs 0.58x, "
                           "vLLM 0.63x vs 0.54x of a cold plain directory, at 1 thread the "
                           "same (2-core AMD EPYC VM: docs/benchmarks/hit-session6.md, "
                           "hit-pages256.md). Writes stay at most 1 MiB."),
        "huge_pages": Field(as_flag(), True,
                            "Put hostd's staging region (which NVMe hits are read into with "
                            "O_DIRECT) on 2 MiB pages: 32 MiB read from disk in 9.1 ms instead "
                            "of 13.1 on the 2-core AMD EPYC benchmark VM "
                            "(bench/staging_pages.py). Needs the kernel's shmem huge page "
                            "policy (/sys/kernel/mm/transparent_hugepage/shmem_enabled) to "
                            "honour madvise: where it is `never`, hostd sets it to `advise`, "
                            "which changes nothing for "
                            "processes that do not ask. false: 4 KiB pages, the system left "
                            "as it is."),
        "staging_slots": Field(as_count(minimum=64, maximum=4096), 128,
                               "1 MiB staging buffers shared with the DMA engine: how many POSIX "
                               "requests can be in flight at once (at least 64)."),
        "entry_timeout": Field(as_duration(), "60s",
                               "How long the kernel trusts a name it looked up."),
        "attr_timeout": Field(as_duration(), "60s",
                              "How long the kernel trusts a file's attributes."),
        "negative_timeout": Field(as_duration(), "2s",
                                  "How long the kernel remembers that a name does not exist."),
        "kernel_request_timeout": Field(
            as_count(minimum=0, maximum=65535), 60,
            "Seconds the kernel lets a request to hostd go unanswered before it aborts the "
            "connection (FUSE request timeout, kernel 6.14+; 0: not asked, the sysctl "
            "fs.fuse.default_request_timeout applies): the backstop for a stopped or hung "
            "hostd. Aborted, the mount answers ENOTCONN until hostd is restarted (systemd "
            "does that once hostd exits). At least 3 x daemon.request_timeout."),
    }),
    "zero_copy": Schema("ZeroCopyConfig", "The zero-copy ioctl (docs/ioctl.md).", {
        "kept_regions": Field(as_count(minimum=0, maximum=4096), 16,
                              "Client buffers (memfds, dma-bufs) kept registered with "
                              "bluecached between requests, so a client that reuses its "
                              "buffer pays the mapping once, not per request; 0: each request "
                              "registers and releases its own. A freed buffer stays allocated "
                              "while it is kept."),
        "region_idle": Field(as_duration(minimum=0.1), "10s",
                             "A kept buffer unused this long is released."),
    }),
    "metrics": Schema("HostdMetricsConfig", "Prometheus metrics and health probes.", {
        "listen": Field(as_host_port(optional=True), "127.0.0.1:9465",
                        'HTTP endpoint "HOST:PORT" for /metrics, /healthz and /readyz (the '
                        'mount serves); "" or null disables it. bluecached\'s is 9464.'),
    }),
}, check=_kernel_timeout_outlasts_hostd)


def load_config(path: Path | None, overrides: Mapping[str, Any] | None = None,
                assignments: Iterable[str] = ()) -> Any:
    """Load hostd's config: the file (None: defaults only), then the --set `assignments` and
    `overrides` over it."""
    return load_yaml(path, HOSTD, overrides, assignments)


def reload_changes(old: Any, new: Any) -> tuple[dict[str, Any], list[str]]:
    return changed_keys(HOSTD, old, new)


def apply_reload(old: Any, new: Any) -> tuple[dict[str, Any], list[str]]:
    """A SIGHUP reload: applies the live keys that changed (log_level); returns what
    reload_changes returns."""
    return apply_live_changes(HOSTD, old, new)


def default_yaml() -> str:
    return render_defaults(HOSTD)
