"""KV events (bluecached/kv_events.py): what the cache holds, published in vLLM's KV event
format, read here by a ZMQ subscriber that decodes every batch with vLLM 0.33's own event
classes (tests/connector_code.py loads them from vLLM's wheel)."""

import errno
import hashlib
import os

import msgpack
import pytest
import trio
import zmq
from connector_code import vllm_kv_events

from bluecached import config
from bluecached.kv_events import END_SEQ, KvEvents, parse_block_path
from bluecached.namespace import ROOT_INO, FsError
from support import MiB, pattern, run

MODEL = "meta-llama_Llama-3.1-8B"      # meta-llama/Llama-3.1-8B as the connectors write it
BASE = f"{MODEL}_0123456789ab"         # <model>_<sha256-12hex>


def digest(seed: str) -> str:
    return hashlib.sha256(seed.encode()).hexdigest()


def block(h: str, group: int = 0, rank: int = 0) -> str:
    """Where vLLM's FS tier and the llm-d FS backend put the block of hash `h`."""
    return f"/{BASE}_r{rank}/{h[:3]}/{h[3:5]}_g{group}/{h}.bin"


def low64(h: str) -> int:
    return int(h[-16:], 16)


def kv_config(tmp_path, *settings):
    return config.load_config(None, assignments=[
        "kv_events.enabled=true", f"kv_events.endpoint=ipc://{tmp_path}/kv.pub",
        f"kv_events.replay_endpoint=ipc://{tmp_path}/kv.replay", *settings]).kv_events


class Subscriber:
    """A subscriber as llm-d's indexer or Dynamo's relay runs one: SUB on the endpoint, and a
    DEALER for replay requests."""

    def __init__(self, ctx: zmq.Context, cfg, vllm):
        import msgspec
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(cfg.endpoint)
        self.cfg = cfg
        self.ctx = ctx
        self.vllm = vllm
        self.decoder = msgspec.msgpack.Decoder(vllm.KVEventBatch)

    def decode(self, payload: bytes):
        """(vLLM's KVEventBatch, the raw msgpack): vLLM's classes drop the reason, the raw
        keeps it."""
        return self.decoder.decode(payload), msgpack.unpackb(payload)

    def _recv(self, timeout: float):
        return self.sub.recv_multipart() if self.sub.poll(int(timeout * 1000)) else None

    async def recv(self, timeout: float = 20):
        frames = await trio.to_thread.run_sync(self._recv, timeout)
        assert frames is not None, "no KV event batch arrived"
        topic, seq, payload = frames
        return topic.decode(), int.from_bytes(seq, "big"), *self.decode(payload)

    async def join(self, kv: KvEvents) -> None:
        """Waits until the subscription reached the publisher (ZMQ's slow joiner): probes
        until one arrives, then drains what is left."""
        for _ in range(400):
            kv.cleared("probe")
            await trio.lowlevel.checkpoint()
            if await trio.to_thread.run_sync(self._recv, 0.05) is not None:
                break
        else:
            raise AssertionError("the subscription never reached the publisher")
        await trio.lowlevel.checkpoint()
        while await trio.to_thread.run_sync(self._recv, 0.05) is not None:
            pass

    def _replay(self, start: int, timeout: float):
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.cfg.replay_endpoint)
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            out = []
            while True:
                assert dealer.poll(int(timeout * 1000)), "the replay did not end"
                frames = dealer.recv_multipart()
                assert frames[0] == b""
                if frames[2] == END_SEQ:
                    assert frames[1:] == [b"", END_SEQ, b""]
                    return out
                out.append((frames[1].decode(), int.from_bytes(frames[2], "big"), frames[3]))
        finally:
            dealer.close()

    async def replay(self, start: int, timeout: float = 20):
        return await trio.to_thread.run_sync(self._replay, start, timeout)

    def close(self):
        self.sub.close()


@pytest.fixture
def vllm():
    return vllm_kv_events()


