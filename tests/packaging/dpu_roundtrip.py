"""Run inside the arm64 container with Debian's python3 and the installed bluecache-dpu: stores
a 32 MiB block through bluecached's protocol as hostd would (a memfd region, tmp + rename),
or checks it. Prints one line; exits non-zero on any mismatch.

    python3 dpu_roundtrip.py put|check
"""

import hashlib
import os
import sys

from bluecached.namespace import ROOT_INO
from bluecached.wire.client import RegionChannel, SharedRegion, SyncClient

STATE = "/var/lib/bluecache"
BLOCK = 32 << 20
NAME = b"block.bin"


def pattern() -> bytes:
    seed = hashlib.sha256(b"bluecache-dpu").digest()
    return (seed * (BLOCK // len(seed) + 1))[:BLOCK]


def main(mode: str) -> int:
    client = SyncClient(f"ipc://{STATE}/control.sock", client_name="dpu-roundtrip")
    channel = RegionChannel(f"{STATE}/dma.sock")
    shm = SharedRegion(BLOCK)
    region = channel.register(shm)
    data = pattern()
    if mode == "put":
        opened = client.call("create", parent=ROOT_INO, name=NAME + b".tmp", mode=0o644,
                             uid=0, gid=0, flags=os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        shm.view[:] = data
        client.call("write", fh=opened["fh"], offset=0, length=BLOCK, region=region,
                    region_offset=0)
        client.call("rename", parent=ROOT_INO, name=NAME + b".tmp", new_parent=ROOT_INO,
                    new_name=NAME)
        client.call("release", fh=opened["fh"])
    ino = client.call("lookup", parent=ROOT_INO, name=NAME)["ino"]
    opened = client.call("open", ino=ino, flags=os.O_RDONLY)
    shm.view[:] = bytes(BLOCK)
    n = client.call("read", fh=opened["fh"], offset=0, length=BLOCK, region=region,
                    region_offset=0)["length"]
    client.call("release", fh=opened["fh"])
    same = n == BLOCK and shm.view[:BLOCK] == data
    print(f"{mode}: {n} bytes read back, {'identical' if same else 'DIFFERENT'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
