"""bluecached's configuration file, /etc/bluecache/bluecached.yaml.

The first half is a small declarative schema machinery that hostd reuses with its own table:
a `Schema` maps each key to a `Field` (parser, default, comment, live-reloadable or not) or to a
nested `Schema`, and `load_yaml` turns a file into frozen dataclasses built from that table.
Keeping the table declarative is what lets one place drive validation, SIGHUP reload decisions
(`reload_changes`) and the shipped conffile (`default_yaml`).

The second half is bluecached's own table and `load_config`.

Sizes: every unit is a power of 1024, so "4GB", "4G" and "4GiB" all mean 4 * 2**30 bytes. A cache
is carved into pages and chunks, and nobody sizing one means 10**9.
"""

from __future__ import annotations

import dataclasses
import math
import re
import reprlib
import textwrap
from collections.abc import Callable, Mapping
from decimal import Decimal
from pathlib import Path
from typing import Any

import yaml

from .tiers.dram import CHUNK_SIZE

DEFAULT_PATH = Path("/etc/bluecache/bluecached.yaml")

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
MAX_SIZE = (1 << 63) - 1  # sizes end up in off_t and int64 fields

# The source named in errors about `overrides` (e.g. from `bluecachectl up --dram-size`).
OVERRIDE = "override"

# raw YAML value -> typed value; raises ValueError("expected ..., got ...").
Parser = Callable[[Any], Any]


class ConfigError(Exception):
    """A problem phrased for the operator: '<file>: <dotted.key>: <what was expected>'."""

    def __init__(self, source: str, problem: str, key: str | None = None):
        self.source, self.problem, self.key = source, problem, key
        super().__init__(f"{source}: {key}: {problem}" if key else f"{source}: {problem}")


# Error messages quote the offending value; a bounded repr keeps a pasted blob (or a YAML alias
# bomb) from turning into a megabyte of log line.
_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 80


def _show(value: Any) -> str:
    try:
        return _repr.repr(value)
    except ValueError:  # an int too long to print (sys.set_int_max_str_digits)
        return "a very long number"


# ---------------------------------------------------------------------------------------------
# Value parsers. parse_size/parse_duration are also what the CLI uses for its flags.

# "<number> <unit>" for sizes and durations; ASCII so "１GiB" (fullwidth digit) is not a number.
_NUMBER_UNIT_RE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([a-z]*)", re.ASCII | re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1}
for _i, _letter in enumerate("kmgt", start=1):
    _SIZE_UNITS.update(dict.fromkeys((_letter, _letter + "b", _letter + "ib"), 1024**_i))


def parse_size(value: str | int) -> int:
    """Bytes from an int or a string such as '4GiB', '512 MiB', '1.5g' (all units binary).

    A decimal number needs a unit and is rounded down to whole bytes; bare numbers are bytes.
    """
    bad = ValueError(f"expected a size such as 4GiB or 512MiB, got {_show(value)}")
    if isinstance(value, bool):  # bool is an int subclass; `size: yes` is a mistake
        raise bad
    if isinstance(value, int):
        size = value
    elif isinstance(value, str) and (match := _NUMBER_UNIT_RE.fullmatch(value.strip())):
        number, unit = match[1], match[2].lower()
        if unit not in _SIZE_UNITS or ("." in number and not unit):
            raise bad
        amount = Decimal(number)  # exact, unlike float, for "1.1TiB"
        if amount > MAX_SIZE:  # checked before multiplying so absurd inputs stay cheap
            raise ValueError(f"expected a size below 8EiB, got {_show(value)}")
        size = int(amount * _SIZE_UNITS[unit])
    else:
        raise bad
    if size < 0:
        raise bad
    if size > MAX_SIZE:
        raise ValueError(f"expected a size below 8EiB, got {_show(value)}")
    return size


def _format_size(size: int) -> str:
    for unit, factor in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if size and size % factor == 0:
            return f"{size // factor}{unit}"
    return f"{size}B"


