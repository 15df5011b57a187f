"""KV events: what the cache holds, published as vLLM publishes its own KV events.

The routers that place requests by cached prefix (llm-d's KV-cache indexer, Dynamo's KV router
through its ZMQ relay) learn what a tier holds from vLLM's KV events. bluecache speaks the same
wire format, so they subscribe to it unchanged (docs/operations.md, "KV events"):

- a ZMQ PUB socket sends each batch as three frames: topic, an 8-byte big-endian sequence
  number (0, 1, 2 ... from the daemon's start), and the msgpack payload;
- the payload is a `KVEventBatch`, the array [ts, events, data_parallel_rank] (rank 0);
- each event is a map tagged under "type", as vLLM 0.33's msgspec structs encode them:
  `BlockStored` {block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name, group_idx}, `BlockRemoved` {block_hashes, medium, group_idx}, `AllBlocksCleared`;
- an optional ROUTER socket answers a replay request [empty, start sequence (8 bytes)] with
  every batch still buffered from that sequence on, as [empty, topic, sequence, payload], then
  [empty, b"", -1 (8 bytes, signed), b""], as vLLM 0.33's ZmqEventPublisher does.

BlockRemoved and AllBlocksCleared carry one key more, "reason" (evicted from dram, checksum
mismatch, deleted ...): a key vLLM's decoders, llm-d's and Dynamo's ignore, since each of them
skips map keys it does not know.

Which files are blocks: the names the POSIX connectors write, the same layout in vLLM's FS tier
(`vllm/v1/kv_offload/file_mapper.py`) and in the llm-d FS backend (its `file_mapper.py`):
`<model>_<12 hex>_r<rank>/<3 hex>/<2 hex>_g<group>/<hash hex>.bin`, the two directory levels
being the hash's first five hex digits. The hash in the name is the block hash vLLM keys the
block by (the last block of the file's chunk); it is published as vLLM publishes hashes by
default (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`): its low 64 bits, big-endian, as an unsigned
integer, or as the raw bytes (`kv_events.block_hash: bytes`). Any other name publishes nothing.

When: `BlockStored` once a block is readable under its name (the rename of the writer's
temporary onto it: every byte written before the rename is stored by then); `BlockRemoved` when
its name goes (evicted, deleted, found corrupt, collected, replaced by a rename away);
`AllBlocksCleared` at the daemon's start, followed by a `BlockStored` of every block the
rebuilt index holds, so a subscriber's picture is right after a restart of the cache.

Publishing never waits: the hooks only append to a bounded queue (full: the event is dropped
and counted); one task encodes and hands batches to the sockets' owner tasks (SocketPump: one
task per zmq socket); a PUB socket drops what a slow subscriber cannot take (its high-water
mark), and so does the ROUTER for a replay a client does not read.
"""

from __future__ import annotations

import logging
import re
import socket
import time
from collections import deque
from dataclasses import dataclass

import msgpack
import trio
import zmq

from .wire.zmqpump import SocketPump

