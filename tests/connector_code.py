"""The connectors' own Python modules, for the tests that check bluecache against them.

vLLM, LMCache and SGLang do not install on a machine without a GPU stack, but a few of their
modules need only the standard library, msgspec or pydantic. `scripts/fetch_connector_code.py`
(run by `scripts/setup.sh --test`) downloads each pinned wheel with pip, without its
dependencies, and keeps just those files under .cache/connector-code/; this module loads them
by path, with stubs for the few imports of the packages that they do not use. A test that
needs one skips, saying why, when it is not there.
"""

import importlib.util
import logging
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CODE = ROOT / ".cache" / "connector-code"
VLLM = "vllm-0.33.0"

FETCH_HINT = "run `bash scripts/setup.sh --test` (or scripts/fetch_connector_code.py)"


def source(package: str, relative: str) -> Path:
    path = CODE / package / relative
    if not path.is_file():
        pytest.skip(f"{package}'s {relative} is not in {CODE}: {FETCH_HINT}")
    return path


def _load(name: str, path: Path, stubs: dict[str, dict]) -> types.ModuleType:
    """Executes `path` as module `name`, with `stubs` (module name -> attributes) in
    sys.modules only while it runs, so nothing of the stubs outlives the load."""
    saved = {key: sys.modules.get(key) for key in stubs}
    for key, attrs in stubs.items():
        module = types.ModuleType(key)
        module.__dict__.update(attrs)
        sys.modules[key] = module
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        for key, old in saved.items():
            if old is None:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = old


def vllm_kv_events() -> types.ModuleType:
    """vLLM 0.33.0's vllm/distributed/kv_events.py: its real KVEventBatch, BlockStored,
    BlockRemoved and AllBlocksCleared (msgspec structs). Its imports of vLLM's config, logger,
    network helpers and block-hash alias are stubbed: the event classes use only the alias
    (`ExternalBlockHash = bytes | int`, as vllm/v1/core/kv_cache_utils.py defines it)."""
    pytest.importorskip("msgspec", reason="msgspec (the test extra) decodes vLLM's events")
    path = source(VLLM, "vllm/distributed/kv_events.py")
    stubs = {
        "vllm": {}, "vllm.config": {}, "vllm.utils": {}, "vllm.v1": {}, "vllm.v1.core": {},
        "vllm.config.kv_events": {"KVEventsConfig": type("KVEventsConfig", (), {})},
        "vllm.logger": {"init_logger": logging.getLogger},
        "vllm.utils.network_utils": {name: None for name in (
            "get_ip", "get_tcp_uri", "is_valid_ipv6_address", "split_zmq_path")},
        "vllm.v1.core.kv_cache_utils": {"ExternalBlockHash": bytes | int},
    }
    return _load("vllm_0_33_kv_events", path, stubs)