_DURATION_UNITS = {"": 1.0, "s": 1.0, "ms": 0.001, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(value: str | int | float) -> float:
    """Seconds from a number of seconds or a string such as '500ms', '30s', '10m', '1h', '2d'."""
    bad = ValueError(f"expected a duration such as 30s, 10m, 1h, 2d or 500ms, got {_show(value)}")
    seconds = math.nan
    if isinstance(value, bool):
        raise bad
    if isinstance(value, int | float):
        try:
            seconds = float(value)
        except OverflowError:  # a YAML int with hundreds of digits
            raise bad from None
    elif isinstance(value, str) and (match := _NUMBER_UNIT_RE.fullmatch(value.strip())):
        unit = match[2].lower()
        if unit not in _DURATION_UNITS:
            raise bad
        seconds = float(match[1]) * _DURATION_UNITS[unit]
    if not (math.isfinite(seconds) and seconds >= 0):
        raise bad
    return seconds


# Parser factories for Field tables. Each returns a Parser; options are keyword-only so a table
# row reads as a sentence.


def as_size(*, minimum: int = 0, maximum: int = MAX_SIZE, multiple: int = 1) -> Parser:
    def parse(value: Any) -> int:
        size = parse_size(value)
        if not minimum <= size <= maximum:
            wanted = f"of at least {_format_size(minimum)}"
            if maximum != MAX_SIZE:
                wanted = f"between {_format_size(minimum)} and {_format_size(maximum)}"
            raise ValueError(f"expected a size {wanted}, got {_show(value)}")
        if size % multiple:
            raise ValueError(f"expected a multiple of {multiple} bytes, got {_show(value)}")
        return size

    return parse


def as_duration(*, minimum: float = 0.0) -> Parser:
    """A duration in seconds; `minimum` where a shorter one cannot work (a timeout of 0)."""
    if not minimum:
        return parse_duration

    def parse(value: Any) -> float:
        seconds = parse_duration(value)
        if seconds < minimum:
            raise ValueError(f"expected a duration of at least {minimum:g}s, got {_show(value)}")
        return seconds

    return parse


def as_fraction(*, allow_one: bool) -> Parser:
    """A float in (0, 1], or in (0, 1) without allow_one. Numeric strings pass (CLI overrides)."""
    wanted = "greater than 0 and at most 1" if allow_one else "strictly between 0 and 1"

    def parse(value: Any) -> float:
        number = math.nan  # NaN fails every comparison below
        if isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
        elif isinstance(value, int | float) and not isinstance(value, bool):
            number = float(value) if abs(value) < 2 else 2.0  # huge ints would overflow float()
        if not (0 < number < 1 or (allow_one and number == 1)):
            raise ValueError(f"expected a number {wanted}, got {_show(value)}")
        return number

    return parse


def as_choice(*options: str, booleans: tuple[str, str] | None = None) -> Parser:
    """One of `options`. `booleans` names the options that YAML's true/false (on/off, yes/no)
    stand for: YAML 1.1 turns a bare `on` into True before we ever see it."""

    def parse(value: Any) -> str:
        if booleans and isinstance(value, bool):
            value = booleans[0] if value else booleans[1]
        if isinstance(value, str) and value in options:
            return value
        raise ValueError(f"expected one of {', '.join(options)}, got {_show(value)}")

    return parse


def as_path(*, optional: bool = False) -> Parser:
    """An absolute path: the daemon runs with cwd=/, so a relative one is always a mistake."""

    def parse(value: Any) -> Path | None:
        if value is None and optional:
            return None
        if isinstance(value, str) and value.startswith("/") and "\0" not in value:
            return Path(value)
        or_null = " or null" if optional else ""
        raise ValueError(f"expected an absolute path{or_null}, got {_show(value)}")

    return parse


def _host_port_ok(text: str) -> bool:
    host, colon, port = text.rpartition(":")  # rpartition keeps "[::1]:9464" whole
    return bool(
        colon and host and not any(c.isspace() for c in host)
        and port.isascii() and port.isdigit() and len(port) <= 5 and 1 <= int(port) <= 65535
    )


def as_endpoint() -> Parser:
    """A ZeroMQ endpoint: 'ipc' (a socket under state_dir) or 'tcp://HOST:PORT'."""

    def parse(value: Any) -> str:
        if value == "ipc" or (
            isinstance(value, str) and value.startswith("tcp://") and _host_port_ok(value[6:])
        ):
            return value
        raise ValueError(f'expected "ipc" or "tcp://HOST:PORT" (port 1-65535), got {_show(value)}')

    return parse


def as_host_port(*, optional: bool = False) -> Parser:
    """'HOST:PORT'; with optional, '' or null mean "disabled" and parse to None."""

    def parse(value: Any) -> str | None:
        if optional and value in (None, ""):
            return None
        if isinstance(value, str) and _host_port_ok(value):
            return value
        disable = ' or "" to disable' if optional else ""
        raise ValueError(f'expected "HOST:PORT" (port 1-65535){disable}, got {_show(value)}')

    return parse


def as_flag() -> Parser:
    """true/false (YAML's on/off, yes/no too)."""

    def parse(value: Any) -> bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"expected true or false, got {_show(value)}")

    return parse