@pytest.fixture
def kv_world(tmp_path, harness, vllm):
    """(harness, publisher, ctx) with the publisher's sockets bound and the store's hook set."""
    h = harness()
    cfg = kv_config(tmp_path)
    ctx = zmq.Context()
    kv = KvEvents(cfg, host="node7")
    kv.open(ctx)
    h.store.kv_events = kv
    yield h, kv, ctx
    kv.close()
    ctx.term()


async def write_block(h, path: str, data: bytes) -> None:
    """The vLLM FS tier's store: a temporary beside the final name, then os.replace."""
    await h.put(path + "_3f9a.tmp", data)
    src = h.store.ns.resolve(os.path.dirname(path))
    h.store.rename(src.ino, os.path.basename(path).encode() + b"_3f9a.tmp", src.ino,
                   os.path.basename(path).encode())


def test_the_connectors_block_names_are_parsed_and_nothing_else():
    h = digest("a")
    b = parse_block_path(block(h, group=2, rank=3).encode())
    assert (b.model, b.rank, b.group, b.digest) == (MODEL, 3, 2, bytes.fromhex(h))
    xx = h[:32]   # an xxhash-128 name
    assert parse_block_path(f"/root/{block(xx)}".encode()).digest == bytes.fromhex(xx)
    for other in (block(h) + "_3f9a.tmp",               # a writer's temporary
                  f"/{BASE}/config.json",                 # the run's config
                  block(h).replace(f"/{h[:3]}/", "/fff/"),   # not the hash's directories
                  block(h).replace(f"/{h[3:5]}_g", "/zz_g"),
                  block(h.upper()),                       # the connectors write lower case
                  block(h).replace("_r0/", "/"),          # no rank directory
                  block(h[:10]),                          # too short for a block hash
                  f"/{h[:3]}/{h[3:5]}_g0/{h}.bin"):       # no model directory
        assert parse_block_path(other.encode()) is None, other


def test_stored_after_the_rename_removed_with_the_reason(kv_world, vllm):
    h, kv, ctx = kv_world
    names = {n: digest(n) for n in ("deleted", "evicted", "corrupt")}

    async def main():
        sub = Subscriber(ctx, kv.cfg, vllm)
        async with trio.open_nursery() as nursery:
            await nursery.start(kv.run)
            await sub.join(kv)
            for n, d in names.items():
                await h.put(block(d) + "_3f9a.tmp", pattern(n, 2 * MiB))
            await h.put(f"/{BASE}/config.json", b"{}")   # not a block: no event
            for d in names.values():
                path = block(d).encode()
                parent = h.store.ns.resolve(os.path.dirname(path)).ino
                h.store.rename(parent, os.path.basename(path) + b"_3f9a.tmp", parent,
                               os.path.basename(path))
                topic, _, batch, raw = await sub.recv()
                assert topic == f"kv@node7@{MODEL}"
                [event] = batch.events
                assert isinstance(event, vllm.BlockStored)
                assert event.block_hashes == [low64(d)]
                assert (event.medium, event.group_idx, event.block_size) == ("STORAGE", 0, 0)
                assert event.parent_block_hash is None and event.token_ids == []

            d = names["deleted"]
            parent = h.store.ns.resolve(os.path.dirname(block(d))).ino
            h.store.unlink(parent, f"{d}.bin".encode())
            assert await removed(sub) == ([low64(d)], "deleted")

            assert h.store.evict(block(names["evicted"]))["removed"] == 1
            assert await removed(sub) == ([low64(names["evicted"])], "evicted by operator")

            d = names["corrupt"]
            await h.settle()
            node = h.store.ns.resolve(block(d))
            h.store.tiers.drop_dram(node)
            flip_a_byte(h, node)
            handle = await h.store.open(node.ino, os.O_RDONLY)
            with pytest.raises(FsError) as e:
                await h.read(handle.fh, 0, 2 * MiB)
            assert e.value.errno == errno.EIO
            h.store.release(handle.fh)
            assert await removed(sub) == ([low64(d)], "checksum mismatch")
            nursery.cancel_scope.cancel()
        sub.close()

    async def removed(sub):
        _, _, batch, raw = await sub.recv()
        [event] = batch.events
        assert isinstance(event, vllm.BlockRemoved)
        assert (event.medium, event.group_idx) == ("STORAGE", 0)
        [raw_event] = raw[1]
        return event.block_hashes, raw_event["reason"]

    run(main)


