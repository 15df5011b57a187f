"""The control protocol between clients (hostd, bluecachectl) and bluecached.

docs/protocol.md is the reference; this module is its executable form. One zmq frame per
message, a msgpack map. Bulk bytes never travel here: read/write name a registered region.
"""

import errno
from dataclasses import dataclass

import msgpack

VERSION = 1
SUPPORTED_VERSIONS = (1,)
MAX_NAME = 4096      # generous: the namespace enforces NAME_MAX itself, with its own errno
MAX_STR = 4096
MAX_LIST = 64
MAX_FORGET = 4096
MAX_BLOB = 65536     # a DOCA export descriptor (its size is the SDK's business)
MAX_TARGET = 65536   # a symlink's target: the namespace enforces PATH_MAX, with its errno
MAX_XATTR_VALUE = 2 * 65536   # the store answers E2BIG past 64 KiB (XATTR_SIZE_MAX)
# The smallest request limit a daemon applies whatever its control.max_message_bytes: one
# setxattr of the largest value with its name and framing.
MIN_MESSAGE_BYTES = 65536 + 4096

U64 = "u64"
I64 = "i64"
U32 = "u32"
BYTES = "bytes"
BLOB = "blob"
TARGET = "target"
XATTR_VALUE = "xattr_value"
STR = "str"
BOOL = "bool"
U32_LIST = "u32[]"
U64_LIST = "u64[]"
U64_PAIR = "u64[2]"

_PARENT_NAME = {"parent": U64, "name": BYTES}
_TRANSFER = {"fh": U64, "offset": U64, "length": U64, "region": U64, "region_offset": U64}
_NEW = {**_PARENT_NAME, "mode": U32, "uid": U32, "gid": U32}

# op -> (required args, optional args)
OPS: dict[str, tuple[dict, dict]] = {
    "hello": ({"versions": U32_LIST}, {"client": STR, "replaces": U64}),
    "ping": ({}, {}),
    # prepare: a read-only open right after may be answered by the client (feature
    # open_prepared); the reply may then carry `prepared`
    "lookup": (_PARENT_NAME, {"prepare": BOOL}),
    "getattr": ({"ino": U64}, {}),
    "setattr": ({"ino": U64}, {"size": U64, "mode": U32, "uid": U32, "gid": U32,
                               "atime_ns": I64, "mtime_ns": I64,
                               "atime_now": BOOL, "mtime_now": BOOL}),
    "mkdir": (_NEW, {}),
    "create": ({**_NEW, "flags": U32}, {"backing": BOOL}),
    "symlink": ({**_PARENT_NAME, "target": TARGET, "uid": U32, "gid": U32}, {}),
    "mknod": ({**_NEW, "rdev": U64}, {}),
    "readlink": ({"ino": U64}, {}),
    "link": ({"ino": U64, "new_parent": U64, "new_name": BYTES}, {}),
    # backing: also the memfd, as the `backing` op gives it (the reply then carries an fd)
    "open": ({"ino": U64, "flags": U32}, {"backing": BOOL, "kept": U64_PAIR}),
    "read": (_TRANSFER, {}),
    "write": (_TRANSFER, {"kill_suidgid": BOOL}),
    "write_batch": ({"region": U64, "fhs": U64_LIST, "offsets": U64_LIST, "lengths": U64_LIST,
                     "region_offsets": U64_LIST}, {"kill_suidgid": U64_LIST}),
    "store": ({"fh": U64, "length": U64, "region": U64, "region_offset": U64}, {}),
    "query": ({"fh": U64}, {}),
    "flush": ({"fh": U64}, {}),
    "fsync": ({"fh": U64}, {}),
    "release": ({"fh": U64}, {}),
    "backing": ({"fh": U64}, {}),   # the reply carries an fd: local socket only
    "unlink": (_PARENT_NAME, {}),
    "discard": ({"ino": U64}, {}),
    "rmdir": (_PARENT_NAME, {}),
    "rename": ({**_PARENT_NAME, "new_parent": U64, "new_name": BYTES}, {"flags": U32}),
    "readdir": ({"ino": U64, "offset": U64}, {"limit": U32}),
    "forget": ({"inos": U64_LIST, "counts": U64_LIST}, {}),
    "statfs": ({}, {}),
    "status": ({}, {}),
    "stats": ({}, {}),
    "ls": ({}, {"path": STR}),
    "du": ({}, {"path": STR}),
    "evict": ({}, {"path": STR, "all": BOOL}),
    "verify": ({}, {"start": BOOL}),
    "import_region": ({"descriptor": BLOB, "address": U64, "length": U64}, {}),
    "release_region": ({"region": U64}, {}),
    "import_cuda_ipc": ({"handle": BYTES, "offset": U64, "length": U64}, {}),
    # user.* extended attributes (hello's features: "xattrs"); flags: XATTR_CREATE (1),
    # XATTR_REPLACE (2)
    "setxattr": ({"ino": U64, "name": BYTES, "value": XATTR_VALUE}, {"flags": U32}),
    "getxattr": ({"ino": U64, "name": BYTES}, {}),
    "listxattr": ({"ino": U64}, {}),
    "removexattr": ({"ino": U64, "name": BYTES}, {}),
}


class ProtocolError(Exception):
    """A message that cannot be served. `request_id` is set when the id could be read, so the
    client gets an error reply rather than a timeout."""

    def __init__(self, err: int, message: str, request_id: int | None = None):
        super().__init__(message)
        self.errno = err
        self.request_id = request_id


