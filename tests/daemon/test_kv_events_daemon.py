"""KV events from a real bluecached: the daemon binds the sockets, the store's hooks feed them,
a restart announces what the rebuilt index holds; decoded with vLLM 0.33's own classes."""

import hashlib
import socket
import subprocess
import sys

import msgpack
import pytest
import yaml
import zmq
from connector_code import vllm_kv_events

from bluecached.kv_events import END_SEQ
from support import FileClient, free_port

MODEL = "Qwen_Qwen3-0.6B"
BASE = f"{MODEL}_a1b2c3d4e5f6"


def block(h: str) -> str:
    return f"/{BASE}_r0/{h[:3]}/{h[3:5]}_g0/{h}.bin"


def replay(endpoint: str, start: int = 0) -> list[tuple[str, int, bytes]]:
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert dealer.poll(30_000), "no replay answer"
            frames = dealer.recv_multipart()
            if frames[2] == END_SEQ:
                return out
            out.append((frames[1].decode(), int.from_bytes(frames[2], "big"), frames[3]))
    finally:
        dealer.close()


def test_the_daemon_publishes_what_it_holds_and_announces_it_after_a_restart(tmp_path,
                                                                             daemon):
    import msgspec
    vllm = vllm_kv_events()
    decoder = msgspec.msgpack.Decoder(vllm.KVEventBatch)
    replay_endpoint = f"ipc://{tmp_path}/kv.replay"
    d = daemon(**{"kv_events.enabled": True, "kv_events.endpoint": f"ipc://{tmp_path}/kv.pub",
                  "kv_events.replay_endpoint": replay_endpoint}).start()
    h1, h2 = (hashlib.sha256(s).hexdigest() for s in (b"one", b"two"))
    files = FileClient(d)
    try:   # llm-d's order: write the temporary, rename it, then close it
        files.put(block(h1), b"1" * 65536, tmp_suffix="_7f3e.tmp")
        files.put(block(h2), b"2" * 65536, tmp_suffix="_7f3e.tmp")
        files.put(f"/{BASE}/config.json", b"{}")
        stats = files.client.call("stats")["kv_events"]
    finally:
        files.close()
    host = socket.gethostname()

    def events(start=0):
        out = []
        for topic, _, payload in replay(replay_endpoint, start):
            batch = decoder.decode(payload)
            out += [(topic, e, raw) for e, raw in zip(batch.events, msgpack.unpackb(payload)[1],
                                                       strict=True)]
        return out

    got = events()
    assert isinstance(got[0][1], vllm.AllBlocksCleared)   # the start: nothing held yet
    stored = [(t, e.block_hashes, e.medium) for t, e, _ in got[1:]]
    assert stored == [(f"kv@{host}@{MODEL}", [int(h[-16:], 16)], "STORAGE") for h in (h1, h2)]
    assert stats["events"] >= 3 and stats["dropped"] == 0

    d.stop()
    d.start()
    got = events()
    assert [type(e).__name__ for _, e, _ in got] == [
        "AllBlocksCleared", "AllBlocksCleared", "BlockStored"]
    assert got[0][2]["reason"].startswith("bluecached started")
    assert got[1][0] == f"kv@{host}@{MODEL}"
    assert sorted(got[2][1].block_hashes) == sorted(int(h[-16:], 16) for h in (h1, h2))


def test_a_kv_events_endpoint_in_use_stops_the_start_with_one_line(tmp_path):
    port = free_port()
    taken = socket.socket()
    taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    taken.bind(("", port))
    taken.listen()
    cfg = {"state_dir": str(tmp_path / "state"),
           "tiers": {"dram": {"size": "64MiB", "prefault": 0}, "nvme": {"size": 0}},
           "metrics": {"listen": ""},
           "kv_events": {"enabled": True, "endpoint": f"tcp://*:{port}",
                         "replay_endpoint": ""}}
    path = tmp_path / "bluecached.yaml"
    path.write_text(yaml.safe_dump(cfg))
    try:
        r = subprocess.run([sys.executable, "-m", "bluecached.daemon", "--config", str(path)],
                           capture_output=True, text=True, timeout=60)
    finally:
        taken.close()
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert f"kv_events: cannot listen on tcp://*:{port}: Address already in use" \
        in r.stderr


@pytest.mark.parametrize("topic", ["kv@{host}@{model}", "kv@{medium}@fixed/model"])
def test_the_shipped_topics_load(topic):
    from bluecached import config
    assert config.load_config(None, assignments=[f"kv_events.topic={topic}"]).kv_events.topic \
        == topic