def flip_a_byte(h, node) -> None:
    extent = node.obj.extent
    seg = h.store.tiers.nvme
    with open(seg._seg_path(extent.offset // seg.segment_size), "r+b") as f:
        f.seek(extent.offset % seg.segment_size + 77)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x40]))


def test_eviction_by_the_cache_itself_is_published(tmp_path, harness, vllm):
    h = harness(dram=8 * MiB, nvme=0, marks=(0.9, 0.5))
    kv = KvEvents(kv_config(tmp_path, "kv_events.replay_endpoint=''"), host="n")
    ctx = zmq.Context()
    kv.open(ctx)
    h.store.kv_events = kv
    hashes = [digest(str(i)) for i in range(6)]

    async def main():
        for d in hashes:   # 12 MiB through an 8 MiB DRAM tier with no NVMe behind it
            await write_block(h, block(d), pattern(d, 2 * MiB))
            h.store.tiers.evict_to_watermarks()

    h.serve(main)
    kv.flush()
    seen = [e for _, _, payload in kv._buffer for e in msgpack.unpackb(payload)[1]]
    removed = [(e["block_hashes"], e["reason"]) for e in seen if e["type"] == "BlockRemoved"]
    assert removed and all(r == "evicted from dram" for _, r in removed)
    stored = [e["block_hashes"][0] for e in seen if e["type"] == "BlockStored"]
    assert stored == [low64(d) for d in hashes]
    kv.close()
    ctx.term()


def test_missed_sequence_numbers_are_replayed_from_a_bounded_buffer(tmp_path, harness, vllm):
    h = harness()
    cfg = kv_config(tmp_path, "kv_events.buffer_steps=3")
    ctx = zmq.Context()
    kv = KvEvents(cfg, host="n")
    kv.open(ctx)
    h.store.kv_events = kv
    hashes = [digest(f"r{i}") for i in range(5)]

    async def main():
        sub = Subscriber(ctx, cfg, vllm)   # never reads: everything comes by replay
        async with trio.open_nursery() as nursery:
            await nursery.start(kv.run)
            for d in hashes:
                await write_block(h, block(d), b"x" * 4096)
                await trio.sleep(0.01)   # one batch each
            assert kv.seq == 5
            got = await sub.replay(3)
            assert [seq for _, seq, _ in got] == [3, 4]
            got = await sub.replay(0)   # 0 and 1 are gone: the buffer keeps 3 batches
            assert [seq for _, seq, _ in got] == [2, 3, 4]
            for (topic, _, payload), d in zip(got, hashes[2:], strict=True):
                batch, _ = sub.decode(payload)
                assert topic == f"kv@n@{MODEL}"
                assert batch.events[0].block_hashes == [low64(d)]
            nursery.cancel_scope.cancel()
        sub.close()

    run(main)
    kv.close()
    ctx.term()


