"""Keeps the few modules of the connectors' own code that the tests load (tests/connector_code.py)
under .cache/connector-code/<package>-<version>/: each pinned wheel is downloaded with pip,
without its dependencies, the listed files are extracted and the wheel is deleted. Idempotent:
a package whose files are all there is not fetched again. Run by `scripts/setup.sh --test`.
"""

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEST = ROOT / ".cache" / "connector-code"

# package==version -> files of its wheel the tests load
WANTED = {
    "vllm==0.33.0": [
        "vllm/distributed/kv_events.py",               # the KV event classes
        "vllm/config/kv_transfer.py",                  # KVTransferConfig (--kv-transfer-config)
        "vllm/v1/kv_offload/factory.py",               # spec_name -> spec
        "vllm/v1/kv_offload/cpu/spec.py",              # cpu_bytes_to_use
        "vllm/v1/kv_offload/tiering/factory.py",       # secondary tier type -> class
        "vllm/v1/kv_offload/tiering/fs/manager.py",    # the FS tier's parameters
        "vllm/distributed/kv_transfer/kv_connector/factory.py",   # kv_connector names
        "vllm/distributed/kv_transfer/kv_connector/v1/offloading/config.py",   # block_size
    ],
    "lmcache==0.5.6": [
        "lmcache/logging.py",
        "lmcache/v1/config_base.py",
        "lmcache/v1/config.py",                        # LMCacheEngineConfig
    ],
    "sglang==0.5.23": [
        "sglang/srt/arg_groups/arg_utils.py",
        "sglang/srt/arg_groups/choices.py",
        "sglang/srt/arg_groups/fields/memory.py",      # the --hicache-* options
        "sglang/srt/mem_cache/hicache_storage.py",     # HiCacheFile: file_storage_path
    ],
}


def fetch(requirement: str, files: list[str]) -> None:
    name, version = requirement.split("==")
    target = DEST / f"{name}-{version}"
    if all((target / f).is_file() for f in files):
        return
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--only-binary", ":all:", "-d", tmp, requirement], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            for f in files:
                out = target / f
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(zf.read(f))
    print(f"fetch_connector_code: {requirement}: {len(files)} files in {target}",
          file=sys.stderr)


def main() -> int:
    for requirement, files in WANTED.items():
        fetch(requirement, files)
    return 0


if __name__ == "__main__":
    sys.exit(main())
