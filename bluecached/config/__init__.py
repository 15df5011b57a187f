"""bluecached's configuration: the schema machinery both daemons build on (schema.py) and
bluecached's own table (table.py). The names callers use are importable from here."""

from .schema import ConfigError, parse_duration, parse_size
from .table import (
    BLUECACHED,
    DEFAULT_PATH,
    Config,
    apply_reload,
    default_yaml,
    load_config,
    reload_changes,
)

__all__ = [
    "BLUECACHED",
    "DEFAULT_PATH",
    "Config",
    "ConfigError",
    "apply_reload",
    "default_yaml",
    "load_config",
    "parse_duration",
    "parse_size",
    "reload_changes",
]