def as_count(*, minimum: int = 0, maximum: int = 1 << 31) -> Parser:
    """A whole number in [minimum, maximum]."""

    def parse(value: Any) -> int:
        if isinstance(value, int) and not isinstance(value, bool) and minimum <= value <= maximum:
            return value
        raise ValueError(f"expected a whole number from {minimum} to {maximum}, "
                         f"got {_show(value)}")

    return parse


_PCI_RE = re.compile(r"(?:[0-9a-f]{4}:)?[0-9a-f]{2}:[0-1][0-9a-f]\.[0-7]", re.IGNORECASE)


def as_pci_address() -> Parser:
    """A PCI address as DOCA takes it: "03:00.0" or "0000:03:00.0"."""

    def parse(value: Any) -> str:
        if isinstance(value, str) and _PCI_RE.fullmatch(value):
            return value.lower()
        raise ValueError(f'expected a PCI address such as "03:00.0" or "0000:03:00.0", '
                         f"got {_show(value)}")

    return parse


def as_text(*, pattern: str = r".*", wanted: str = "a string") -> Parser:
    """A string matching `pattern` (whole); `wanted` says what in errors."""
    regex = re.compile(pattern, re.ASCII)

    def parse(value: Any) -> str:
        if isinstance(value, str) and regex.fullmatch(value):
            return value
        raise ValueError(f"expected {wanted}, got {_show(value)}")

    return parse


def as_doca_library() -> Parser:
    """Where the DOCA functions come from: "system" (the installed DOCA SDK), "simulator" (the
    DOCA API simulator shipped with bluecache: no BlueField involved) or a library path."""

    def parse(value: Any) -> str:
        if value in ("system", "simulator") or (
                isinstance(value, str) and value.startswith("/") and "\0" not in value):
            return value
        raise ValueError(f'expected "system", "simulator" or an absolute library path, '
                         f"got {_show(value)}")

    return parse


# ---------------------------------------------------------------------------------------------
# Schema machinery.


@dataclasses.dataclass(frozen=True)
class Field:
    """One setting. `default` is written as it would be in the file ("4GiB") and goes through
    `parse` like any file value, so the rendered conffile and the loaded defaults cannot drift."""

    parse: Parser
    default: Any
    doc: str
    live: bool = False  # applied on SIGHUP; changing any other key needs a restart


# check(section) -> None, or (key within the section, problem) for rules spanning several keys.
Check = Callable[[Any], "tuple[str, str] | None"]


class Schema:
    """A section: an ordered table of key -> Field or nested Schema, loaded as the frozen
    dataclass `cls` (named `name`), whose attributes are the keys."""

    def __init__(self, name: str, doc: str, fields: Mapping[str, Field | Schema],
                 check: Check | None = None):
        self.doc, self.fields, self.check = doc, dict(fields), check
        self.cls = dataclasses.make_dataclass(
            name,
            [(key, spec.cls if isinstance(spec, Schema) else Any) for key, spec in fields.items()],
            frozen=True,
        )

    def _build(self, raw: Any, prefix: str, source_of: Callable[[str], str]) -> Any:
        if raw is None:  # a section header whose keys are all commented out
            raw = {}
        if not isinstance(raw, dict):
            key = prefix.rstrip(".")
            problem = f"expected a mapping of settings, got {_show(raw)}"
            raise ConfigError(source_of(key), problem, key)
        for key in raw:
            if key not in self.fields:
                dotted = f"{prefix}{key}"
                raise ConfigError(source_of(dotted), _unknown(dotted, self))
        values = {}
        for name, spec in self.fields.items():
            dotted = prefix + name
            if isinstance(spec, Schema):
                values[name] = spec._build(raw.get(name), dotted + ".", source_of)
                continue
            try:
                values[name] = spec.parse(raw[name] if name in raw else spec.default)
            except ValueError as e:
                raise ConfigError(source_of(dotted), str(e), dotted) from None
        section = self.cls(**values)
        if self.check and (problem := self.check(section)):
            dotted = prefix + problem[0]
            raise ConfigError(source_of(dotted), problem[1], dotted)
        return section


def _unknown(dotted: str, schema: Schema) -> str:
    return f"unknown key {dotted} (known keys here: {', '.join(schema.fields)})"


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys, which PyYAML would silently resolve to the last:
    a second `tiers:` block would otherwise quietly discard the first."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                if (key_node.tag, key_node.value) in seen:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        f"found duplicate key {key_node.value!r}", key_node.start_mark)
                seen.add((key_node.tag, key_node.value))
        return super().construct_mapping(node, deep)


