"""bluecached's table: every key of /etc/bluecache/bluecached.yaml with its parser, default,
comment and, for the keys a SIGHUP reloads, how the running daemon takes the new value."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from ..tiers.dram import CHUNK_SIZE
from .schema import (
    Field,
    GiB,
    KiB,
    MiB,
    Schema,
    apply_live_changes,
    as_choice,
    as_count,
    as_doca_library,
    as_duration,
    as_endpoint,
    as_flag,
    as_fraction,
    as_host_port,
    as_path,
    as_pci_address,
    as_size,
    as_text,
    changed_keys,
    format_size,
    load_yaml,
    render_defaults,
    set_log_level,
)

DEFAULT_PATH = Path("/etc/bluecache/bluecached.yaml")


# A socket kv_events binds: tcp://HOST:PORT (HOST may be *) or ipc:///absolute/path.
_ZMQ_BIND = r"tcp://(\*|[A-Za-z0-9.\-]+|\[[0-9A-Fa-f:.]+\]):[0-9]{1,5}|ipc:///[^\s\x00]+"
_ZMQ_WANTED = '"tcp://HOST:PORT" (HOST may be *) or "ipc:///PATH"'


def _watermarks_ordered(tier: Any) -> tuple[str, str] | None:
    # Eviction runs from high down to low; low >= high would evict forever or never.
    if tier.low_watermark >= tier.high_watermark:
        return "low_watermark", (f"expected a value below high_watermark ({tier.high_watermark}), "
                                 f"got {tier.low_watermark}")
    return None


def _watermarks(high: float, low: float, marks_in: Callable[[Any], Any]) -> dict[str, Field]:
    """The tier's two watermarks. `marks_in(tiers)` is the running Tiers' Watermarks for this
    tier, which the evictor reads on every pass: a reload sets the new values there."""

    def set_high(tiers: Any, value: float) -> None:
        marks_in(tiers).high = value

    def set_low(tiers: Any, value: float) -> None:
        marks_in(tiers).low = value

    return {
        "high_watermark": Field(as_fraction(allow_one=True), high,
                                "Start evicting when the tier is this full (0 < x <= 1).",
                                live=set_high),
        "low_watermark": Field(as_fraction(allow_one=False), low,
                               "Stop evicting at this fill; below high_watermark.", live=set_low),
    }


def _remote_complete(remote: Any) -> tuple[str, str] | None:
    if remote.enabled and not remote.bucket:
        return "bucket", "expected a bucket name when the remote tier is enabled, got nothing"
    if remote.part_size > remote.multipart_threshold:
        return "part_size", (f"expected at most multipart_threshold "
                             f"({format_size(remote.multipart_threshold)}), "
                             f"got {format_size(remote.part_size)}")
    return None


def _staging_holds_a_chunk(doca: Any) -> tuple[str, str] | None:
    if doca.staging_size < doca.max_chunk:
        return "staging_size", (f"expected at least max_chunk ({doca.max_chunk} bytes), "
                                f"got {doca.staging_size}")
    return None


def _kv_events_consistent(kv: Any) -> tuple[str, str] | None:
    # Two sockets cannot bind one endpoint; the topic names only the fields bluecached fills.
    if kv.replay_endpoint and kv.replay_endpoint == kv.endpoint:
        return "replay_endpoint", f"expected an endpoint other than endpoint, got {kv.endpoint}"
    try:
        kv.topic.format(host="h", model="m", medium="M")
    except (KeyError, IndexError, ValueError, AttributeError) as e:
        return "topic", (f"expected text with at most {{host}}, {{model}} and {{medium}} in "
                         f"braces, got {kv.topic!r} ({type(e).__name__}: {e})")
    return None


BLUECACHED = Schema("Config", (
    "bluecached configuration.\n"
    "\n"
    "Sizes are bytes or a number with a unit: B, K/KB/KiB, M/MB/MiB, G/GB/GiB, T/TB/TiB.\n"
    "Every unit is a power of 1024 (4GB == 4GiB); decimals such as 1.5GiB round down.\n"
    "Durations are seconds or a number with a unit: ms, s, m, h, d.\n"
    "`systemctl reload bluecached` (SIGHUP) applies the keys marked as reloaded on SIGHUP;\n"
    "changes to any other key are logged as needing a restart.\n"
    "Any key can also be set over this file on the command line, the value written as here:\n"
    "bluecached --set tiers.dram.size=8GiB --set tiers.nvme.o_direct=off"
), {
    "state_dir": Field(as_path(), "/var/lib/bluecache",
                       "Directory for the daemon's state: its ipc sockets and the loopback "
                       "engine's dma.sock live here."),
    "log_level": Field(as_choice("debug", "info", "warning", "error"), "info",
                       "Log verbosity: debug, info, warning or error.", live=set_log_level),
    "engine": Field(as_choice("loopback", "doca"), "loopback",
                    "Data mover: loopback (memfds passed over dma.sock, no DPU needed) or doca "
                    "(BlueField DMA; see the doca section)."),
    "doca": Schema("DocaConfig", "The doca engine (engine: doca): DOCA DMA on the BlueField.", {
        "pci_address": Field(as_pci_address(), "03:00.0",
                             "The DPU-side PCI function that does the DMA (`lspci` on the DPU; "
                             "03:00.0 on a BlueField-3 in DPU mode)."),
        "library": Field(as_doca_library(), "system",
                         "system (the DOCA SDK in /opt/mellanox/doca), simulator (the DOCA API "
                         "simulator shipped with bluecache, for tests and embedded mode: no "
                         "BlueField involved) or the absolute path of a library."),
        "queue_depth": Field(as_count(minimum=1, maximum=4096), 32,
                             "DMA tasks in flight at once (capped by the device and by "
                             "staging_size / max_chunk)."),
        "staging_size": Field(as_size(minimum=1 * MiB, maximum=4 * GiB), "64MiB",
                              "DPU memory the engine stages transfers in."),
        "max_chunk": Field(as_size(minimum=4 * KiB, maximum=1 * GiB), "1MiB",
                           "Largest single DMA task (also capped by the device's max_buf_size)."),
        "completion": Field(as_choice("thread", "poll"), "thread",
                            "How completions are collected: a dedicated progress thread, or a "
                            "task polling doca_pe_progress in the event loop."),
    }, check=_staging_holds_a_chunk),
    "control": Schema("ControlConfig", "Control plane (ZeroMQ).", {
        "listen": Field(as_endpoint(), "ipc",
                        'Request socket: "ipc" (a socket in state_dir) or "tcp://HOST:PORT".'),
        "events": Field(as_endpoint(), "ipc",
                        'Event publisher socket: "ipc" or "tcp://HOST:PORT".'),
        "curve_dir": Field(as_path(), "/etc/bluecache/curve",
                           "Directory with the CURVE keys that secure tcp:// sockets."),
        "max_message_bytes": Field(as_size(minimum=1 * KiB, maximum=16 * MiB), 65536,
                                   "Largest control message accepted (1KiB to 16MiB)."),
        "session_timeout": Field(as_duration(minimum=0.1), "2m",
                                 "A client silent this long is gone: its open handles and "
                                 "kernel references are released (hostd pings every second)."),
    }),
    "tiers": Schema("TiersConfig", "Storage tiers, fastest first.", {
        "dram": Schema("DramConfig", "DRAM tier: the first stop for every write.", {
            "size": Field(as_size(minimum=CHUNK_SIZE), "4GiB",
                          "Memory reserved for cached chunks (1MiB each; at least one)."),
            "prefault": Field(as_size(), "256MiB",
                              "Free memory kept mapped and touched ahead of need (in the "
                              "background), so requests do not pay page faults for fresh "
                              "memory; it is committed on top of what the cache holds. The "
                              "tier's whole size maps it all at start (a DPU); 0 turns it off."),
            "huge_pages": Field(as_flag(), True,
                                "Keep objects in DRAM on 2 MiB pages. On the 2-core AMD EPYC "
                                "benchmark VM a POSIX store's 32 MiB (written by the writer's "
                                "kernel into the object's memfd) took ~2.2 ms instead of ~11, a "
                                "read of it ~2.0 ms instead of 2.4-5.0 "
                                "(docs/benchmarks/hit-notes.md). bluecached sets the kernel's "
                                "shmem huge page policy "
                                "(/sys/kernel/mm/transparent_hugepage/shmem_enabled) to "
                                "`within_size` where it is `never` or `advise`: system-wide, "
                                "every memfd and SysV shared memory segment then gets 2 MiB "
                                "pages where its size covers them (docs/operations.md). false: "
                                "4 KiB pages, the system left as it is."),
            **_watermarks(0.90, 0.75, marks_in=lambda tiers: tiers.dram_marks),
        }, check=_watermarks_ordered),
        "nvme": Schema("NvmeConfig", "NVMe tier: segment files on a local filesystem.", {
            "path": Field(as_path(optional=True), None,
                          "Directory for segment files and the index; null means "
                          "<state_dir>/nvme."),
            "size": Field(as_size(), "64GiB", "Capacity of the tier; 0 disables it."),
            "segment_size": Field(as_size(minimum=1 * MiB, multiple=4096), "16GiB",
                                  "Size of each segment file: at least 1MiB, a multiple of "
                                  "4096. Also the largest file the cache holds (an object is "
                                  "one extent inside a segment): a write or truncate past it "
                                  "fails with EFBIG. Fixed once segments are written."),
            "hit_path": Field(as_choice("auto", "clone", "direct", "stream", "promote"), "auto",
                              "How a read of an object only on NVMe is served. auto: clone "
                              "where the filesystem of tiers.nvme.path checks its data "
                              "(btrfs with data checksums), else direct. clone: an O_DIRECT open "
                              "(vLLM's) gets a reflink clone of the object's extent, read by "
                              "the kernel itself (FUSE passthrough), btrfs checking each "
                              "block's crc32c; buffered opens, and files not a whole number of "
                              "4KiB pages, are read as direct; refused at start where the "
                              "filesystem does not check. direct: read "
                              "from the disk straight into the reply (hostd's staging slot), "
                              "each 1MiB chunk answered once its CRC32C matched; no DRAM "
                              "taken; the object's next open brings it into DRAM (stream). "
                              "stream: brought into DRAM, each chunk served as soon as it is "
                              "in and checked; opens after it read DRAM by passthrough. "
                              "promote: the open waits until the whole object is in DRAM "
                              "and checked. (Reads of an NVMe hit other than clone go "
                              "through hostd; DRAM hits are read by the kernel itself.)"),
            "read_depth": Field(as_count(minimum=1, maximum=256), 4,
                                "Reads of hit_path direct that bluecached keeps on the disk at "
                                "once, all objects together; one object's go one at a time, "
                                "in order. Sent all at once, a virtual disk that answers a "
                                "batch only when all of it is in kept the readers waiting and "
                                "itself idle while the replies were copied: 8 and 64 readers "
                                "0.63-0.74x of a cold plain directory unbounded, 0.88-0.96x "
                                "with 4 (2-core AMD EPYC VM, tiers/read_lanes.py). A real "
                                "NVMe splits each 4MiB read into its own commands: a few "
                                "keep its queue full."),
            "o_direct": Field(as_choice("auto", "on", "off", booleans=("on", "off")), "auto",
                              "Bypass the page cache with O_DIRECT: auto (if the filesystem "
                              "supports it), on or off."),
            **_watermarks(0.95, 0.85, marks_in=lambda tiers: tiers.nvme_marks),
        }, check=_watermarks_ordered),
    }),
    "write_policy": Field(as_choice("write-behind", "write-through"), "write-behind",
                          "write-behind acknowledges writes once in DRAM and copies them to NVMe "
                          "later; write-through acknowledges only once on NVMe."),
    "durability": Field(as_choice("fsync", "none"), "fsync",
                        "fsync makes NVMe writes and the journal durable before they count; none "
                        "skips fsync (faster, but a crash may lose recent objects)."),
    "tmp_max_age": Field(as_duration(), "1h",
                         "Orphaned *.tmp files older than this are removed; 0 disables this."),
    "journal_max_bytes": Field(as_size(minimum=1), "64MiB",
                               "The index journal is compacted into a snapshot past this size."),
    "remote": Schema("RemoteConfig", (
        "Remote tier: an S3 bucket shared by many hosts (Ceph RGW, AWS S3, SeaweedFS ...). Files "
        "are stored under their path below the mount; see docs/operations.md."), {
        "enabled": Field(as_flag(), False, "Use the remote tier."),
        "endpoint": Field(as_text(pattern=r"(https?://[^\s/]+(/[^\s]*)?)?",
                                  wanted='"" (AWS) or an http:// or https:// URL'), "",
                          'S3 endpoint URL, e.g. "https://rgw.example:7480"; "" means AWS S3 '
                          "in `region`."),
        "bucket": Field(as_text(pattern=r"([a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])?",
                                wanted="an S3 bucket name (3-63 of a-z 0-9 . -)"), "",
                        "Bucket (it must exist; bluecached does not create it)."),
        "prefix": Field(as_text(pattern=r"[^\x00-\x1f]{0,512}",
                                wanted="a key prefix (printable, at most 512 bytes)"), "",
                        'Key prefix, e.g. "kv/"; "/" is added if it lacks one.'),
        "region": Field(as_text(pattern=r"[a-z0-9\-]{1,64}", wanted="a region name"),
                        "us-east-1", "Region used for signing requests."),
        "credentials_file": Field(as_path(optional=True), None,
                                  "AWS-style credentials file ([default] aws_access_key_id, "
                                  "aws_secret_access_key); it must be mode 0600 or stricter. "
                                  "null uses botocore's default chain (environment, "
                                  "instance role)."),
        "ca_bundle": Field(as_path(optional=True), None,
                           "PEM file of CA certificates for https endpoints; null uses the "
                           "system's."),
        "verify_tls": Field(as_flag(), True, "Check the endpoint's TLS certificate."),
        "addressing_style": Field(as_choice("auto", "path", "virtual"), "auto",
                                  "Bucket in the path or in the host name; most non-AWS "
                                  "endpoints want path."),
        "sign_payload": Field(as_flag(), False,
                              "Put a SHA-256 of every uploaded byte in the request signature. "
                              "Off: uploads say UNSIGNED-PAYLOAD (TLS protects the bytes on "
                              "https, the CRC32C per chunk is checked on every fetch, and a "
                              "GET's body is not signed either way); on: for an endpoint whose "
                              "policy demands signed payloads. It costs a SHA-256 pass over "
                              "each upload on both ends."),
        "timeout": Field(as_duration(minimum=0.1), "5s",
                         "Connect and read timeout of each S3 request; a request that gets no "
                         "answer marks the tier unreachable."),
        "admission": Field(as_choice("all", "reread", "age"), "all",
                           "Which files are uploaded: all (once written), reread (once read "
                           "again after being written) or age (those still cached "
                           "admission_age after being written)."),
        "admission_age": Field(as_duration(), "30s", "The age for admission: age."),
        "queue_max": Field(as_count(minimum=1), 1024,
                           "Uploads waiting at most; past it new ones are dropped and counted."),
        "upload_workers": Field(as_count(minimum=1, maximum=64), 2, "Concurrent uploads."),
        "part_size": Field(as_size(minimum=5 * MiB, maximum=5 * GiB), "8MiB",
                           "Part size of multipart uploads and ranged downloads."),
        "multipart_threshold": Field(as_size(minimum=5 * MiB), "64MiB",
                                     "Objects larger than this are uploaded in parts and "
                                     "downloaded in parallel ranges; up to it, one request "
                                     "streams each (several objects are in flight at once: "
                                     "upload_workers, prefetch). Lower it for links where one "
                                     "stream is slow."),
        "part_concurrency": Field(as_count(minimum=1, maximum=64), 4,
                                  "Parts moved at once for one object."),
        "prefetch": Field(as_count(minimum=0, maximum=64), 2,
                          "Fetches started by a lookup that found a file (a connector checks "
                          "a prefix of blocks, then reads them), run at once in lookup order; "
                          "0: a file's bytes are fetched on its first read only."),
        "prefetch_max_bytes": Field(as_size(), "256MiB",
                                    "Prefetched bytes not read yet at most (and at most half "
                                    "of DRAM); a prefetch that would need DRAM the tier cannot "
                                    "free at once is dropped, and the read fetches instead."),
        "negative_ttl": Field(as_duration(), "2s",
                              "A name the remote tier lacked is not asked for again this long."),
        "retry_interval": Field(as_duration(minimum=0.1), "5s",
                                "While unreachable, probe the endpoint this often."),
        "max_bytes": Field(as_size(), 0,
                           "Remote capacity under the prefix; the oldest objects are deleted "
                           "past it (down to 90%). 0: unbounded."),
        "max_age": Field(as_duration(), 0,
                         "Objects older than this are deleted. 0: kept until max_bytes."),
        "enforce_interval": Field(as_duration(minimum=1), "1m",
                                  "How often max_bytes and max_age are enforced (one listing "
                                  "of the prefix each time)."),
    }, check=_remote_complete),
    "kv_events": Schema("KvEventsConfig", (
        "KV events: BlockStored/BlockRemoved/AllBlocksCleared for the blocks the connectors "
        "write, in vLLM's KV event format, for llm-d's KV-cache indexer and Dynamo's KV router "
        "(docs/operations.md, \"KV events\"). Off by default: it binds a socket anyone who "
        "can reach it may read."), {
        "enabled": Field(as_flag(), False, "Publish KV events."),
        "endpoint": Field(as_text(pattern=_ZMQ_BIND, wanted=_ZMQ_WANTED), "tcp://*:5577",
                          "PUB socket: bound where the host is * (or ipc://), else connected "
                          "to (a subscriber that binds, as llm-d's indexer with its own "
                          "zmqEndpoint), as vLLM's kv-events endpoint."),
        "replay_endpoint": Field(as_text(pattern=f"({_ZMQ_BIND})?",
                                         wanted=_ZMQ_WANTED + ' or ""'), "tcp://*:5578",
                                 "ROUTER socket answering replay requests for missed sequence "
                                 'numbers (as vLLM\'s); "" for none.'),
        "topic": Field(as_text(pattern=r"[^\x00-\x1f]{0,255}",
                               wanted="a topic of at most 255 printable characters"),
                       "kv@{host}@{model}",
                       "Topic of each message; {host} is this machine's name, {model} the "
                       "model directory's name as the connector wrote it (\"/\" as \"_\"), "
                       "{medium} the medium. llm-d's indexer parses kv@<pod>@<model>; a fixed "
                       "string such as kv@node1@meta-llama/Llama-3.1-8B works too."),
        "medium": Field(as_text(pattern=r"[A-Za-z0-9_]{1,32}", wanted="a medium name "
                                "(letters, digits, _)"), "STORAGE",
                        "The medium the events name: STORAGE is vLLM's name for a storage "
                        "tier (Dynamo reads it as its disk tier); llm-d's FS backend says "
                        "SHARED_STORAGE."),
        "block_hash": Field(as_choice("int", "bytes"), "int",
                            "Block hashes as vLLM publishes them by default: int (the low 64 "
                            "bits) or bytes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)."),
        "buffer_steps": Field(as_count(minimum=1, maximum=1_000_000), 10000,
                              "Batches kept for replay."),
        "hwm": Field(as_count(minimum=1, maximum=10_000_000), 100000,
                     "High-water mark of the PUB socket per subscriber (a slower one misses "
                     "what is past it), and events waiting to be published at most."),
    }, check=_kv_events_consistent),
    "metrics": Schema("MetricsConfig", "Prometheus metrics.", {
        "listen": Field(as_host_port(optional=True), "127.0.0.1:9464",
                        'HTTP endpoint "HOST:PORT" for /metrics; "" or null disables it.'),
    }),
})

Config = BLUECACHED.cls


def load_config(path: Path | None, overrides: Mapping[str, Any] | None = None,
                assignments: Iterable[str] = ()) -> Config:
    """Load bluecached's config: the file (None: defaults only; a path given must exist, so the
    daemon passes DEFAULT_PATH only when it exists or the operator named it), then the --set
    `assignments` and `overrides` over it."""
    config = load_yaml(path, BLUECACHED, overrides, assignments)
    if config.tiers.nvme.path is None:  # its default hangs off state_dir, known only now
        nvme = dataclasses.replace(config.tiers.nvme, path=config.state_dir / "nvme")
        config = dataclasses.replace(config, tiers=dataclasses.replace(config.tiers, nvme=nvme))
    return config


def reload_changes(old: Config, new: Config) -> tuple[dict[str, Any], list[str]]:
    """What a SIGHUP reload would find: (live dotted keys that changed -> new value, dotted keys
    that changed but only take effect after a restart)."""
    return changed_keys(BLUECACHED, old, new)


def apply_reload(old: Config, new: Config, tiers: Any) -> tuple[dict[str, Any], list[str]]:
    """A SIGHUP reload: applies the live keys that changed to the running `tiers` (and the
    logger); returns what reload_changes returns."""
    return apply_live_changes(BLUECACHED, old, new, tiers)


def default_yaml() -> str:
    """bluecached's defaults as the commented YAML shipped as the packaged conffile."""
    return render_defaults(BLUECACHED)