def test_a_slow_or_absent_subscriber_never_holds_up_the_store(tmp_path, harness):
    h = harness()
    cfg = kv_config(tmp_path, "kv_events.hwm=4", "kv_events.replay_endpoint=''")
    ctx = zmq.Context()
    kv = KvEvents(cfg, host="n")
    kv.open(ctx)
    h.store.kv_events = kv
    slow = ctx.socket(zmq.SUB)   # subscribes, never reads, takes one message at a time
    slow.setsockopt(zmq.RCVHWM, 1)
    slow.setsockopt(zmq.SUBSCRIBE, b"")
    slow.setsockopt(zmq.LINGER, 0)
    slow.connect(cfg.endpoint)

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(kv.run)
            with trio.fail_after(120):   # a guard against a hang, not a timing target
                for i in range(150):   # stored, then deleted: 300 events
                    d = digest(f"s{i}")
                    await write_block(h, block(d), b"y" * 4096)
                    parent = h.store.ns.resolve(os.path.dirname(block(d))).ino
                    h.store.unlink(parent, f"{d}.bin".encode())
                    if i % 3 == 0:
                        await trio.lowlevel.checkpoint()
                await trio.sleep(0.05)
            nursery.cancel_scope.cancel()

    run(main)
    assert kv.stats["batches"] > 4   # more than the subscriber's queue could hold
    assert kv.stats["events"] + kv.stats["dropped"] == 300
    # Without the task (no loop turn between hooks), the queue keeps hwm events, drops the rest.
    for i in range(10):
        kv.stored(block(digest(f"q{i}")).encode())
    assert len(kv._pending) == 4 and kv.stats["dropped"] >= 6
    slow.close()
    kv.close()
    ctx.term()


def test_a_restart_publishes_all_cleared_then_every_held_block(tmp_path, harness, vllm):
    h = harness()
    hashes = [digest(f"h{i}") for i in range(5)]

    async def write():
        for d in hashes:
            await write_block(h, block(d, group=1), b"z" * 8192)
        await h.put("/elsewhere/not-a-block.bin", b"z")

    run(write)
    h.reopen()
    cfg = kv_config(tmp_path)
    ctx = zmq.Context()
    kv = KvEvents(cfg, host="n")
    kv.open(ctx)

    async def main():
        sub = Subscriber(ctx, cfg, vllm)
        async with trio.open_nursery() as nursery:
            kv.announce_held(h.store.ns)
            await nursery.start(kv.run)
            got = await sub.replay(0)
            nursery.cancel_scope.cancel()
        sub.close()
        return got

    got = run(main)
    decoded = [(topic, Subscriber.decode(sub_decoder(vllm), p)) for topic, _, p in got]
    events = [(topic, e) for topic, (batch, _) in decoded for e in batch.events]
    assert isinstance(events[0][1], vllm.AllBlocksCleared) and events[0][0] == "kv@n@"
    assert isinstance(events[1][1], vllm.AllBlocksCleared) and events[1][0] == f"kv@n@{MODEL}"
    stored = [e for _, e in events[2:]]
    assert all(isinstance(e, vllm.BlockStored) and e.group_idx == 1 for e in stored)
    assert sorted(x for e in stored for x in e.block_hashes) == sorted(map(low64, hashes))
    assert decoded[0][1][1][1][0]["reason"].startswith("bluecached started")
    kv.close()
    ctx.term()


def sub_decoder(vllm):
    """A Subscriber's decode() without its sockets."""
    import msgspec
    s = Subscriber.__new__(Subscriber)
    s.decoder = msgspec.msgpack.Decoder(vllm.KVEventBatch)
    return s


def test_bytes_hashes_and_a_fixed_topic(tmp_path, harness, vllm):
    h = harness()
    cfg = kv_config(tmp_path, "kv_events.block_hash=bytes",
                    "kv_events.topic=kv@{medium}@meta-llama/Llama-3.1-8B",
                    "kv_events.medium=SHARED_STORAGE")
    kv = KvEvents(cfg, host="n")
    h.store.kv_events = kv
    d = digest("bytes")
    run(write_block, h, block(d), b"b" * 4096)
    kv.flush()   # no sockets: batches are still numbered and kept for replay
    [(seq, topic, payload)] = list(kv._buffer)
    batch, _ = sub_decoder(vllm).decode(payload)
    assert (seq, topic) == (0, b"kv@SHARED_STORAGE@meta-llama/Llama-3.1-8B")
    assert batch.events[0].block_hashes == [bytes.fromhex(d)]
    assert batch.events[0].medium == "SHARED_STORAGE"


