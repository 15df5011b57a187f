"""The connectors' own Python modules, for the tests that check bluecache against them.

vLLM, LMCache and SGLang do not install on a machine without a GPU stack, but a few of their
modules need only the standard library, msgspec or pydantic. `scripts/fetch_connector_code.py`
(run by `scripts/setup.sh --test`) downloads each pinned wheel with pip, without its
dependencies, and keeps just those files under .cache/connector-code/; this module loads them
by path, with stubs for the few imports of the packages that they do not use. A test that
needs one skips, saying why, when it is not there.
"""

import contextlib
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


@contextlib.contextmanager
def _stubbed(stubs: dict[str, dict]):
    """`stubs` (module name -> attributes) in sys.modules while the block runs, and whatever
    the block adds to sys.modules under those names taken out again at its end."""
    saved = {key: sys.modules.get(key) for key in stubs}
    for key, attrs in stubs.items():
        if attrs is not None:
            module = types.ModuleType(key)
            module.__dict__.update(attrs)
            sys.modules[key] = module
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = old


def _exec(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _load(name: str, path: Path, stubs: dict[str, dict]) -> types.ModuleType:
    """Executes `path` as module `name`, with `stubs` in sys.modules only while it runs."""
    with _stubbed({**stubs, name: None}):
        return _exec(name, path)


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


def vllm_kv_transfer_config():
    """A function that builds vLLM 0.33.0's KVTransferConfig, the class
    `--kv-transfer-config` is parsed into (a pydantic dataclass whose unknown keys are errors),
    from a dict. Its module imports vLLM's `config` decorator (stubbed with what
    vllm/config/utils.py says it is: a pydantic dataclass with extra="forbid"), a hash helper
    and, when an instance is made, the platform (kv_buffer_device's default)."""
    pytest.importorskip("pydantic", reason="pydantic (the test extra) builds vLLM's config")
    from pydantic import ConfigDict
    from pydantic.dataclasses import dataclass

    def config(cls=None, **kwargs):
        def decorate(c):
            return dataclass(c, config=ConfigDict(extra="forbid"), **kwargs)
        return decorate if cls is None else decorate(cls)

    path = source(VLLM, "vllm/config/kv_transfer.py")
    stubs = {"vllm": {}, "vllm.config": {}, "vllm.utils": {},
             "vllm.config.utils": {"config": config},
             "vllm.utils.hashing": {"safe_hash": None},
             "vllm.platforms": {"current_platform": types.SimpleNamespace(device_type="cuda")}}
    module = _load("vllm_0_33_kv_transfer", path, stubs)

    def make(**fields):
        with _stubbed(stubs):
            return module.KVTransferConfig(**fields)
    return make


LMCACHE = "lmcache-0.5.6"
SGLANG = "sglang-0.5.23"


def lmcache_engine_config() -> type:
    """LMCache 0.5.6's LMCacheEngineConfig (lmcache/v1/config.py) with its validation. Its
    package's __init__ imports torch, so its three modules are loaded alone; `requests`
    (used only to fetch a config from a URL) is stubbed."""
    names = {"lmcache.logging": "lmcache/logging.py",
             "lmcache.v1.config_base": "lmcache/v1/config_base.py",
             "lmcache.v1.config": "lmcache/v1/config.py"}
    stubs = {"lmcache": {}, "lmcache.v1": {}, "requests": {"RequestException": OSError}}
    with _stubbed({**stubs, **dict.fromkeys(names)}):
        for name, relative in names.items():
            module = _exec(name, source(LMCACHE, relative))
    return module.LMCacheEngineConfig


def sglang_memory_options():
    """An argparse parser of SGLang 0.5.23's `memory` options (--enable-hierarchical-cache,
    --hicache-*), built by SGLang's own add_cli_args_from_dataclass from its Memory struct.
    SGLang's package __init__ imports torch, so these modules are loaded alone."""
    import argparse
    pytest.importorskip("msgspec", reason="msgspec (the test extra) builds SGLang's options")
    names = {"sglang.srt.arg_groups.arg_utils": "sglang/srt/arg_groups/arg_utils.py",
             "sglang.srt.arg_groups.choices": "sglang/srt/arg_groups/choices.py",
             "sglang.srt.arg_groups.fields.memory": "sglang/srt/arg_groups/fields/memory.py"}
    packages = ("sglang", "sglang.srt", "sglang.srt.arg_groups", "sglang.srt.arg_groups.fields")
    with _stubbed({**dict.fromkeys(packages, {}), **dict.fromkeys(names)}):
        modules = {name: _exec(name, source(SGLANG, relative))
                   for name, relative in names.items()}
        parser = argparse.ArgumentParser(prog="sglang.launch_server", exit_on_error=False)
        modules["sglang.srt.arg_groups.arg_utils"].add_cli_args_from_dataclass(
            parser, modules["sglang.srt.arg_groups.fields.memory"].Memory)
    return parser
