"""The remote tier's S3 side: blocking calls through botocore, run in worker threads.

boto3/botocore is the client (thread-safe clients, SigV4, retries, any S3 endpoint; Debian
bookworm ships 1.26/1.29, and this module sticks to what that version has). The transfer
logic is ours rather than s3transfer's: uploads read straight from the DRAM chunks (no staging
copy of the object), and a download must be pinned to the version a lookup saw (IfMatch on
every ranged GET), which s3transfer's downloader does not accept.

Every object carries as user metadata its size, its CRC32C and the CRC32C of each 1 MiB chunk
(when they fit the 2 KB metadata limit: objects up to ~256 MiB). `get_into` checks each chunk
as it arrives and reports it, so a reader can be served the checked chunks of an object that
is still arriving; an object without chunk CRCs is checked whole before any chunk is reported.
"""

from __future__ import annotations

import base64
import binascii
import configparser
import hashlib
import http.client
import io
import stat
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import crc32c
import msgpack

from .. import crc as crcs
from .. import xattrs as xattr_rules

CRC_META = "bluecache-crc32c"
SIZE_META = "bluecache-size"
CHUNKS_META = "bluecache-crc32c-chunks"   # "<chunk size>:<base64 of packed LE u32 CRCs>"
CHUNKS_META_MAX = 1400     # S3 allows 2 KB of user metadata in all (AWS; RGW is laxer)
# A file's user.* extended attributes (xattrs.py): inline as base64 of msgpack [[name, value],
# ...] when that fits beside the other metadata, else in a sidecar object whose SHA-256 the
# object's metadata names (values go up to 64 KiB, far past the 2 KB metadata limit).
XATTRS_META = "bluecache-xattrs"
XATTRS_SIDECAR_META = "bluecache-xattrs-sha256"
META_BUDGET = 2000         # what all user metadata (keys and values) may take, under 2 KB
# Sidecars live under prefix + this directory: a name longer than NAME_MAX (255 bytes), which
# no lookup can ever ask for, so no file or directory of the mount shows it.
SIDECAR_DIR = ".bluecache-xattrs." + "_" * 240
SIDECAR_MAX = 2 * xattr_rules.TOTAL_MAX   # a sidecar's body is at most this many bytes


class S3Error(Exception):
    """A failed S3 call. `unreachable` is True when no answer came (connection refused, timed
    out): the tier is then marked down until a probe succeeds."""

    def __init__(self, message: str, unreachable: bool = False, status: int | None = None):
        super().__init__(message)
        self.unreachable = unreachable
        self.status = status     # the HTTP status of an answer, if there was one


class ChecksumMismatch(Exception):
    pass


class Changed(Exception):
    """The object is gone or was replaced since it was looked up."""


@dataclass(frozen=True)
class RemoteObject:
    size: int
    crc: int | None      # None: not written by bluecache (no checksum): never served
    etag: str
    mtime: float         # seconds since the epoch
    chunk_crcs: bytes | None = None   # CRC32C per `chunk_size` chunk, consistent with crc
    chunk_size: int = 0
    xattrs: dict | None = None         # its user.* attributes when inline in the metadata
    xattrs_sidecar: str | None = None  # else the SHA-256 (hex) of its sidecar's body
    xattrs_bad: bool = False           # attribute metadata that does not decode: not served


def encode_chunk_crcs(chunk_crcs: bytes, chunk_size: int) -> str | None:
    """The metadata value for the chunk CRCs, or None if it would not fit."""
    value = f"{chunk_size}:{base64.b64encode(chunk_crcs).decode()}"
    return value if len(value) <= CHUNKS_META_MAX else None


def _meta_bytes(meta: dict) -> int:
    return sum(len(k.encode()) + len(v.encode()) for k, v in meta.items())


def object_metadata(size: int, chunk_crcs: bytes, chunk_size: int) -> dict:
    """The checksum metadata of an object (put)."""
    crc = crcs.object_crc(chunk_crcs, size, chunk_size)
    meta = {CRC_META: f"{crc:08x}", SIZE_META: str(size)}
    encoded = encode_chunk_crcs(chunk_crcs, chunk_size)
    if encoded is not None:
        meta[CHUNKS_META] = encoded
    return meta


