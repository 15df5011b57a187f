"""SIGKILL bluecached while 8 clients write 32 MiB objects; after a restart every visible object
holds exactly the bytes of one complete write under its name."""

import hashlib
import threading
import time

from support import FileClient, MiB, pattern

CLIENTS = 8
NAMES_PER_CLIENT = 3
SIZE = 32 * MiB


def content(client: int, name: int, version: int) -> bytes:
    return pattern(f"{client}/{name}/{version}", SIZE)


def test_sigkill_during_writes_leaves_only_complete_objects(daemon):
    d = daemon(allow_log=["index: "], **{"tiers.dram.size": "512MiB",
                                         "tiers.nvme.size": "2GiB"}).start()
    started: dict[str, set[str]] = {}       # final name -> sha256 of every version begun
    completed = [0]
    lock = threading.Lock()
    stop = threading.Event()

    def writer(c: int) -> None:
        fc = FileClient(d, region_size=8 * MiB)
        fc.client.timeout = 3
        version = 0
        try:
            while not stop.is_set():
                n = version % NAMES_PER_CLIENT
                path = f"/c{c}/blk{n}.bin"
                data = content(c, n, version)
                with lock:
                    started.setdefault(path, set()).add(hashlib.sha256(data).hexdigest())
                fc.put(path, data, tmp_suffix=f"_{version}.tmp")   # llm-d: tmp, rename, close
                with lock:
                    completed[0] += 1
                version += 1
        except OSError:
            pass            # the daemon died under us: expected
        finally:
            try:
                fc.close()
            except OSError:
                pass

    threads = [threading.Thread(target=writer, args=(c,)) for c in range(CLIENTS)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while completed[0] < 3 * CLIENTS and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)                 # let some writes be half done
    d.kill()
    stop.set()
    for t in threads:
        t.join(60)
    assert completed[0] >= 3 * CLIENTS

    d.start()
    fc = FileClient(d, region_size=8 * MiB)
    seen = 0
    for c in range(CLIENTS):
        try:
            entries = fc.client.call("ls", path=f"/c{c}")["entries"]
        except OSError:
            continue                # the directory itself is journaled; may be absent only
                                    # if the client never got to mkdir
        for e in entries:
            name = e["name"].decode()
            final = f"/c{c}/" + (name.split("_")[0] if name.endswith(".tmp") else name)
            data = fc.get(f"/c{c}/{name}")
            assert hashlib.sha256(data).hexdigest() in started[final], \
                f"/c{c}/{name}: {len(data)} bytes that no complete write produced"
            seen += 1
    fc.close()
    assert seen > 0, "nothing survived: write-behind never reached NVMe"
