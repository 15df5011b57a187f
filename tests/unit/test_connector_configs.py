"""The configs docs/connectors.md gives, parsed with each connector's own config code at its
pinned version (tests/connector_code.py loads it from the connector's wheel): a block of the
page that a connector would refuse fails here."""

import argparse
import ast
import json
import re
import shlex
from pathlib import Path

import pytest
from connector_code import (
    SGLANG,
    VLLM,
    lmcache_engine_config,
    sglang_memory_options,
    source,
    vllm_kv_transfer_config,
)

from bluecached import config

PAGE = Path(__file__).resolve().parents[2] / "docs" / "connectors.md"
CHECKED = re.compile(r"<!-- checked: (\S+) -->\n```\w*\n(.*?)```", re.DOTALL)


def blocks() -> dict[str, str]:
    return dict(CHECKED.findall(PAGE.read_text()))


def command(name: str) -> list[str]:
    """A shell command of the page as its words (line continuations joined)."""
    return shlex.split(blocks()[name].replace("\\\n", " "))


def option(words: list[str], name: str) -> str:
    return words[words.index(name) + 1]


def registered(relative: str, method: str) -> set[str]:
    """The names a vLLM module registers with `<Factory>.<method>("name", ...)`."""
    tree = ast.parse(source(VLLM, relative).read_text())
    return {call.args[0].value for call in ast.walk(tree)
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
            and call.func.attr == method and call.args
            and isinstance(call.args[0], ast.Constant)}


