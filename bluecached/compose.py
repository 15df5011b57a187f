"""The composition root: the store, its tiers and the remote tier built from a config.

The daemon and the tests build a store the same way, here, so what runs is what is tested:
the daemon from its config (`build_store`), the tests and benches from sizes they choose
(`assemble_store`, which `build_store` calls).
"""

from pathlib import Path

from .paths import describe
from .startup import StartupError
from .store import RemoteView, Store
from .tiers.dram import DramPool, allow_fds_for
from .tiers.journal import Journal
from .tiers.nvme import SegmentStore
from .tiers.placement import Tiers, Watermarks


def build_store(cfg, engine) -> Store:
    dram, nvme = cfg.tiers.dram, cfg.tiers.nvme
    store = assemble_store(
        engine, dram_size=dram.size, dram_marks=(dram.high_watermark, dram.low_watermark),
        nvme_path=nvme.path, nvme_size=nvme.size, segment_size=nvme.segment_size,
        nvme_marks=(nvme.high_watermark, nvme.low_watermark), o_direct=nvme.o_direct,
        durable=cfg.durability == "fsync", write_through=cfg.write_policy == "write-through",
        journal_max_bytes=cfg.journal_max_bytes, tmp_max_age=cfg.tmp_max_age)
    if cfg.remote.enabled:
        add_remote_tier(store, cfg.remote)
    return store


def assemble_store(engine, *, dram_size: int, dram_marks: tuple[float, float],
                   nvme_path, nvme_size: int, segment_size: int,
                   nvme_marks: tuple[float, float], o_direct: str, durable: bool,
                   write_through: bool, journal_max_bytes: int, tmp_max_age: float) -> Store:
    """A store over a DRAM pool and (with `nvme_size`) an NVMe tier and its journal at
    `nvme_path`; not loaded yet (`Store.load`), publishing nothing yet (`Store.publish`)."""
    nvme = journal = None
    if nvme_size:
        nvme_path = Path(nvme_path)
        try:
            nvme = SegmentStore(nvme_path, nvme_size, segment_size, o_direct, durable)
            journal = Journal(nvme_path, durable)
        except OSError as e:
            raise StartupError(f"NVMe tier at {nvme_path}: {describe(e)}") from None
    allow_fds_for(dram_size)
    pool = DramPool(dram_size, before_unmap=engine.forget_host_memory,
                    after_map=getattr(engine, "prepare_host_memory", None),
                    locks_pages=getattr(engine, "locks_host_memory", None))
    # the tiers' evictor removes files through the store, which is built after them
    tiers = Tiers(pool, Watermarks(*dram_marks), nvme, Watermarks(*nvme_marks), journal,
                  write_through, journal_max_bytes,
                  remove_object=lambda node, reason: store.remove_object(node, reason))
    store = Store(tiers, engine, tmp_max_age=tmp_max_age)
    return store


def add_remote_tier(store: Store, rc):
    """The remote tier from the `remote:` section, below the store's local tiers; the store
    then asks it on local misses. Problems are StartupErrors."""
    from .tiers.remote import RemoteTier
    bucket = open_bucket(rc)
    store.remote = RemoteTier(bucket, remote_policy(rc), store.tiers, RemoteView(store))
    return store.remote


def open_bucket(rc):
    """The S3 store of the `remote:` section (credentials read, client made, no request
    sent); problems are StartupErrors."""
    try:
        from .tiers import s3
    except ImportError as e:   # boto3 is the package's recommendation, not a hard dependency
        raise StartupError(f"remote tier: {e} (install python3-boto3)") from None
    credentials = None
    if rc.credentials_file is not None:
        try:
            credentials = s3.load_credentials(rc.credentials_file)
        except ValueError as e:
            raise StartupError(f"remote tier: {e}") from None
    connections = (rc.upload_workers + rc.prefetch + 2) * rc.part_concurrency + 8
    try:
        client = s3.make_client(rc.endpoint, rc.region, credentials, rc.ca_bundle,
                                rc.verify_tls, rc.addressing_style, rc.timeout, connections,
                                rc.sign_payload)
    except ImportError as e:
        raise StartupError(f"remote tier: {e} (install python3-boto3)") from None
    except ValueError as e:   # botocore's complaint about an endpoint or a setting
        raise StartupError(f"remote tier: {e}") from None
    return s3.S3Store(client, rc.bucket, rc.part_size, rc.multipart_threshold,
                      rc.part_concurrency)


def remote_policy(rc):
    from .tiers.remote import RemotePolicy
    prefix = rc.prefix if not rc.prefix or rc.prefix.endswith("/") else rc.prefix + "/"
    return RemotePolicy(
        prefix=prefix, admission=rc.admission, admission_age=rc.admission_age,
        queue_max=rc.queue_max, upload_workers=rc.upload_workers,
        negative_ttl=rc.negative_ttl, retry_interval=rc.retry_interval,
        max_bytes=rc.max_bytes, max_age=rc.max_age, enforce_interval=rc.enforce_interval,
        prefetch=rc.prefetch, prefetch_max_bytes=rc.prefetch_max_bytes,
        describe={"endpoint": rc.endpoint or f"AWS S3 ({rc.region})", "bucket": rc.bucket})