def _read_yaml(path: Path) -> Any:
    source = str(path)
    try:
        data = path.read_bytes()  # bytes: let PyYAML detect the encoding and report bad bytes
    except FileNotFoundError:
        raise ConfigError(source, "no such file") from None
    except OSError as e:
        raise ConfigError(source, f"cannot read: {e.strerror or e}") from None
    try:
        return yaml.load(data, Loader=_StrictLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = e.problem or e.context
        if e.context and e.problem:
            at = f" at line {e.context_mark.line + 1}" if e.context_mark else ""
            problem += f" ({e.context}{at})"
        raise ConfigError(source, f"{where}invalid YAML: {problem}") from None
    except yaml.YAMLError as e:  # ReaderError: bad encoding or control characters
        raise ConfigError(source, f"invalid YAML: {str(e).splitlines()[0]}") from None
    except (ValueError, OverflowError) as e:  # PyYAML constructors leak these: 2020-13-01, 0x_
        raise ConfigError(source, f"invalid YAML value: {e}") from None
    except RecursionError:
        raise ConfigError(source, "invalid YAML: nested too deeply") from None


def _apply_overrides(schema: Schema, raw: dict, overrides: Mapping[str, Any]) -> set[str]:
    """Write dotted-key overrides into the raw tree, so they are validated exactly like the file.
    Returns the keys overridden, so errors about them name the override rather than the file."""
    for dotted, value in overrides.items():
        *sections, leaf = dotted.split(".")
        spec = schema
        for name in sections:
            if not isinstance(spec.fields.get(name), Schema):
                raise ConfigError(OVERRIDE, _unknown(dotted, spec))
            spec = spec.fields[name]
        if isinstance(spec.fields.get(leaf), Schema):
            raise ConfigError(OVERRIDE, f"{dotted} is a section, not a setting", dotted)
        if leaf not in spec.fields:
            raise ConfigError(OVERRIDE, _unknown(dotted, spec))
        node = raw
        for name in sections:
            child = node.get(name)
            if child is not None and not isinstance(child, dict):
                break  # the file's own section is malformed; _build reports that
            # Copy on the way down: YAML aliases may share this dict with another section.
            node[name] = node = dict(child or {})
        else:
            node[leaf] = value
    return set(overrides)


def load_yaml(path: Path | str | None, schema: Schema,
              overrides: Mapping[str, Any] | None = None) -> Any:
    """Load and validate `path` against `schema` (None: defaults only), then apply `overrides`
    ({"tiers.dram.size": "1GiB"}). Returns a `schema.cls` instance; raises ConfigError."""
    source = str(path) if path is not None else "<defaults>"
    raw = _read_yaml(Path(path)) if path is not None else None
    if raw is None:  # empty file, or only comments
        raw = {}
    if not isinstance(raw, dict):
        kind = type(raw).__name__
        raise ConfigError(source, f"expected a mapping of settings at the top level, got a {kind}")
    overridden = _apply_overrides(schema, raw, overrides or {})
    return schema._build(raw, "", lambda key: OVERRIDE if key in overridden else source)


def render_defaults(schema: Schema) -> str:
    """The defaults as commented YAML, fit to ship as the conffile."""
    lines = [f"# {line}".rstrip() for line in schema.doc.splitlines()]

    def render(section: Schema, indent: str) -> None:
        for i, (name, spec) in enumerate(section.fields.items()):
            if i or not indent:
                lines.append("")
            doc = spec.doc + (" Reloaded on SIGHUP." if getattr(spec, "live", False) else "")
            lines.extend(f"{indent}# {line}" for line in textwrap.wrap(doc, 96 - len(indent)))
            if isinstance(spec, Schema):
                lines.append(f"{indent}{name}:")
                render(spec, indent + "  ")
            else:  # safe_dump quotes whatever YAML would otherwise misread (on, 1:30, ...)
                lines.append(indent + yaml.safe_dump({name: spec.default}, width=1000).rstrip("\n"))

    render(schema, "")
    return "\n".join(lines) + "\n"


def changed_keys(schema: Schema, old: Any, new: Any) -> tuple[dict[str, Any], list[str]]:
    """(live keys that changed -> new value, dotted keys that changed but need a restart)."""
    live: dict[str, Any] = {}
    restart: list[str] = []

    def walk(section: Schema, a: Any, b: Any, prefix: str) -> None:
        for name, spec in section.fields.items():
            x, y = getattr(a, name), getattr(b, name)
            if isinstance(spec, Schema):
                walk(spec, x, y, prefix + name + ".")
            elif x != y:
                if spec.live:
                    live[prefix + name] = y
                else:
                    restart.append(prefix + name)

    walk(schema, old, new, "")
    return live, restart


# ---------------------------------------------------------------------------------------------
# bluecached's schema.


def _watermarks_ordered(tier: Any) -> tuple[str, str] | None:
    # Eviction runs from high down to low; low >= high would evict forever or never.
    if tier.low_watermark >= tier.high_watermark:
        return "low_watermark", (f"expected a value below high_watermark ({tier.high_watermark}), "
                                 f"got {tier.low_watermark}")
    return None


def _watermarks(high: float, low: float) -> dict[str, Field]:
    return {
        "high_watermark": Field(as_fraction(allow_one=True), high,
                                "Start evicting when the tier is this full (0 < x <= 1).",
                                live=True),
        "low_watermark": Field(as_fraction(allow_one=False), low,
                               "Stop evicting at this fill; below high_watermark.", live=True),
    }


def _remote_complete(remote: Any) -> tuple[str, str] | None:
    if remote.enabled and not remote.bucket:
        return "bucket", "expected a bucket name when the remote tier is enabled, got nothing"
    if remote.part_size > remote.multipart_threshold:
        return "part_size", (f"expected at most multipart_threshold "
                             f"({_format_size(remote.multipart_threshold)}), "
                             f"got {_format_size(remote.part_size)}")
    return None


def _staging_holds_a_chunk(doca: Any) -> tuple[str, str] | None:
    if doca.staging_size < doca.max_chunk:
        return "staging_size", (f"expected at least max_chunk ({doca.max_chunk} bytes), "
                                f"got {doca.staging_size}")
    return None


BLUECACHED = Schema("Config", (
    "bluecached configuration.\n"
    "\n"
    "Sizes are bytes or a number with a unit: B, K/KB/KiB, M/MB/MiB, G/GB/GiB, T/TB/TiB.\n"
    "Every unit is a power of 1024 (4GB == 4GiB); decimals such as 1.5GiB round down.\n"
    "Durations are seconds or a number with a unit: ms, s, m, h, d.\n"
    "`systemctl reload bluecached` (SIGHUP) applies the keys marked as reloaded on SIGHUP;\n"
    "changes to any other key are logged as needing a restart."
), {
    "state_dir": Field(as_path(), "/var/lib/bluecache",
                       "Directory for the daemon's state: its ipc sockets and the loopback "
                       "engine's dma.sock live here."),
    "log_level": Field(as_choice("debug", "info", "warning", "error"), "info",
                       "Log verbosity: debug, info, warning or error.", live=True),
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
            **_watermarks(0.90, 0.75),
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
            "o_direct": Field(as_choice("auto", "on", "off", booleans=("on", "off")), "auto",
                              "Bypass the page cache with O_DIRECT: auto (if the filesystem "
                              "supports it), on or off."),
            **_watermarks(0.95, 0.85),
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
    "metrics": Schema("MetricsConfig", "Prometheus metrics.", {
        "listen": Field(as_host_port(optional=True), "127.0.0.1:9464",
                        'HTTP endpoint "HOST:PORT" for /metrics; "" or null disables it.'),
    }),
})

Config = BLUECACHED.cls


def load_config(path: Path | None, overrides: Mapping[str, Any] | None = None) -> Config:
    """Load bluecached's config. path None means defaults only; a path given must exist (the
    daemon passes DEFAULT_PATH only when it exists or the operator named it)."""
    config = load_yaml(path, BLUECACHED, overrides)
    if config.tiers.nvme.path is None:  # its default hangs off state_dir, known only now
        nvme = dataclasses.replace(config.tiers.nvme, path=config.state_dir / "nvme")
        config = dataclasses.replace(config, tiers=dataclasses.replace(config.tiers, nvme=nvme))
    return config


def reload_changes(old: Config, new: Config) -> tuple[dict[str, Any], list[str]]:
    """What a SIGHUP reload found: (live dotted keys that changed -> new value, dotted keys that
    changed but only take effect after a restart)."""
    return changed_keys(BLUECACHED, old, new)


def default_yaml() -> str:
    """bluecached's defaults as the commented YAML shipped as the packaged conffile."""
    return render_defaults(BLUECACHED)