def xattrs_metadata(table: dict | None, meta: dict) -> tuple[dict, bytes | None]:
    """What an object with these attributes adds to `meta` (its other metadata): the
    inline field, or the sidecar's digest and the sidecar's body to upload first."""
    if not table:
        return {}, None
    packed = msgpack.packb(xattr_rules.to_pairs(table), use_bin_type=True)
    inline = base64.b64encode(packed).decode()
    if _meta_bytes(meta) + len(XATTRS_META) + len(inline) <= META_BUDGET:
        return {XATTRS_META: inline}, None
    return {XATTRS_SIDECAR_META: hashlib.sha256(packed).hexdigest()}, packed


def decode_xattrs(packed: bytes) -> dict | None:
    """The table from its packed form; ValueError if malformed."""
    try:
        pairs = msgpack.unpackb(packed, raw=False, max_bin_len=SIDECAR_MAX,
                                max_str_len=SIDECAR_MAX)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError,
            msgpack.StackError) as e:
        raise ValueError(f"undecodable attributes: {e}") from None
    return xattr_rules.from_pairs(pairs)


def _xattrs_of(meta: dict) -> dict:
    """RemoteObject's attribute fields from an answer's metadata."""
    inline, digest = meta.get(XATTRS_META), meta.get(XATTRS_SIDECAR_META)
    try:
        if inline is not None:
            return {"xattrs": decode_xattrs(base64.b64decode(inline, validate=True))}
    except (ValueError, binascii.Error):
        return {"xattrs_bad": True}
    if digest is not None:
        if len(digest) != 64:
            return {"xattrs_bad": True}
        return {"xattrs_sidecar": digest}
    return {}