@dataclass(slots=True)
class Request:
    id: int
    op: str
    args: dict


def _check(kind: str, value) -> bool:
    if kind in (U64, U32, I64):
        if type(value) is not int:
            return False
        if kind == I64:
            return -(1 << 63) <= value < (1 << 63)
        return 0 <= value < (1 << (64 if kind == U64 else 32))
    if kind == BYTES:
        return type(value) is bytes and len(value) <= MAX_NAME
    if kind == TARGET:
        return type(value) is bytes and len(value) <= MAX_TARGET
    if kind == XATTR_VALUE:
        return type(value) is bytes and len(value) <= MAX_XATTR_VALUE
    if kind == BLOB:
        return type(value) is bytes and 0 < len(value) <= MAX_BLOB
    if kind == STR:
        return type(value) is str and len(value) <= MAX_STR
    if kind == BOOL:
        return type(value) is bool
    if kind == U32_LIST:
        return (type(value) is list and len(value) <= MAX_LIST
                and all(_check(U32, v) for v in value))
    if kind == U64_PAIR:
        return type(value) is list and len(value) == 2 and all(_check(U64, v) for v in value)
    if kind == U64_LIST:
        return (type(value) is list and len(value) <= MAX_FORGET
                and all(_check(U64, v) for v in value))
    return False


def _unpack(frame: bytes, max_bytes: int):
    if len(frame) > max_bytes:
        raise ProtocolError(errno.EMSGSIZE, f"message of {len(frame)} bytes exceeds {max_bytes}")
    try:
        return msgpack.unpackb(frame, raw=False, strict_map_key=False,
                               max_bin_len=max_bytes, max_str_len=max_bytes,
                               max_array_len=2 * MAX_FORGET, max_map_len=64)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError,
            msgpack.StackError) as e:
        # TypeError: a map whose key is a map or a list (unhashable)
        raise ProtocolError(errno.EBADMSG, f"undecodable message: {e}") from None


def decode_request(frame: bytes, max_bytes: int = 65536) -> Request:
    msg = _unpack(frame, max_bytes)
    if type(msg) is not dict:
        raise ProtocolError(errno.EBADMSG, "message is not a map")
    rid = msg.get("id")
    if not _check(U64, rid):
        raise ProtocolError(errno.EBADMSG, "missing or invalid request id")
    if msg.get("v") not in SUPPORTED_VERSIONS:
        raise ProtocolError(errno.EPROTO, f"unsupported protocol version {msg.get('v')!r}", rid)
    op = msg.get("op")
    if type(op) is not str or op not in OPS:
        raise ProtocolError(errno.ENOSYS, f"unknown operation {op!r}", rid)
    args = msg.get("args", {})
    if type(args) is not dict:
        raise ProtocolError(errno.EINVAL, "args is not a map", rid)
    required, optional = OPS[op]
    for key, value in args.items():
        kind = required.get(key) or optional.get(key)
        if kind is None:
            raise ProtocolError(errno.EINVAL, f"{op}: unknown argument {key!r}", rid)
        if not _check(kind, value):
            raise ProtocolError(errno.EINVAL, f"{op}: argument {key!r} must be {kind}", rid)
    missing = [k for k in required if k not in args]
    if missing:
        raise ProtocolError(errno.EINVAL, f"{op}: missing argument(s) {', '.join(missing)}", rid)
    return Request(rid, op, args)


def encode_request(rid: int, op: str, args: dict) -> bytes:
    return msgpack.packb({"v": VERSION, "id": rid, "op": op, "args": args}, use_bin_type=True)


def encode_reply(rid: int | None, result) -> bytes:
    return msgpack.packb({"id": rid, "ok": True, "result": result}, use_bin_type=True)


def encode_error(rid: int | None, err: int, message: str) -> bytes:
    return msgpack.packb({"id": rid, "ok": False, "errno": err, "error": message},
                         use_bin_type=True)


def decode_reply(frame: bytes, max_bytes: int = 64 << 20) -> dict:
    msg = _unpack(frame, max_bytes)
    if type(msg) is not dict or "ok" not in msg:
        raise ProtocolError(errno.EBADMSG, "reply is not a reply map")
    return msg


# Events on the PUB socket: [topic, msgpack map]. Subscribers filter by topic prefix.
EVENT_REMOVED = b"removed"
# {ino}: the object's memfd, lent for passthrough (Store.backing), is no longer its bytes'
# home (evicted from DRAM, removed): a client that kept an fd of it lets it go.
EVENT_LEFT_DRAM = b"left-dram"


def encode_event(topic: bytes, fields: dict) -> list[bytes]:
    return [topic, msgpack.packb(fields, use_bin_type=True)]


def decode_event(frames: list[bytes]) -> tuple[bytes, dict]:
    if len(frames) != 2:
        raise ProtocolError(errno.EBADMSG, "event must have two frames")
    fields = _unpack(frames[1], 65536)
    if type(fields) is not dict:
        raise ProtocolError(errno.EBADMSG, "event body is not a map")
    return frames[0], fields


def state_dir_endpoints(state_dir: str) -> dict[str, str]:
    """Where an embedded-mode daemon with this state dir listens."""
    return {"control": f"ipc://{state_dir}/control.sock",
            "local": f"{state_dir}/control.seq",
            "events": f"ipc://{state_dir}/events.sock",
            "regions": f"{state_dir}/dma.sock"}