def init_parameters(relative: str, cls: str) -> set[str]:
    tree = ast.parse(source(VLLM, relative).read_text())
    [node] = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls]
    [init] = [n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"]
    return {a.arg for a in init.args.args + init.args.kwonlyargs}


def reads_key(package: str, relative: str, key: str) -> bool:
    return f'.get("{key}"' in source(package, relative).read_text()


def test_every_checked_block_has_its_test():
    assert set(blocks()) == {"vllm", "llmd", "lmcache", "lmcache-vllm", "sglang",
                             "bluecached-kv-events"}


def test_vllm_offloading_connector_with_its_fs_tier_on_the_mount():
    kv_transfer_config = vllm_kv_transfer_config()
    words = command("vllm")
    cfg = kv_transfer_config(**json.loads(option(words, "--kv-transfer-config")))
    assert cfg.is_kv_transfer_instance and cfg.kv_connector == "OffloadingConnector"
    assert cfg.kv_connector in registered(
        "vllm/distributed/kv_transfer/kv_connector/factory.py", "register_connector")
    extra = cfg.kv_connector_extra_config
    assert extra["spec_name"] in registered("vllm/v1/kv_offload/factory.py", "register_spec")
    assert extra["cpu_bytes_to_use"] > 0
    assert reads_key(VLLM, "vllm/v1/kv_offload/cpu/spec.py", "cpu_bytes_to_use")
    assert reads_key(VLLM, "vllm/distributed/kv_transfer/kv_connector/v1/offloading/config.py",
                     "block_size")
    [tier] = extra["secondary_tiers"]
    assert tier["type"] == "fs"
    assert tier["type"] in registered("vllm/v1/kv_offload/tiering/factory.py", "register_tier")
    parameters = init_parameters("vllm/v1/kv_offload/tiering/fs/manager.py",
                                 "FileSystemTierManager")
    assert set(tier) - {"type"} <= parameters
    assert tier["root_dir"] == "/mnt/kv-cache"
    # the same class refuses a misspelt key: the check above is not vacuous
    with pytest.raises(Exception, match="kv_conector"):
        kv_transfer_config(kv_conector="OffloadingConnector", kv_role="kv_both")


def test_the_same_pythonhashseed_on_every_vllm_command():
    for name in ("vllm", "llmd", "lmcache-vllm"):
        assert command(name)[0] == "PYTHONHASHSEED=0", name


def test_llmd_fs_backend_through_vllms_config():
    kv_transfer_config = vllm_kv_transfer_config()
    words = command("llmd")
    cfg = kv_transfer_config(**json.loads(option(words, "--kv-transfer-config")))
    extra = cfg.kv_connector_extra_config
    assert cfg.kv_connector == "OffloadingConnector"
    # not one of vLLM's specs: vLLM imports it from spec_module_path
    assert extra["spec_name"] not in registered("vllm/v1/kv_offload/factory.py",
                                                "register_spec")
    assert extra["spec_module_path"] == "llmd_fs_backend.spec"
    assert reads_key(VLLM, "vllm/v1/kv_offload/factory.py", "spec_module_path")
    assert extra["shared_storage_path"].rstrip("/") == "/mnt/kv-cache"
    assert option(words, "--distributed-executor-backend") == "mp"


def test_llmd_fs_backend_reads_the_keys_the_page_gives():
    spec = pytest.importorskip(
        "llmd_fs_backend.spec",
        reason="llm-d's FS backend is not installed: it is not on PyPI (its wheels are in "
               "llm-d's git repository and need CUDA and vLLM), so its own reading of "
               "shared_storage_path, block_size and threads_per_gpu is not checked here")
    import inspect
    text = inspect.getsource(spec.SharedStorageOffloadingSpec)
    extra = json.loads(option(command("llmd"), "--kv-transfer-config"))[
        "kv_connector_extra_config"]
    for key in set(extra) - {"spec_name", "spec_module_path"}:
        assert f'"{key}"' in text, key


def test_lmcache_nixl_posix_backend(tmp_path):
    engine_config = lmcache_engine_config()
    text = blocks()["lmcache"]
    path = tmp_path / "bluecache.yaml"
    path.write_text(text)
    cfg = engine_config.from_file(str(path))
    cfg.validate()
    extra = cfg.extra_config
    assert extra["enable_nixl_storage"] is True
    assert (extra["nixl_backend"], extra["nixl_path"]) == ("POSIX", "/mnt/kv-cache/lmcache/")
    assert extra["nixl_pool_size"] == 0 and cfg.save_unfull_chunk is False
    assert cfg.nixl_buffer_device == "cpu" and cfg.max_local_cpu_size > 0
    # its validation does check these keys: without nixl_backend it refuses
    path.write_text(text.replace("  nixl_backend: POSIX\n", ""))
    broken = engine_config.from_file(str(path))
    with pytest.raises(AssertionError):
        broken.validate()


def test_lmcache_through_vllm():
    kv_transfer_config = vllm_kv_transfer_config()
    words = command("lmcache-vllm")
    cfg = kv_transfer_config(**json.loads(option(words, "--kv-transfer-config")))
    assert cfg.kv_connector == "LMCacheConnectorV1"
    assert cfg.kv_connector in registered(
        "vllm/distributed/kv_transfer/kv_connector/factory.py", "register_connector")
    config_file = next(w for w in words if w.startswith("LMCACHE_CONFIG_FILE="))
    assert config_file.split("=", 1)[1] == "/etc/lmcache/bluecache.yaml"
    assert blocks()["lmcache"].startswith("# /etc/lmcache/bluecache.yaml\n")


def test_sglang_hicache_file_backend():
    parser = sglang_memory_options()
    words = command("sglang")
    assert words[:3] == ["python", "-m", "sglang.launch_server"]
    args, rest = parser.parse_known_args(words[3:])
    assert rest == ["--model-path", "meta-llama/Llama-3.1-8B-Instruct"]
    assert args.enable_hierarchical_cache is True
    assert args.hicache_storage_backend == "file"
    extra = json.loads(args.hicache_storage_backend_extra_config)
    assert extra == {"file_storage_path": "/mnt/kv-cache/sglang"}
    assert reads_key(SGLANG, "sglang/srt/mem_cache/hicache_storage.py", "file_storage_path")
    with pytest.raises((argparse.ArgumentError, SystemExit)):   # its choices are checked
        parser.parse_known_args(["--hicache-storage-backend", "files"])


def test_bluecacheds_kv_events_block(tmp_path):
    path = tmp_path / "bluecached.yaml"
    path.write_text(blocks()["bluecached-kv-events"])
    kv = config.load_config(path).kv_events
    assert kv.enabled and kv.medium == "STORAGE"
    assert kv.topic.startswith("kv@{host}@") and "{model}" not in kv.topic
