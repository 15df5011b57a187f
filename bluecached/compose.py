"""The composition root: the store, its tiers and the remote tier built from a config.

The daemon and the tests build a store the same way, here, so what runs is what is tested.
"""

from pathlib import Path

from .paths import describe
from .store import Store
from .tiers.dram import DramPool
from .tiers.journal import Journal
from .tiers.nvme import SegmentStore
from .tiers.placement import Tiers, Watermarks


class StartupError(Exception):
    """A problem the operator must fix; logged as one line, no traceback."""


def build_store(cfg, engine) -> Store:
    nvme_cfg = cfg.tiers.nvme
    durable = cfg.durability == "fsync"
    nvme = journal = None
    if nvme_cfg.size:
        try:
            nvme = SegmentStore(Path(nvme_cfg.path), nvme_cfg.size, nvme_cfg.segment_size,
                                nvme_cfg.o_direct, durable)
            journal = Journal(Path(nvme_cfg.path), durable)
        except OSError as e:
            raise StartupError(f"NVMe tier at {nvme_cfg.path}: {describe(e)}") from None
    dram = cfg.tiers.dram
    pool = DramPool(dram.size)
    pool.before_unmap = engine.forget_host_memory
    tiers = Tiers(pool, Watermarks(dram.high_watermark, dram.low_watermark),
                  nvme, Watermarks(nvme_cfg.high_watermark, nvme_cfg.low_watermark),
                  journal, cfg.write_policy == "write-through", cfg.journal_max_bytes,
                  remove_object=lambda node, reason: store.remove_object(node, reason))
    store = Store(tiers, engine, tmp_max_age=cfg.tmp_max_age)
    if cfg.remote.enabled:
        store.attach_remote(build_remote(cfg.remote))
    return store


def build_remote(rc):
    """The remote tier from the `remote:` section; problems are StartupErrors."""
    from .tiers.remote import RemotePolicy, RemoteTier
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
    prefix = rc.prefix if not rc.prefix or rc.prefix.endswith("/") else rc.prefix + "/"
    policy = RemotePolicy(
        prefix=prefix, admission=rc.admission, admission_age=rc.admission_age,
        queue_max=rc.queue_max, upload_workers=rc.upload_workers,
        negative_ttl=rc.negative_ttl, retry_interval=rc.retry_interval,
        max_bytes=rc.max_bytes, max_age=rc.max_age, enforce_interval=rc.enforce_interval,
        prefetch=rc.prefetch, prefetch_max_bytes=rc.prefetch_max_bytes,
        describe={"endpoint": rc.endpoint or f"AWS S3 ({rc.region})", "bucket": rc.bucket})
    store = s3.S3Store(client, rc.bucket, rc.part_size, rc.multipart_threshold,
                       rc.part_concurrency)
    return RemoteTier(store, policy)
