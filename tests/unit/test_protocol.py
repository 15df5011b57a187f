"""The wire decoder: valid requests decode, everything else is a ProtocolError (never a crash)."""

import errno

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bluecached.wire import protocol
from bluecached.wire.protocol import ProtocolError, decode_request, encode_request


def test_round_trip_of_every_operation():
    sample = {protocol.U64: 7, protocol.U32: 5, protocol.I64: -3, protocol.BYTES: b"n\xff",
              protocol.STR: "s", protocol.BOOL: True, protocol.U32_LIST: [1],
              protocol.U64_LIST: [1 << 40], protocol.U64_PAIR: [3, 1 << 40],
              protocol.BLOB: b"d" * 5000,
              protocol.TARGET: b"t" * 5000, protocol.XATTR_VALUE: b""}
    for op, (required, optional) in protocol.OPS.items():
        args = {k: sample[t] for k, t in {**required, **optional}.items()}
        req = decode_request(encode_request(42, op, args))
        assert (req.id, req.op, req.args) == (42, op, args)


@pytest.mark.parametrize("frame,err,has_id", [
    (b"", errno.EBADMSG, False),
    (b"\xc1", errno.EBADMSG, False),                                    # never-used byte
    (b"\x81\x80\x00", errno.EBADMSG, False),                          # {{}: 0}: unhashable key
    (msgpack.packb([1, 2]), errno.EBADMSG, False),                      # not a map
    (msgpack.packb({"v": 1, "op": "ping"}), errno.EBADMSG, False),      # no id
    (msgpack.packb({"v": 1, "id": -1, "op": "ping"}), errno.EBADMSG, False),
    (msgpack.packb({"v": 9, "id": 1, "op": "ping"}), errno.EPROTO, True),
    (msgpack.packb({"v": 1, "id": 1, "op": "format_disk"}), errno.ENOSYS, True),
    (msgpack.packb({"v": 1, "id": 1, "op": "getattr", "args": {}}), errno.EINVAL, True),
    (msgpack.packb({"v": 1, "id": 1, "op": "getattr", "args": {"ino": "1"}}), errno.EINVAL, True),
    (msgpack.packb({"v": 1, "id": 1, "op": "getattr", "args": {"ino": True}}), errno.EINVAL, True),
    (msgpack.packb({"v": 1, "id": 1, "op": "getattr", "args": {"ino": 1 << 64 - 1, "x": 1}}),
     errno.EINVAL, True),
    (msgpack.packb({"v": 1, "id": 1, "op": "read", "args": []}), errno.EINVAL, True),
    (encode_request(3, "lookup", {"parent": 1, "name": b"x" * 5000}), errno.EINVAL, True),
    (encode_request(3, "import_region", {"descriptor": b"", "address": 0, "length": 1}),
     errno.EINVAL, True),
])
def test_malformed_requests_are_named(frame, err, has_id):
    with pytest.raises(ProtocolError) as e:
        decode_request(frame)
    assert e.value.errno == err
    assert (e.value.request_id is not None) == has_id


def test_truncated_requests_never_decode_as_something_else():
    frame = encode_request(9, "write", {"fh": 1, "offset": 0, "length": 10, "region": 1,
                                        "region_offset": 0})
    for cut in range(len(frame)):
        with pytest.raises(ProtocolError):
            decode_request(frame[:cut])


def test_oversized_message_is_refused_before_decoding():
    frame = encode_request(1, "ping", {}) + b"\0" * 70000
    with pytest.raises(ProtocolError) as e:
        decode_request(frame, max_bytes=65536)
    assert e.value.errno == errno.EMSGSIZE


@settings(max_examples=800, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_only_raise_protocol_error(frame):
    try:
        decode_request(frame)
    except ProtocolError:
        pass


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats()
    | st.text(max_size=20) | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.text(max_size=10) | st.integers(), children, max_size=5),
    max_leaves=20)


def _packable(value) -> bytes | None:
    try:
        return msgpack.packb(value, use_bin_type=True)
    except (OverflowError, ValueError, TypeError):
        return None


@settings(max_examples=800, deadline=None)
@given(st.sampled_from(sorted(protocol.OPS)), st.dictionaries(
    st.sampled_from(["parent", "name", "ino", "fh", "offset", "length", "region", "flags",
                     "versions", "path", "mode", "size", "zzz"]), msgpack_values, max_size=6),
    st.one_of(st.integers(-5, 1 << 65), msgpack_values))
def test_structured_garbage_only_raises_protocol_error(op, args, rid):
    frame = _packable({"v": 1, "id": rid, "op": op, "args": args})
    if frame is None:
        return
    try:
        req = decode_request(frame)
    except ProtocolError:
        return
    required, optional = protocol.OPS[op]
    assert set(required) <= set(req.args) <= set(required) | set(optional)
