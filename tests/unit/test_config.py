"""bluecached.config: defaults, every error message, overrides and --set, reload, conffile."""

import dataclasses
import logging
import string
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bluecached import config as bluecached_config
from bluecached.config import (
    BLUECACHED,
    ConfigError,
    apply_reload,
    default_yaml,
    load_config,
    parse_duration,
    parse_size,
    reload_changes,
)
from bluecached.config.schema import Field, Schema, as_size, load_yaml
from bluecached.tiers.placement import Watermarks

GiB, MiB, KiB = 1 << 30, 1 << 20, 1 << 10


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "bluecached.yaml"
    path.write_text(text)
    return path


def error_for(tmp_path: Path, text: str, overrides=None) -> str:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return str(info.value)


# -- defaults ----------------------------------------------------------------------------------


def test_defaults():
    c = load_config(None)
    assert c.state_dir == Path("/var/lib/bluecache")
    assert (c.log_level, c.engine) == ("info", "loopback")
    assert (c.control.listen, c.control.events) == ("ipc", "ipc")
    assert c.control.curve_dir == Path("/etc/bluecache/curve")
    assert c.control.max_message_bytes == 65536
    assert (c.tiers.dram.size, c.tiers.dram.high_watermark, c.tiers.dram.low_watermark) == (
        4 * GiB, 0.90, 0.75)
    nvme = c.tiers.nvme
    assert nvme.path == Path("/var/lib/bluecache/nvme")  # resolved from state_dir
    assert (nvme.size, nvme.segment_size, nvme.o_direct) == (64 * GiB, 16 * GiB, "auto")
    assert (nvme.high_watermark, nvme.low_watermark) == (0.95, 0.85)
    assert (c.write_policy, c.durability) == ("write-behind", "fsync")
    assert c.tmp_max_age == 3600.0
    assert c.journal_max_bytes == 64 * MiB
    assert c.metrics.listen == "127.0.0.1:9464"


@pytest.mark.parametrize("text", ["", "# only a comment\n", "---\n", "tiers:\n",
                                  "tiers:\n  dram:\n"])
def test_empty_file_and_empty_sections_are_defaults(tmp_path, text):
    assert load_config(write(tmp_path, text)) == load_config(None)