log = logging.getLogger("bluecached.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
EVENTS_PER_BATCH = 512      # events in one KVEventBatch at most
HASHES_PER_EVENT = 256      # block hashes in one BlockStored of the start-up inventory
INVENTORY_STEP = 2048       # inodes looked at between two checkpoints of the inventory

# <model>_<12 hex>_r<rank>/<hhh>/<hh>_g<group>/<hash>.bin, at the end of a path; a hash is
# 8 to 64 bytes (xxhash 128: 16, sha256: 32).
_BLOCK = re.compile(
    rb"/(?P<model>[^/]+)_[0-9a-f]{12}_r(?P<rank>[0-9]{1,6})"
    rb"/(?P<h3>[0-9a-f]{3})/(?P<h2>[0-9a-f]{2})_g(?P<group>[0-9]{1,6})"
    rb"/(?P<hash>(?:[0-9a-f]{2}){8,64})\.bin\Z")

TOPIC_FIELDS = ("host", "model", "medium")


@dataclass(frozen=True, slots=True)
class Block:
    model: str      # as in the directory name: the connector replaced each "/" with "_"
    rank: int
    group: int
    digest: bytes   # the block hash, as the file name spells it


def parse_block_path(path: bytes) -> Block | None:
    """The block a path names, or None for any other file."""
    m = _BLOCK.search(path)
    if m is None:
        return None
    digest = m["hash"]
    if digest[:3] != m["h3"] or digest[3:5] != m["h2"]:
        return None
    return Block(m["model"].decode("utf-8", "replace"), int(m["rank"]), int(m["group"]),
                 bytes.fromhex(digest.decode()))


def external_hash(digest: bytes, form: str) -> int | bytes:
    """A block hash as vLLM publishes it: the low 64 bits (big-endian) or the bytes."""
    return int.from_bytes(digest[-8:], "big") if form == "int" else digest


class KvEvents:
    """The KV-event publisher of one daemon. Hooks (`stored`, `removed`, `cleared`) are called
    on the trio thread and never block; `run` is the task that publishes."""

    def __init__(self, cfg, host: str | None = None, clock=time.time):
        self.cfg = cfg
        self.host = host or socket.gethostname()
        self.clock = clock
        self.seq = 0
        self._pending: deque = deque()       # (topic, event)
        self._wake = trio.Event()
        self._buffer: deque = deque(maxlen=cfg.buffer_steps)   # (seq, topic, payload)
        self._inventory = None               # the namespace to announce, then None
        self.endpoints: dict[str, str] = {}
        self.pub: zmq.Socket | None = None
        self.replay: zmq.Socket | None = None
        self._pub_pump: SocketPump | None = None
        self._replay_pump: SocketPump | None = None
        self.stats = {"batches": 0, "events": 0, "dropped": 0, "replays": 0}
        self._warned_drop = False

    # -- sockets ---------------------------------------------------------------------------

    def open(self, ctx: zmq.Context) -> None:
        """Binds or connects the PUB socket as vLLM's publisher does (binds an endpoint with
        a wildcard host or an ipc:// one, connects to any other: a central subscriber such as
        llm-d's indexer with its own zmqEndpoint binds, and publishers connect to it), and
        binds the replay socket. Raises zmq.ZMQError with the endpoint in `endpoint`."""
        cfg = self.cfg
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, cfg.hwm)
        _bind(self.pub, cfg.endpoint, connect=not binds(cfg.endpoint))
        self.endpoints["endpoint"] = cfg.endpoint
        if cfg.replay_endpoint:
            self.replay = ctx.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.LINGER, 0)
            self.replay.setsockopt(zmq.SNDHWM, 2 * (cfg.buffer_steps + 1))
            _bind(self.replay, cfg.replay_endpoint)
            self.endpoints["replay_endpoint"] = cfg.replay_endpoint

    def close(self) -> None:
        for sock in (self.pub, self.replay):
            if sock is not None:
                sock.close(linger=0)
        self.pub = self.replay = None

    # -- hooks (trio thread, never block) ---------------------------------------------------

    def topic_for(self, model: str) -> str:
        return self.cfg.topic.format(host=self.host, model=model, medium=self.cfg.medium)

    def _queue(self, topic: str, event: dict) -> None:
        if len(self._pending) >= self.cfg.hwm:
            self.stats["dropped"] += 1
            if not self._warned_drop:
                self._warned_drop = True
                log.warning("KV events: %d events wait to be published; dropping new ones "
                            "(subscribers' view of the cache is incomplete until a restart)",
                            len(self._pending))
            return
        self._pending.append((topic, event))
        self._wake.set()

    def stored(self, path: bytes) -> None:
        """A file became readable under `path` (a rename onto its final name)."""
        block = parse_block_path(path)
        if block is not None:
            self._queue(self.topic_for(block.model), self._stored_event(block.group, [
                external_hash(block.digest, self.cfg.block_hash)]))

    def removed(self, path: bytes, reason: str) -> None:
        """The name `path` went (eviction, unlink, checksum mismatch, a rename away ...)."""
        block = parse_block_path(path)
        if block is not None:
            self._queue(self.topic_for(block.model), {
                "type": "BlockRemoved",
                "block_hashes": [external_hash(block.digest, self.cfg.block_hash)],
                "medium": self.cfg.medium, "group_idx": block.group, "reason": reason})

    def cleared(self, reason: str, model: str = "") -> None:
        """Nothing held before is held now (on the topic of `model`)."""
        self._queue(self.topic_for(model), self._cleared_event(reason))

    @staticmethod
    def _cleared_event(reason: str) -> dict:
        return {"type": "AllBlocksCleared", "reason": reason}

    def announce_held(self, ns) -> None:
        """At start: AllBlocksCleared, then a BlockStored of every block in `ns`, published
        before any later event (so the last word on each block is the right one)."""
        self._inventory = ns
        self._wake.set()

    def _stored_event(self, group: int, hashes: list) -> dict:
        return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
                "token_ids": [], "block_size": 0, "lora_id": None,
                "medium": self.cfg.medium, "lora_name": None, "group_idx": group}

    # -- the task --------------------------------------------------------------------------

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._pub_pump = SocketPump(self.pub)
            nursery.start_soon(self._pub_pump.run)
            if self.replay is not None:
                self._replay_pump = SocketPump(self.replay)
                nursery.start_soon(self._replay_pump.run, self._replay_request)
            task_status.started()
            if self._inventory is not None:
                await self._announce(self._inventory)
                self._inventory = None
            while True:
                await self._wake.wait()
                self._wake = trio.Event()
                await trio.lowlevel.checkpoint()   # what this tick adds goes in one batch
                self.flush()

    def flush(self) -> None:
        """Publishes every queued event: one batch per topic (of EVENTS_PER_BATCH at most)."""
        by_topic: dict[str, list] = {}
        while self._pending:
            topic, event = self._pending.popleft()
            by_topic.setdefault(topic, []).append(event)
        for topic, events in by_topic.items():
            for i in range(0, len(events), EVENTS_PER_BATCH):
                self._send(topic, events[i:i + EVENTS_PER_BATCH])

    def _send(self, topic: str, events: list) -> None:
        payload = msgpack.packb([self.clock(), events, 0], use_bin_type=True)
        seq = self.seq
        self.seq += 1
        topic_bytes = topic.encode()
        self._buffer.append((seq, topic_bytes, payload))
        self.stats["batches"] += 1
        self.stats["events"] += len(events)
        if self._pub_pump is not None:
            self._pub_pump.send([topic_bytes, seq.to_bytes(8, "big"), payload])

    async def _announce(self, ns) -> None:
        """AllBlocksCleared on each topic before the first BlockStored on it (and on the
        topic of no model), then the held blocks, HASHES_PER_EVENT to an event."""
        reason = "bluecached started: the blocks it holds follow"
        cleared = {self.topic_for("")}
        self._send(self.topic_for(""), [self._cleared_event(reason)])
        form = self.cfg.block_hash
        groups: dict[tuple[str, int], list] = {}
        nodes = list(ns.inodes.values())
        for start in range(0, len(nodes), INVENTORY_STEP):
            for node in nodes[start:start + INVENTORY_STEP]:
                if node.obj is None or ns.inodes.get(node.ino) is not node:
                    continue
                for parent, name in node.names():
                    block = parse_block_path(ns.path_of(ns.inodes[parent]) + b"/" + name)
                    if block is None:
                        continue
                    topic = self.topic_for(block.model)
                    if topic not in cleared:
                        cleared.add(topic)
                        self._send(topic, [self._cleared_event(reason)])
                    hashes = groups.setdefault((topic, block.group), [])
                    hashes.append(external_hash(block.digest, form))
                    if len(hashes) >= HASHES_PER_EVENT:
                        del groups[topic, block.group]
                        self._send(topic, [self._stored_event(block.group, hashes)])
            await trio.lowlevel.checkpoint()
        for (topic, group), hashes in groups.items():
            self._send(topic, [self._stored_event(group, hashes)])

    def _replay_request(self, frames: list) -> None:
        if len(frames) != 3 or len(frames[2]) != 8:
            log.debug("KV events: a replay request of %d frames ignored", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        self.stats["replays"] += 1
        for seq, topic, payload in self._buffer:
            if seq >= first:
                self._replay_pump.send([client, b"", topic, seq.to_bytes(8, "big"), payload])
        self._replay_pump.send([client, b"", b"", END_SEQ, b""])


def binds(endpoint: str) -> bool:
    """Whether the PUB socket binds `endpoint` (vLLM's rule) rather than connects to it."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith("ipc://")


def _bind(sock: zmq.Socket, endpoint: str, connect: bool = False) -> None:
    try:
        if connect:
            sock.connect(endpoint)
        else:
            sock.bind(endpoint)
    except zmq.ZMQError as e:
        sock.close(linger=0)
        e.endpoint = endpoint
        raise
