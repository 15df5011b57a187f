"""The schema machinery both daemons' configuration files are built on.

A `Schema` maps each key to a `Field` (parser, default, comment, how a SIGHUP applies it) or to a
nested `Schema`, and `load_yaml` turns a file, plus `--set KEY=VALUE` assignments over it, into
frozen dataclasses built from that table. Keeping the table declarative is what lets one place
drive validation, SIGHUP reloads (`apply_live_changes`) and the shipped conffile
(`render_defaults`). The tables themselves: bluecached's in `table.py`, hostd's in hostd/config.py.

Sizes: every unit is a power of 1024, so "4GB", "4G" and "4GiB" all mean 4 * 2**30 bytes. A cache
is carved into pages and chunks, and nobody sizing one means 10**9.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import reprlib
import textwrap
from collections.abc import Callable, Iterable, Iterator, Mapping
from decimal import Decimal
from pathlib import Path
from typing import Any

import yaml

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
MAX_SIZE = (1 << 63) - 1  # sizes end up in off_t and int64 fields

# The sources named in errors about settings that did not come from the file: `overrides`
# handed over by code (e.g. `bluecachectl up --dram-size`), and the daemons' --set options.
OVERRIDE = "override"
SET_OPTION = "--set"

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


def format_size(size: int) -> str:
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
            wanted = f"of at least {format_size(minimum)}"
            if maximum != MAX_SIZE:
                wanted = f"between {format_size(minimum)} and {format_size(maximum)}"
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


_FLAG_WORDS = {"true", "false", "yes", "no", "on", "off"}


def as_flag() -> Parser:
    """true/false (YAML's on/off, yes/no too)."""

    def parse(value: Any) -> bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _FLAG_WORDS:
            # YAML read it as text: it was quoted ("false"), which the error should say
            raise ValueError(f"expected true or false, got the quoted text {_show(value)}: "
                             f"write it without quotes")
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


# apply(target, value) puts a value reloaded on SIGHUP into effect in the running daemon;
# `target` is what the daemon hands `apply_live_changes` (bluecached: its Tiers).
Apply = Callable[[Any, Any], None]


def set_log_level(_target: Any, level: str) -> None:
    """The Apply of both daemons' log_level."""
    logging.getLogger().setLevel(level.upper())


@dataclasses.dataclass(frozen=True)
class Field:
    """One setting. `default` is written as it would be in the file ("4GiB") and goes through
    `parse` like any file value, so the rendered conffile and the loaded defaults cannot drift.
    `live` says how a SIGHUP applies a changed value; without one a change needs a restart."""

    parse: Parser
    default: Any
    doc: str
    live: Apply | None = None


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

    def default(self, dotted_key: str) -> Any:
        """The table's default of a key such as `tiers.dram.size`: callers that show or need
        a default (bluecachectl's options) ask here instead of writing it again."""
        section, _, rest = dotted_key.partition(".")
        spec = self.fields[section]
        return spec.default(rest) if isinstance(spec, Schema) else spec.default

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
    return _parse_yaml(data, source)


def _parse_yaml(data: bytes | str, source: str, key: str | None = None) -> Any:
    try:
        return yaml.load(data, Loader=_StrictLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = e.problem or e.context
        if e.context and e.problem:
            at = f" at line {e.context_mark.line + 1}" if e.context_mark else ""
            problem += f" ({e.context}{at})"
        raise ConfigError(source, f"{where}invalid YAML: {problem}", key) from None
    except yaml.YAMLError as e:  # ReaderError: bad encoding or control characters
        raise ConfigError(source, f"invalid YAML: {str(e).splitlines()[0]}", key) from None
    except (ValueError, OverflowError) as e:  # PyYAML constructors leak these: 2020-13-01, 0x_
        raise ConfigError(source, f"invalid YAML value: {e}", key) from None
    except RecursionError:
        raise ConfigError(source, "invalid YAML: nested too deeply", key) from None


def parse_assignments(assignments: Iterable[str]) -> dict[str, Any]:
    """`--set KEY=VALUE` arguments as overrides: KEY is dotted (tiers.dram.size), VALUE is read
    as the YAML it would be after `key:` in the file, so 1GiB, 0.8, off, null and '' mean there
    what they mean here. A key set twice keeps its last value."""
    overrides = {}
    for assignment in assignments:
        key, equals, value = assignment.partition("=")
        key = key.strip()
        if not (equals and key):
            raise ConfigError(SET_OPTION, f"expected KEY=VALUE such as tiers.dram.size=1GiB, "
                                          f"got {_show(assignment)}")
        overrides[key] = _parse_yaml(value, SET_OPTION, key)
    return overrides


def _apply_overrides(schema: Schema, raw: dict, overrides: Mapping[str, Any],
                     source: str) -> set[str]:
    """Write dotted-key overrides into the raw tree, so they are validated exactly like the file.
    Returns the keys overridden, so errors about them name `source` rather than the file."""
    for dotted, value in overrides.items():
        *sections, leaf = dotted.split(".")
        spec = schema
        for name in sections:
            if not isinstance(spec.fields.get(name), Schema):
                raise ConfigError(source, _unknown(dotted, spec))
            spec = spec.fields[name]
        if isinstance(spec.fields.get(leaf), Schema):
            raise ConfigError(source, f"{dotted} is a section, not a setting", dotted)
        if leaf not in spec.fields:
            raise ConfigError(source, _unknown(dotted, spec))
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
              overrides: Mapping[str, Any] | None = None,
              assignments: Iterable[str] = ()) -> Any:
    """Load and validate `path` against `schema` (None: defaults only), then apply the --set
    `assignments` (["tiers.dram.size=1GiB"]) and `overrides` ({"tiers.dram.size": "1GiB"}) over
    it. Returns a `schema.cls` instance; raises ConfigError naming where a bad value came from."""
    source = str(path) if path is not None else "<defaults>"
    raw = _read_yaml(Path(path)) if path is not None else None
    if raw is None:  # empty file, or only comments
        raw = {}
    if not isinstance(raw, dict):
        kind = type(raw).__name__
        raise ConfigError(source, f"expected a mapping of settings at the top level, got a {kind}")
    set_keys = _apply_overrides(schema, raw, parse_assignments(assignments), SET_OPTION)
    overridden = _apply_overrides(schema, raw, overrides or {}, OVERRIDE)

    def source_of(key: str) -> str:
        return OVERRIDE if key in overridden else SET_OPTION if key in set_keys else source

    return schema._build(raw, "", source_of)


def render_defaults(schema: Schema) -> str:
    """The defaults as commented YAML, fit to ship as the conffile."""
    lines = [f"# {line}".rstrip() for line in schema.doc.splitlines()]

    def render(section: Schema, indent: str) -> None:
        for i, (name, spec) in enumerate(section.fields.items()):
            if i or not indent:
                lines.append("")
            doc = spec.doc + (" Reloaded on SIGHUP." if getattr(spec, "live", None) else "")
            lines.extend(f"{indent}# {line}" for line in textwrap.wrap(doc, 96 - len(indent)))
            if isinstance(spec, Schema):
                lines.append(f"{indent}{name}:")
                render(spec, indent + "  ")
            else:  # safe_dump quotes whatever YAML would otherwise misread (on, 1:30, ...)
                lines.append(indent + yaml.safe_dump({name: spec.default}, width=1000).rstrip("\n"))

    render(schema, "")
    return "\n".join(lines) + "\n"


def _changes(schema: Schema, old: Any, new: Any, prefix: str = "") -> Iterator[
        tuple[str, Field, Any]]:
    """(dotted key, its Field, new value) of every setting that differs, in table order."""
    for name, spec in schema.fields.items():
        was, now = getattr(old, name), getattr(new, name)
        if isinstance(spec, Schema):
            yield from _changes(spec, was, now, f"{prefix}{name}.")
        elif was != now:
            yield prefix + name, spec, now


def changed_keys(schema: Schema, old: Any, new: Any) -> tuple[dict[str, Any], list[str]]:
    """(live keys that changed -> new value, dotted keys that changed but need a restart)."""
    changes = list(_changes(schema, old, new))
    live = {dotted: value for dotted, spec, value in changes if spec.live}
    return live, [dotted for dotted, spec, _ in changes if not spec.live]


def apply_live_changes(schema: Schema, old: Any, new: Any,
                       target: Any = None) -> tuple[dict[str, Any], list[str]]:
    """A SIGHUP reload: puts each changed live key into effect on `target` the way its Field
    says. Returns (live keys applied -> new value, dotted keys that changed but need a restart)."""
    applied: dict[str, Any] = {}
    restart: list[str] = []
    for dotted, spec, value in _changes(schema, old, new):
        if spec.live:
            spec.live(target, value)
            applied[dotted] = value
        else:
            restart.append(dotted)
    return applied, restart