def test_config_is_frozen():
    c = load_config(None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.tiers.dram.size = 1


def test_values_from_file(tmp_path):
    c = load_config(write(tmp_path, """
state_dir: /srv/bc
log_level: debug
control: {listen: "tcp://*:5555", events: "tcp://[::1]:5556", max_message_bytes: 1MiB}
tiers:
  dram: {size: 512 MiB, high_watermark: 1, low_watermark: 0.5}
  nvme: {size: 0, segment_size: 1MiB}
tmp_max_age: 0
metrics: {listen: ""}
"""))
    assert c.state_dir == Path("/srv/bc")
    assert c.tiers.nvme.path == Path("/srv/bc/nvme")
    assert c.control.listen == "tcp://*:5555"
    assert c.control.events == "tcp://[::1]:5556"
    assert c.control.max_message_bytes == MiB
    assert c.tiers.dram.size == 512 * MiB
    assert c.tiers.dram.high_watermark == 1.0
    assert c.tiers.nvme.size == 0
    assert c.tmp_max_age == 0
    assert c.metrics.listen is None


def test_explicit_nvme_path_is_kept(tmp_path):
    c = load_config(write(tmp_path, "tiers: {nvme: {path: /mnt/nvme0/bc}}\n"))
    assert c.tiers.nvme.path == Path("/mnt/nvme0/bc")


@pytest.mark.parametrize(("written", "expected"), [
    ("on", "on"), ("off", "off"), ("yes", "on"), ("false", "off"), ("auto", "auto"),
    ('"on"', "on"), ("'off'", "off"),
])
def test_o_direct_accepts_yaml_booleans(tmp_path, written, expected):
    c = load_config(write(tmp_path, f"tiers:\n  nvme:\n    o_direct: {written}\n"))
    assert c.tiers.nvme.o_direct == expected


# -- errors ------------------------------------------------------------------------------------


def test_missing_given_file_is_an_error(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{path}: no such file"


def test_unreadable_path_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path)  # a directory


def test_bad_size_message_exactly(tmp_path):
    path = write(tmp_path, "tiers:\n  dram:\n    size: lots\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == (
        f"{path}: tiers.dram.size: expected a size such as 4GiB or 512MiB, got 'lots'")
    assert info.value.key == "tiers.dram.size"
    assert info.value.source == str(path)


def test_unknown_nested_key_message_exactly(tmp_path):
    path = write(tmp_path, "tiers:\n  dram:\n    sise: 1GiB\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == (f"{path}: unknown key tiers.dram.sise (known keys here: size, "
                               "prefault, huge_pages, high_watermark, low_watermark)")


@pytest.mark.parametrize(("text", "key", "expected"), [
    ("state_dir: var/lib\n", "state_dir", "absolute path"),
    ("state_dir: 5\n", "state_dir", "absolute path"),
    ("log_level: verbose\n", "log_level", "one of debug, info, warning, error"),
    ("engine: rdma\n", "engine", "one of loopback, doca"),
    ("control: {listen: tcp://host}\n", "control.listen", "tcp://HOST:PORT"),
    ("control: {listen: 'tcp://host:0'}\n", "control.listen", "port 1-65535"),
    ("control: {events: 'tcp://host:65536'}\n", "control.events", "port 1-65535"),
    ("control: {events: 'tcp://:5555'}\n", "control.events", "tcp://HOST:PORT"),
    ("control: {listen: ipc2}\n", "control.listen", '"ipc"'),
    ("control: {curve_dir: null}\n", "control.curve_dir", "absolute path"),
    ("control: {max_message_bytes: 1000}\n", "control.max_message_bytes", "between 1KiB and 16MiB"),
    ("control: {max_message_bytes: 17MiB}\n", "control.max_message_bytes", "and 16MiB"),
    ("tiers: {dram: {size: 0}}\n", "tiers.dram.size", "at least 1MiB"),
    ("tiers: {dram: {size: 1000KiB}}\n", "tiers.dram.size", "at least 1MiB"),   # no chunk
    ("control: {session_timeout: 0}\n", "control.session_timeout", "at least 0.1s"),
    ("remote: {timeout: 0}\n", "remote.timeout", "at least 0.1s"),
    ("tiers: {dram: {size: -1}}\n", "tiers.dram.size", "expected a size"),
    ("tiers: {dram: {size: 1.5}}\n", "tiers.dram.size", "expected a size"),
    ("tiers: {dram: {size: [1]}}\n", "tiers.dram.size", "expected a size"),
    ("tiers: {dram: {high_watermark: 0}}\n", "tiers.dram.high_watermark", "greater than 0"),
    ("tiers: {dram: {high_watermark: 1.01}}\n", "tiers.dram.high_watermark", "at most 1"),
    ("tiers: {dram: {high_watermark: .nan}}\n", "tiers.dram.high_watermark", "at most 1"),
    ("tiers: {dram: {high_watermark: true}}\n", "tiers.dram.high_watermark", "at most 1"),
    ("tiers: {dram: {low_watermark: 1}}\n", "tiers.dram.low_watermark", "strictly between"),
    ("tiers: {nvme: {path: relative}}\n", "tiers.nvme.path", "absolute path or null"),
    ("tiers: {nvme: {size: -5}}\n", "tiers.nvme.size", "expected a size"),
    ("tiers: {nvme: {segment_size: 512KiB}}\n", "tiers.nvme.segment_size", "at least 1MiB"),
    ("tiers: {nvme: {segment_size: 1048577}}\n", "tiers.nvme.segment_size", "multiple of 4096"),
    ("tiers: {nvme: {o_direct: maybe}}\n", "tiers.nvme.o_direct", "one of auto, on, off"),
    ("tiers: {nvme: {o_direct: 1}}\n", "tiers.nvme.o_direct", "one of auto, on, off"),
    ("write_policy: write-around\n", "write_policy", "one of write-behind, write-through"),
    ("durability: null\n", "durability", "one of fsync, none"),
    ("tmp_max_age: soon\n", "tmp_max_age", "expected a duration"),
    ("tmp_max_age: -1\n", "tmp_max_age", "expected a duration"),
    ("journal_max_bytes: 0\n", "journal_max_bytes", "at least 1B"),
    ("metrics: {listen: 9464}\n", "metrics.listen", "HOST:PORT"),
    ("metrics: {listen: 'localhost:99999'}\n", "metrics.listen", "HOST:PORT"),
    ("tiers: 5\n", "tiers", "expected a mapping"),
    ("tiers: {dram: [1, 2]}\n", "tiers.dram", "expected a mapping"),
    ("tiers: {dram: {huge_pages: 'false'}}\n", "tiers.dram.huge_pages",
     "got the quoted text 'false': write it without quotes"),
    ("kv_events: {enabled: 1}\n", "kv_events.enabled", "true or false, got 1"),
])
def test_bad_values_name_file_and_key(tmp_path, text, key, expected):
    message = error_for(tmp_path, text)
    assert message.startswith(f"{tmp_path / 'bluecached.yaml'}: {key}: expected")
    assert expected in message


@pytest.mark.parametrize(("text", "dotted"), [
    ("stat_dir: /x\n", "stat_dir"),
    ("control: {listne: ipc}\n", "control.listne"),
    ("tiers: {ssd: {}}\n", "tiers.ssd"),
    ("tiers: {nvme: {o_direc: on}}\n", "tiers.nvme.o_direc"),
    ("metrics: {enabled: false}\n", "metrics.enabled"),
    ("1: x\n", "1"),
])
def test_unknown_keys_anywhere(tmp_path, text, dotted):
    message = error_for(tmp_path, text)
    expected = f"{tmp_path / 'bluecached.yaml'}: unknown key {dotted} (known keys here:"
    assert message.startswith(expected)


@pytest.mark.parametrize(("section", "high", "low"), [
    ("dram", 0.8, 0.8), ("dram", 0.5, 0.75), ("nvme", 0.7, 0.85), ("nvme", 0.6, 0.9),
])
def test_low_watermark_must_be_below_high(tmp_path, section, high, low):
    text = f"tiers:\n  {section}:\n    high_watermark: {high}\n    low_watermark: {low}\n"
    message = error_for(tmp_path, text)
    assert f"bluecached.yaml: tiers.{section}.low_watermark: expected a value below" in message


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    message = error_for(tmp_path, "state_dir: /x\nlog_level: info\ntiers: [unclosed\n")
    assert message.startswith(f"{tmp_path / 'bluecached.yaml'}: line ")
    assert "invalid YAML" in message
    message = error_for(tmp_path, "state_dir: /x\n  log_level: : info\n")
    assert message.startswith(f"{tmp_path / 'bluecached.yaml'}: line 2,")


def test_duplicate_key_is_an_error_with_its_line(tmp_path):
    message = error_for(tmp_path, "tiers:\n  dram: {size: 1GiB}\nengine: doca\ntiers: {}\n")
    assert message.startswith(f"{tmp_path / 'bluecached.yaml'}: line 4,")
    assert "duplicate key 'tiers'" in message


@pytest.mark.parametrize("text", [
    "a: 2020-13-45\n", "a: 0x_\n", "[" * 5000, "a: !!python/object:os.system {}\n",
    "x: \x07\n", "---\na: 1\n---\nb: 2\n",
])
def test_yaml_constructor_and_reader_failures(tmp_path, text):
    assert error_for(tmp_path, text).startswith(str(tmp_path / "bluecached.yaml") + ": ")


def test_invalid_utf8(tmp_path):
    path = tmp_path / "bluecached.yaml"
    path.write_bytes(b"log_level: \xff\xfe\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(path)


@pytest.mark.parametrize(("text", "kind"), [("- a\n- b\n", "list"), ("just text\n", "str"),
                                            ("42\n", "int")])
def test_top_level_must_be_a_mapping(tmp_path, text, kind):
    message = error_for(tmp_path, text)
    assert message == (f"{tmp_path / 'bluecached.yaml'}: expected a mapping of settings at the "
                       f"top level, got a {kind}")


# -- sizes and durations -----------------------------------------------------------------------


@pytest.mark.parametrize(("text", "expected"), [
    (0, 0), (4096, 4096), ("4096", 4096), ("1B", 1), ("1k", KiB), ("1KB", KiB), ("1KiB", KiB),
    ("2 MiB", 2 * MiB), ("2m", 2 * MiB), ("3MB", 3 * MiB), ("4GiB", 4 * GiB), ("4gb", 4 * GiB),
    ("4G", 4 * GiB), ("1TiB", 1 << 40), ("1 tb", 1 << 40), ("  64MiB  ", 64 * MiB),
    ("1.5GiB", 3 * GiB // 2), ("0.5k", 512), ("1.0001KiB", 1024), ("1.9B", 1),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", [
    "", "lots", "-1", -1, "1.5", "1.5.0GiB", "1 PiB", "GiB", "4 GiB B", "1e9", "0x10", True, False,
    None, 1.5, 4096.0, [4096], "１GiB", "9" * 30, 1 << 63, "8388608TiB", "4_096",
])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="expected a size"):
        parse_size(text)


@pytest.mark.parametrize(("text", "expected"), [
    (0, 0.0), (30, 30.0), (2.5, 2.5), ("45", 45.0), ("30s", 30.0), ("10m", 600.0), ("1h", 3600.0),
    ("2d", 172800.0), ("500ms", 0.5), ("1.5h", 5400.0), (" 10 M ", 600.0), ("0", 0.0),
])
def test_parse_duration(text, expected):
    assert parse_duration(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", [
    "", "soon", "-1s", -1, -0.5, "1w", "s", "1h30m", "1e3", True, None, float("inf"), float("nan"),
    10**400, [1], "9" * 400,
])
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError, match="expected a duration"):
        parse_duration(text)


def test_size_and_duration_strings_in_file(tmp_path):
    c = load_config(write(tmp_path, "tiers: {dram: {size: 1.5GiB}}\ntmp_max_age: 500ms\n"
                                    "journal_max_bytes: 65536\n"))
    assert (c.tiers.dram.size, c.tmp_max_age, c.journal_max_bytes) == (3 * GiB // 2, 0.5, 65536)


# -- overrides ---------------------------------------------------------------------------------


def test_overrides_apply_after_file(tmp_path):
    path = write(tmp_path, "tiers: {dram: {size: 2GiB}}\nlog_level: debug\n")
    c = load_config(path, {"tiers.dram.size": "1GiB", "tiers.nvme.o_direct": False,
                           "tiers.dram.low_watermark": "0.5", "metrics.listen": ""})
    assert c.tiers.dram.size == GiB
    assert c.tiers.nvme.o_direct == "off"
    assert c.tiers.dram.low_watermark == 0.5
    assert c.metrics.listen is None
    assert c.log_level == "debug"  # from the file, untouched


def test_overrides_without_a_file():
    c = load_config(None, {"state_dir": "/tmp/bc", "tiers.nvme.size": 0})
    assert c.state_dir == Path("/tmp/bc")
    assert c.tiers.nvme.path == Path("/tmp/bc/nvme")
    assert c.tiers.nvme.size == 0


@pytest.mark.parametrize(("overrides", "expected"), [
    ({"tiers.dram.size": "lots"},
     "override: tiers.dram.size: expected a size such as 4GiB or 512MiB, got 'lots'"),
    ({"tiers.dram.sise": "1GiB"},
     "override: unknown key tiers.dram.sise "
     "(known keys here: size, prefault, huge_pages, high_watermark, low_watermark)"),
    ({"tier.dram.size": "1GiB"},
     "override: unknown key tier.dram.size (known keys here: state_dir,"),
    ({"tiers.dram.size.x": "1GiB"},
     "override: unknown key tiers.dram.size.x (known keys here: size,"),
    ({"tiers.dram": "1GiB"}, "override: tiers.dram: tiers.dram is a section, not a setting"),
    ({"tiers.dram.low_watermark": 0.95},
     "override: tiers.dram.low_watermark: expected a value below"),
])
def test_bad_overrides(overrides, expected):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert str(info.value).startswith(expected)


def test_file_errors_still_name_the_file_with_overrides(tmp_path):
    message = error_for(tmp_path, "tiers: {dram: {size: lots}}\n", {"log_level": "debug"})
    assert message.startswith(f"{tmp_path / 'bluecached.yaml'}: tiers.dram.size:")


def test_overrides_do_not_leak_through_yaml_aliases(tmp_path):
    # dram and nvme share one mapping via an alias; overriding dram must not touch nvme.
    path = write(tmp_path, "tiers:\n  dram: &w {high_watermark: 0.8, low_watermark: 0.5}\n"
                           "  nvme: *w\n")
    c = load_config(path, {"tiers.dram.high_watermark": 0.9})
    assert (c.tiers.dram.high_watermark, c.tiers.nvme.high_watermark) == (0.9, 0.8)


# -- --set KEY=VALUE ---------------------------------------------------------------------------


def test_set_applies_over_the_file_with_values_read_as_yaml(tmp_path):
    path = write(tmp_path, "tiers: {dram: {size: 2GiB}, nvme: {o_direct: on}}\nlog_level: debug\n")
    c = load_config(path, assignments=[
        "tiers.dram.size=1GiB", "tiers.nvme.o_direct=off", "tiers.dram.low_watermark=0.5",
        "metrics.listen=", "control.max_message_bytes=65536", "tiers.nvme.path = null",
        "remote.prefix='kv/'", "state_dir=/srv/bc"])
    assert c.tiers.dram.size == GiB
    assert c.tiers.nvme.o_direct == "off"       # YAML's off, as in the file
    assert c.tiers.dram.low_watermark == 0.5
    assert c.metrics.listen is None             # an empty value is null: disabled
    assert c.control.max_message_bytes == 65536
    assert c.tiers.nvme.path == Path("/srv/bc/nvme")
    assert c.remote.prefix == "kv/"
    assert c.log_level == "debug"  # from the file, untouched


def test_set_without_a_file_and_the_last_assignment_wins():
    c = load_config(None, assignments=["tiers.dram.size=8GiB", "tiers.dram.size=1.5GiB"])
    assert c.tiers.dram.size == 3 * GiB // 2
    assert load_config(None, assignments=[]) == load_config(None)


@pytest.mark.parametrize(("assignment", "expected"), [
    ("tiers.dram.size=lots",
     "--set: tiers.dram.size: expected a size such as 4GiB or 512MiB, got 'lots'"),
    ("tiers.dram.sise=1GiB",
     "--set: unknown key tiers.dram.sise "
     "(known keys here: size, prefault, huge_pages, high_watermark, low_watermark)"),
    ("tier.dram.size=1GiB", "--set: unknown key tier.dram.size (known keys here: state_dir,"),
    ("tiers.dram=1GiB", "--set: tiers.dram: tiers.dram is a section, not a setting"),
    ("tiers.dram.low_watermark=0.95", "--set: tiers.dram.low_watermark: expected a value below"),
    ("tiers.dram.size", "--set: expected KEY=VALUE such as tiers.dram.size=1GiB, "
                        "got 'tiers.dram.size'"),
    ("=1GiB", "--set: expected KEY=VALUE"),
    ("log_level=[debug", "--set: log_level: line 1, column 7: invalid YAML: "),
    ("tiers.nvme.o_direct=yes please", "--set: tiers.nvme.o_direct: expected one of auto, on, off"),
])
def test_bad_set_names_the_option_and_the_key(assignment, expected):
    with pytest.raises(ConfigError) as info:
        load_config(None, assignments=[assignment])
    assert str(info.value).startswith(expected)
    assert info.value.source == "--set"


def test_file_errors_still_name_the_file_with_set(tmp_path):
    path = write(tmp_path, "tiers: {dram: {size: lots}}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, assignments=["log_level=debug"])
    assert str(info.value).startswith(f"{path}: tiers.dram.size:")


def test_set_on_hostd():
    from hostd import config as hostd_config
    c = hostd_config.load_config(None, assignments=["mount.read_ahead=8",
                                                    "mount.allow_other=false"])
    assert (c.mount.read_ahead, c.mount.allow_other) == (8, False)
    with pytest.raises(ConfigError, match=r"^--set: mount\.read_ahead: expected a whole number"):
        hostd_config.load_config(None, assignments=["mount.read_ahead=lots"])
    with pytest.raises(ConfigError, match=r"^--set: unknown key mount\.readahead "):
        hostd_config.load_config(None, assignments=["mount.readahead=8"])


# -- reload ------------------------------------------------------------------------------------


def test_reload_changes_splits_live_from_restart():
    old = load_config(None)
    new = load_config(None, {
        "log_level": "debug", "tiers.dram.high_watermark": 0.8, "tiers.dram.low_watermark": 0.6,
        "tiers.nvme.low_watermark": 0.5, "tiers.dram.size": "8GiB", "state_dir": "/srv/bc",
        "control.listen": "tcp://*:5555",
    })
    live, restart = reload_changes(old, new)
    assert live == {"log_level": "debug", "tiers.dram.high_watermark": 0.8,
                    "tiers.dram.low_watermark": 0.6, "tiers.nvme.low_watermark": 0.5}
    # nvme.path follows state_dir, so it changes too.
    assert restart == ["state_dir", "control.listen", "tiers.dram.size", "tiers.nvme.path"]


def test_reload_changes_nothing_changed():
    assert reload_changes(load_config(None), load_config(None)) == ({}, [])


class RunningTiers:
    """What a reload applies the watermarks to: the Tiers' two Watermarks."""

    def __init__(self):
        self.dram_marks = Watermarks(0.90, 0.75)
        self.nvme_marks = Watermarks(0.95, 0.85)


def test_apply_reload_sets_the_live_keys_where_the_table_says():
    tiers = RunningTiers()
    old = load_config(None)
    new = load_config(None, {"tiers.dram.high_watermark": 0.8, "tiers.nvme.low_watermark": 0.5,
                             "tiers.dram.size": "8GiB"})
    live, restart = apply_reload(old, new, tiers)
    assert live == {"tiers.dram.high_watermark": 0.8, "tiers.nvme.low_watermark": 0.5}
    assert restart == ["tiers.dram.size"]
    assert (tiers.dram_marks, tiers.nvme_marks) == (Watermarks(0.8, 0.75), Watermarks(0.95, 0.5))


def test_apply_reload_sets_the_log_level_of_either_daemon():
    from hostd import config as hostd_config
    root = logging.getLogger()
    level = root.level
    try:
        for module, target in ((bluecached_config, RunningTiers()), (hostd_config, None)):
            root.setLevel(logging.INFO)
            old = module.load_config(None)
            new = module.load_config(None, assignments=["log_level=error"])
            args = (old, new, target) if target else (old, new)
            assert module.apply_reload(*args) == ({"log_level": "error"}, [])
            assert root.level == logging.ERROR
    finally:
        root.setLevel(level)


def test_every_live_key_says_how_it_is_applied():
    from hostd import config as hostd_config

    def live_keys(schema, prefix=""):
        for name, spec in schema.fields.items():
            if isinstance(spec, Schema):
                yield from live_keys(spec, f"{prefix}{name}.")
            elif spec.live is not None:
                assert callable(spec.live), prefix + name
                yield prefix + name

    assert list(live_keys(BLUECACHED)) == [
        "log_level", "tiers.dram.high_watermark", "tiers.dram.low_watermark",
        "tiers.nvme.high_watermark", "tiers.nvme.low_watermark"]
    assert list(live_keys(hostd_config.HOSTD)) == ["log_level"]


# -- rendered conffile -------------------------------------------------------------------------


def test_default_yaml_loads_back_to_exactly_the_defaults(tmp_path):
    text = default_yaml()
    assert load_config(write(tmp_path, text)) == load_config(None)
    # Every key is present (not just commented out) and the file is plain YAML.
    data = yaml.safe_load(text)
    assert data["tiers"]["nvme"]["path"] is None
    assert data["tiers"]["dram"]["size"] == "4GiB"


def test_default_yaml_comments_every_key():
    lines = default_yaml().splitlines()
    for i, line in enumerate(lines):
        if line.strip() and not line.lstrip().startswith("#"):
            assert lines[i - 1].lstrip().startswith("#"), f"no comment above {line!r}"
    assert "log_level: info" in lines
    comments = " ".join(line.strip("# ") for line in lines)
    assert comments.count("Reloaded on SIGHUP") == 5  # log_level and the four watermarks


# -- the machinery, as another daemon would use it ---------------------------------------------


def test_schema_reuse(tmp_path):
    schema = Schema("HostdConfig", "hostd.", {
        "buffer": Field(as_size(minimum=MiB), "8MiB", "Staging buffer."),
        "sub": Schema("Sub", "A section.", {"n": Field(int, 3, "A number.", live=print)}),
    })
    path = tmp_path / "hostd.yaml"
    path.write_text("buffer: 16MiB\n")
    conf = load_yaml(path, schema)
    assert (conf.buffer, conf.sub.n) == (16 * MiB, 3)
    assert type(conf) is schema.cls
    path.write_text("buffer: 1KiB\n")
    with pytest.raises(ConfigError, match=r"hostd\.yaml: buffer: expected a size of at least 1MiB"):
        load_yaml(path, schema)
    assert load_yaml(None, schema, {"sub.n": "7"}).sub.n == 7


def test_all_default_values_parse():
    # A schema default that fails its own parser would break every daemon start.
    def walk(schema):
        for spec in schema.fields.values():
            if isinstance(spec, Schema):
                walk(spec)
            else:
                spec.parse(spec.default)

    walk(BLUECACHED)


# -- robustness --------------------------------------------------------------------------------

_KEYS = ["state_dir", "log_level", "engine", "control", "listen", "events", "curve_dir",
         "max_message_bytes", "tiers", "dram", "nvme", "size", "path", "segment_size", "o_direct",
         "high_watermark", "low_watermark", "write_policy", "durability", "tmp_max_age",
         "journal_max_bytes", "metrics"]
_TOKENS = _KEYS + [": ", ":", "\n", "  ", "- ", "{", "}", "[", "]", ",", "&a ", "*a", "!!", "~",
                   "null", "on", "off", "1GiB", "-1", "0.5", ".nan", "'", '"', "#", "---", "? ",
                   "<<: ", "2020-13-01", "0x_", "tcp://h:1", "/x", "\t", "|", ">"]
_yamlish = st.lists(st.sampled_from(_TOKENS) | st.text(string.printable, max_size=5),
                    max_size=40).map("".join)
_scalars = (st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10)
            | st.sampled_from(["1GiB", "0.5", "on", "ipc", "tcp://h:80", "/abs", "1h", ""]))
_trees = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.sampled_from(_KEYS) | st.text(max_size=4), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=_yamlish | _trees.map(lambda t: yaml.safe_dump(t)) | st.binary(max_size=60).map(
    lambda b: b.decode("latin-1")))
def test_garbage_only_ever_raises_config_error(tmp_path_factory, text):
    path = tmp_path_factory.getbasetemp() / "garbage.yaml"
    path.write_bytes(text.encode("utf-8", "surrogatepass"))
    try:
        load_config(path)
    except ConfigError:
        pass


@settings(max_examples=200, deadline=None)
@given(key=st.sampled_from([
    "state_dir", "log_level", "control.listen", "control.max_message_bytes", "tiers.dram.size",
    "tiers.dram.low_watermark", "tiers.nvme.o_direct", "tiers.nvme.segment_size", "tmp_max_age",
    "metrics.listen", "tiers", "nope.x",
]), value=_trees)
def test_garbage_overrides_only_ever_raise_config_error(key, value):
    try:
        load_config(None, {key: value})
    except ConfigError:
        pass


@settings(max_examples=200, deadline=None)
@given(key=st.sampled_from(["tiers.dram.size=", "log_level=", "tiers=", "nope.x=", "",
                            "metrics.listen=", "="]),
       value=_yamlish | st.text(max_size=20))
def test_garbage_set_only_ever_raises_config_error(key, value):
    try:
        load_config(None, assignments=[key + value])
    except ConfigError:
        pass


def test_hostd_request_timeout_of_zero_is_refused(tmp_path):
    from hostd import config as hostd_config
    path = tmp_path / "hostd.yaml"
    path.write_text("daemon: {request_timeout: 0}\n")
    with pytest.raises(ConfigError, match=r"daemon\.request_timeout: expected a duration of "
                                          r"at least 0\.1s"):
        hostd_config.load_config(path)


def test_a_dram_tier_larger_than_memory_is_warned_about(caplog):
    from bluecached.tiers.dram import DramPool, physical_memory
    DramPool(physical_memory() * 2)   # mapped on demand: costs nothing here
    assert "larger than this machine's memory" in caplog.text