def test_a_rename_away_from_a_block_name_removes_it(kv_world):
    h, kv, _ = kv_world
    d = digest("moved")
    run(write_block, h, block(d), b"m" * 4096)
    parent = h.store.ns.resolve(os.path.dirname(block(d))).ino
    h.store.rename(parent, f"{d}.bin".encode(), ROOT_INO, b"kept.bin")
    kv.flush()
    events = [e for _, _, p in kv._buffer for e in msgpack.unpackb(p)[1]]
    assert [(e["type"], e.get("reason")) for e in events] == [
        ("BlockStored", None), ("BlockRemoved", "renamed")]


@pytest.mark.parametrize("setting, key", [
    ("kv_events.endpoint=tcp://nohost", "kv_events.endpoint"),
    ("kv_events.endpoint=ipc://relative", "kv_events.endpoint"),
    ("kv_events.replay_endpoint=ipc:///tmp/kv.pub", "kv_events.replay_endpoint"),
    ("kv_events.topic=kv@{pod}@{model}", "kv_events.topic"),
    ("kv_events.topic=kv@{0}", "kv_events.topic"),
    ("kv_events.medium=GPU TIER", "kv_events.medium"),
    ("kv_events.block_hash=hex", "kv_events.block_hash"),
    ("kv_events.buffer_steps=0", "kv_events.buffer_steps"),
    ("kv_events.enabled=maybe", "kv_events.enabled"),
])
def test_bad_kv_events_settings_are_refused_naming_the_key(setting, key):
    with pytest.raises(config.ConfigError) as e:
        config.load_config(None, assignments=["kv_events.endpoint=ipc:///tmp/kv.pub", setting])
    assert e.value.key == key, e.value


def test_kv_events_are_off_by_default():
    cfg = config.load_config(None).kv_events
    assert not cfg.enabled
    assert (cfg.medium, cfg.block_hash, cfg.topic) == ("STORAGE", "int", "kv@{host}@{model}")


def test_an_endpoint_without_a_wildcard_is_connected_to_as_vllm_does(tmp_path, harness, vllm):
    """llm-d's indexer with its own zmqEndpoint binds; publishers connect to it."""
    import msgspec
    h = harness()
    ctx = zmq.Context()
    indexer = ctx.socket(zmq.SUB)
    indexer.setsockopt(zmq.LINGER, 0)
    indexer.setsockopt(zmq.SUBSCRIBE, b"kv@")
    port = indexer.bind_to_random_port("tcp://127.0.0.1")
    cfg = kv_config(tmp_path, f"kv_events.endpoint=tcp://127.0.0.1:{port}")
    kv = KvEvents(cfg, host="n")
    kv.open(ctx)
    h.store.kv_events = kv
    d = digest("connected")
    decoder = msgspec.msgpack.Decoder(vllm.KVEventBatch)

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(kv.run)
            for _ in range(400):   # until the connection and the subscription are up
                kv.cleared("probe", model=MODEL)
                await trio.lowlevel.checkpoint()
                if await trio.to_thread.run_sync(indexer.poll, 50):
                    break
            while await trio.to_thread.run_sync(indexer.poll, 50):
                indexer.recv_multipart()
            await write_block(h, block(d), b"c" * 4096)
            assert await trio.to_thread.run_sync(indexer.poll, 20_000)
            topic, _, payload = indexer.recv_multipart()
            nursery.cancel_scope.cancel()
        return topic, decoder.decode(payload)

    topic, batch = run(main)
    assert topic == f"kv@n@{MODEL}".encode()
    assert batch.events[0].block_hashes == [low64(d)]
    indexer.close()
    kv.close()
    ctx.term()