def decode_chunk_crcs(value: str | None, size: int, crc: int | None) -> tuple[bytes, int] | None:
    """(chunk CRCs, chunk size) from metadata, or None unless they are well formed and agree
    with the whole object's CRC (anything else falls back to checking the object whole)."""
    if value is None or crc is None:
        return None
    try:
        chunk_size, encoded = value.split(":", 1)
        chunk_size = int(chunk_size)
        chunk_crcs = base64.b64decode(encoded, validate=True)
    except (ValueError, binascii.Error):
        return None
    count = -(-size // chunk_size) if chunk_size > 0 else -1
    if count < 0 or len(chunk_crcs) != 4 * count:
        return None
    if crcs.object_crc(chunk_crcs, size, chunk_size) != crc:
        return None
    return chunk_crcs, chunk_size


@dataclass(frozen=True)
class Credentials:
    access_key_id: str
    secret_access_key: str
    session_token: str | None = None


def load_credentials(path: Path) -> Credentials:
    """An AWS-style credentials file ([default] aws_access_key_id = ..., aws_secret_access_key
    = ..., optional aws_session_token). Refused unless only its owner can read it."""
    try:
        st = path.stat()
    except OSError as e:
        raise ValueError(f"credentials file {path}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"credentials file {path}: not a regular file")
    if st.st_mode & 0o077:
        raise ValueError(f"credentials file {path} is readable or writable by group or others "
                         f"(mode {stat.S_IMODE(st.st_mode):04o}): chmod 600 it")
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read_string(path.read_text(), str(path))
    except (OSError, UnicodeDecodeError, configparser.Error) as e:
        raise ValueError(f"credentials file {path}: {e}") from None
    if not parser.has_section("default"):
        raise ValueError(f"credentials file {path}: no [default] section")
    section = parser["default"]
    missing = [k for k in ("aws_access_key_id", "aws_secret_access_key") if not section.get(k)]
    if missing:
        raise ValueError(f"credentials file {path}: [default] lacks {', '.join(missing)}")
    return Credentials(section["aws_access_key_id"], section["aws_secret_access_key"],
                       section.get("aws_session_token") or None)


def checksum_options() -> dict:
    """botocore >= 1.36 adds CRC trailers (aws-chunked uploads) by default, which many S3
    servers (Ceph 16's radosgw among them) reject; ask for them only where an API requires
    them. Older botocore (bookworm's 1.29) has neither the options nor the behaviour."""
    from botocore.config import Config
    if "request_checksum_calculation" in Config.OPTION_DEFAULTS:
        return {"request_checksum_calculation": "when_required",
                "response_checksum_validation": "when_required"}
    return {}


def make_client(endpoint: str | None, region: str, credentials: Credentials | None,
                ca_bundle: Path | None, verify_tls: bool, addressing_style: str,
                timeout: float, connections: int, sign_payload: bool = False):
    import boto3
    from botocore.config import Config
    keys = {}
    if credentials is not None:
        keys = {"aws_access_key_id": credentials.access_key_id,
                "aws_secret_access_key": credentials.secret_access_key,
                "aws_session_token": credentials.session_token}
    verify: bool | str = str(ca_bundle) if ca_bundle else verify_tls
    # Sessions are not thread-safe, clients are: one session, used here only.
    return boto3.session.Session().client(
        "s3", endpoint_url=endpoint or None, region_name=region, verify=verify,
        config=Config(connect_timeout=timeout, read_timeout=timeout,
                      retries={"max_attempts": 2, "mode": "standard"},
                      max_pool_connections=connections,
                      s3={"addressing_style": addressing_style,
                          "payload_signing_enabled": sign_payload}, **checksum_options()),
        **keys)


def _classify(e: Exception, what: str) -> Exception:
    from botocore.exceptions import (
        ClientError,
        ConnectionClosedError,
        ConnectTimeoutError,
        EndpointConnectionError,
        ReadTimeoutError,
    )
    if isinstance(e, ClientError):
        code = e.response.get("Error", {}).get("Code", "")
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in ("404", "NoSuchKey", "NotFound", "412", "PreconditionFailed") or \
                status in (404, 412):
            return Changed(f"{what}: {code or status}")
        return S3Error(f"{what}: {code or status}: {e.response.get('Error', {}).get('Message')}",
                       status=status)
    if isinstance(e, EndpointConnectionError | ConnectTimeoutError | ReadTimeoutError |
                  ConnectionClosedError):
        return S3Error(f"{what}: {e}", unreachable=True)
    return S3Error(f"{what}: {type(e).__name__}: {e}", unreachable=isinstance(e, OSError))


class ChunkReader(io.RawIOBase):
    """A seekable read-only file over memoryviews (an object's chunks, or a part of them): the
    body of a PUT or an upload part, read by botocore without a copy of the object."""

    def __init__(self, views: list[memoryview]):
        self._views = views
        self._size = sum(len(v) for v in views)
        self._pos = 0
        self._starts = []
        pos = 0
        for v in views:
            self._starts.append(pos)
            pos += len(v)

    def __len__(self) -> int:
        return self._size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buf) -> int:
        out = memoryview(buf).cast("B")
        done = 0
        while done < len(out) and self._pos < self._size:
            i = self._index(self._pos)
            start = self._pos - self._starts[i]
            piece = self._views[i][start:start + len(out) - done]
            out[done:done + len(piece)] = piece
            done += len(piece)
            self._pos += len(piece)
        return done

    def _index(self, pos: int) -> int:
        lo, hi = 0, len(self._starts) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._starts[mid] <= pos:
                lo = mid
            else:
                hi = mid - 1
        return lo


def _slice(views: list[memoryview], offset: int, length: int) -> list[memoryview]:
    out, pos = [], 0
    for v in views:
        end = pos + len(v)
        if end > offset and pos < offset + length:
            out.append(v[max(0, offset - pos):min(len(v), offset + length - pos)])
        pos = end
    return out


def _describe(r: dict, size: int) -> RemoteObject:
    """The object a HEAD or GET answer describes (its metadata carries the checksums)."""
    meta = r.get("Metadata", {})
    crc = meta.get(CRC_META)
    try:
        crc = int(crc, 16) if crc is not None else None
    except ValueError:
        crc = None
    chunks = decode_chunk_crcs(meta.get(CHUNKS_META), size, crc) or (None, 0)
    return RemoteObject(size, crc, r.get("ETag", ""), r["LastModified"].timestamp(), *chunks,
                        **_xattrs_of(meta))


class S3Store:
    """Blocking S3 calls on one bucket and key prefix. Thread-safe (botocore clients are)."""

    def __init__(self, client, bucket: str, part_size: int, multipart_threshold: int,
                 concurrency: int):
        self.client = client
        self.bucket = bucket
        self.part_size = part_size
        self.multipart_threshold = multipart_threshold
        self.concurrency = concurrency
        self._pool = ThreadPoolExecutor(max(1, concurrency), thread_name_prefix="s3-part")

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _call(self, what: str, fn, **kw):
        try:
            return fn(Bucket=self.bucket, **kw)
        except Exception as e:  # botocore raises many types; _classify sorts them
            raise _classify(e, what) from None

    def probe(self) -> None:
        """Raises S3Error unless the bucket answers."""
        try:
            self._call("head bucket", self.client.head_bucket)
        except Changed:
            raise S3Error(f"bucket {self.bucket} does not exist") from None

    def head(self, key: str) -> RemoteObject | None:
        try:
            r = self._call(f"head {key}", self.client.head_object, Key=key)
        except Changed:
            return None
        return _describe(r, r["ContentLength"])

    def open_object(self, key: str, length: int) -> tuple[RemoteObject, object, int] | None:
        """A GET of the object's first `length` bytes whose body is left to the caller to read
        (into `get_into`) or close: what a HEAD says of the object, without a round trip of
        its own before the bytes come. (object, body, bytes in body), or None if there is no
        such object."""
        try:
            r = self._call(f"get {key}", self.client.get_object, Key=key,
                           Range=f"bytes=0-{length - 1}")
        except Changed:
            return None
        except S3Error as e:
            if e.status != 416:   # an empty object has no byte 0
                raise
            info = self.head(key)
            return None if info is None else (info, None, 0)
        body = r["Body"]
        try:
            content_range = r.get("ContentRange")   # "bytes 0-8388607/33554432"
            size = int(content_range.rsplit("/", 1)[1]) if content_range else r["ContentLength"]
            return _describe(r, size), body, r["ContentLength"]
        except (KeyError, ValueError, IndexError) as e:
            body.close()
            raise S3Error(f"get {key}: unexpected answer: {e}") from None

    def first_key(self, prefix: str) -> str | None:
        """The first key under prefix (one-key LIST), or None if there is none."""
        r = self._call(f"list {prefix}", self.client.list_objects_v2, Prefix=prefix, MaxKeys=1)
        contents = r.get("Contents") or []
        return contents[0]["Key"] if contents else None

    def list(self, prefix: str) -> Iterator[tuple[str, int, float]]:
        """(key, size, mtime) of every object under prefix."""
        token = None
        while True:
            kw = {"Prefix": prefix, "MaxKeys": 1000}
            if token:
                kw["ContinuationToken"] = token
            r = self._call(f"list {prefix}", self.client.list_objects_v2, **kw)
            for o in r.get("Contents", []):
                yield o["Key"], o["Size"], o["LastModified"].timestamp()
            token = r.get("NextContinuationToken")
            if not r.get("IsTruncated") or not token:
                return

    def delete(self, key: str) -> None:
        try:
            self._call(f"delete {key}", self.client.delete_object, Key=key)
        except Changed:
            pass

    def put(self, key: str, views: list[memoryview], chunk_size: int,
            chunk_crcs: bytes | None = None, xattrs: dict | None = None,
            sidecar_key: str | None = None) -> int:
        """Uploads the bytes with their CRC32Cs as metadata (per `chunk_size` chunk, computed
        here unless given, and whole), and the file's attributes (`xattrs`: inline, or in
        a sidecar at `sidecar_key` uploaded first); multipart with parallel parts above the
        threshold. Returns the chunk CRCs."""
        size = sum(len(v) for v in views)
        if chunk_crcs is None:
            chunk_crcs = crcs.chunk_crcs(views, chunk_size)
        meta = object_metadata(size, chunk_crcs, chunk_size)
        fields, sidecar = xattrs_metadata(xattrs, meta)
        if sidecar is not None:
            if sidecar_key is None:
                raise S3Error(f"put {key}: its attributes need a sidecar and none was named")
            self._call(f"put {sidecar_key}", self.client.put_object, Key=sidecar_key,
                       Body=sidecar, ContentLength=len(sidecar))
        meta.update(fields)
        if size <= self.multipart_threshold:
            self._call(f"put {key}", self.client.put_object, Key=key, Body=ChunkReader(views),
                       ContentLength=size, Metadata=meta)
            return chunk_crcs
        upload = self._call(f"start upload {key}", self.client.create_multipart_upload,
                            Key=key, Metadata=meta)["UploadId"]
        try:
            def part(n: int, offset: int) -> dict:
                length = min(self.part_size, size - offset)
                r = self._call(f"upload part {n} of {key}", self.client.upload_part, Key=key,
                               UploadId=upload, PartNumber=n, ContentLength=length,
                               Body=ChunkReader(_slice(views, offset, length)))
                return {"PartNumber": n, "ETag": r["ETag"]}
            futures = [self._pool.submit(part, i + 1, off)
                       for i, off in enumerate(range(0, size, self.part_size))]
            parts = [f.result() for f in futures]
            self._call(f"complete upload {key}", self.client.complete_multipart_upload,
                       Key=key, UploadId=upload, MultipartUpload={"Parts": parts})
        except BaseException:
            try:
                self._call(f"abort upload {key}", self.client.abort_multipart_upload, Key=key,
                           UploadId=upload)
            except (S3Error, Changed):
                pass  # the server's incomplete-upload cleanup (lifecycle) takes it then
            raise
        return chunk_crcs

    def get_sidecar(self, sidecar_key: str, digest: str) -> dict | None:
        """The attributes in a sidecar, or None if it is missing or is not the one the
        object names (replaced, damaged): the object is then not served."""
        try:
            r = self._call(f"get {sidecar_key}", self.client.get_object, Key=sidecar_key)
        except Changed:
            return None
        body = r["Body"]
        try:
            packed = body.read(SIDECAR_MAX + 1)
        except Exception as e:   # the connection broke mid-body
            raise _classify(e, f"get {sidecar_key}") from None
        finally:
            body.close()
        if len(packed) > SIDECAR_MAX or hashlib.sha256(packed).hexdigest() != digest:
            return None
        try:
            return decode_xattrs(packed)
        except ValueError:
            return None

    def get_into(self, key: str, obj: RemoteObject, views: list[memoryview], chunk_size: int,
                 on_chunk=None, opened: tuple[object, int] | None = None) -> bytes:
        """Downloads the object a lookup saw (IfMatch its ETag) into `views` (one per
        `chunk_size` chunk, the last one possibly shorter), with parallel ranged GETs above the
        threshold; `opened` is (body, length) of an `open_object` GET of its start, read
        first (and closed here whatever happens). Each chunk is checked against its CRC32C as
        it arrives, then reported with `on_chunk(index)` (from a worker thread); without chunk
        CRCs the whole object is checked at the end and nothing is reported. Returns the
        chunks' CRC32Cs (packed)."""
        first_body, first_length = opened or (None, 0)
        try:
            return self._get_into(key, obj, views, chunk_size, on_chunk, first_body,
                                  first_length)
        finally:
            if first_body is not None:
                first_body.close()

    def _get_into(self, key, obj, views, chunk_size, on_chunk, first_body, first_length):
        if obj.crc is None:
            raise ChecksumMismatch(f"{key} carries no {CRC_META} metadata")
        size = obj.size
        if first_body is not None and first_length != size and first_length % chunk_size:
            raise ValueError("an opened body must end on a chunk boundary")
        if sum(len(v) for v in views) != size or any(
                len(v) != min(chunk_size, size - i * chunk_size) for i, v in enumerate(views)):
            raise ValueError("destination is not the object's chunks")
        expected = None
        if obj.chunk_crcs is not None and obj.chunk_size == chunk_size:
            expected = crcs.unpack(obj.chunk_crcs)
        got = [0] * len(views)
        stop = False   # one range failed: the others stop at their next chunk

        def fetch(first: int, last: int, body=None) -> None:   # chunks first..last-1
            offset, end = first * chunk_size, min(size, last * chunk_size)
            kw = {"Key": key, "IfMatch": obj.etag} if obj.etag else {"Key": key}
            if end - offset != size:
                kw["Range"] = f"bytes={offset}-{end - 1}"
            if body is None:
                body = self._call(f"get {key}", self.client.get_object, **kw)["Body"]
            readinto, release = _direct_reader(body)
            try:
                for i in range(first, last):
                    if stop:
                        return
                    dest, filled = views[i], 0
                    while filled < len(dest):
                        n = readinto(dest[filled:])
                        if not n:
                            raise Changed(f"get {key}: short body at chunk {i}")
                        filled += n
                    got[i] = crc32c.crc32c(dest)
                    if expected is not None:
                        if got[i] != expected[i]:
                            raise ChecksumMismatch(f"{key}: CRC32C of chunk {i} is {got[i]:08x}, "
                                                   f"not {expected[i]:08x}")
                        if on_chunk is not None:
                            on_chunk(i)
                release()
            except (OSError, http.client.HTTPException) as e:
                raise S3Error(f"get {key}: {e}", unreachable=True) from None
            finally:
                body.close()

        count = len(views)
        opened = -(-first_length // chunk_size) if first_body is not None else 0
        if size <= self.multipart_threshold or size <= self.part_size:
            ranges = [(0, opened, first_body)] if opened else []
            if opened < count:
                ranges.append((opened, count, None))
            for first, last, body in ranges:
                fetch(first, last, body)
        else:
            step = max(1, self.part_size // chunk_size)   # ranges of whole chunks
            futures = [self._pool.submit(fetch, 0, opened, first_body)] if opened else []
            futures += [self._pool.submit(fetch, i, min(count, i + step))
                        for i in range(opened, count, step)]
            try:
                for f in futures:
                    f.result()
            except BaseException:
                # the destination is the caller's again only once no range writes into it
                stop = True
                wait(futures)
                raise
        packed = struct.pack(f"<{count}I", *got)
        if expected is None and crcs.object_crc(packed, size, chunk_size) != obj.crc:
            raise ChecksumMismatch(f"{key}: CRC32C of the fetched bytes is not {obj.crc:08x}")
        return packed


def _direct_reader(body):
    """(readinto, release) for a GET's body. botocore's readinto goes through urllib3's, which
    reads into a new bytes object and copies it (with http.client's own copy, three copies of
    every byte and a fresh 1 MiB buffer per call); the http.client response underneath reads
    from the socket straight into the destination. `release` hands the connection back to
    urllib3's pool once the body was read that way (closing it otherwise drops the
    connection). Anything not shaped as expected (other versions) gets the public path."""
    stream = getattr(body, "_raw_stream", None)
    fp = getattr(stream, "_fp", None)
    if (isinstance(fp, http.client.HTTPResponse) and hasattr(stream, "release_conn")
            and not getattr(stream, "decode_content", False)):
        def release() -> None:
            if fp.isclosed():   # read to its end: the connection is clean
                stream.release_conn()
        return fp.readinto, release
    if hasattr(body, "readinto"):
        return body.readinto, lambda: None

    def read_into(dest: memoryview) -> int:
        data = body.read(len(dest))
        dest[:len(data)] = data
        return len(data)
    return read_into, lambda: None


def fsdecode_key(path: bytes) -> str | None:
    """The S3 key for a path under the mount, or None if it is not UTF-8 (S3 keys are)."""
    try:
        return path.decode("utf-8")
    except UnicodeDecodeError:
        return None

