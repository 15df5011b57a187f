"""Symlinks, hard links, FIFOs, sockets and device nodes through the kernel, as on tmpfs: tar,
cp -a and rsync -aH copy trees holding them onto the mount and back; they outlive restarts of
bluecached; a listing shows `.` and `..` to those who ask for them (ls -a) and to nobody
else."""

import errno
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import threading
import time

import pytest

from support import MiB, force_unmount, pattern

SYMLINK_MAX = 4095   # PATH_MAX with its NUL


def restart(stack, sig: int) -> None:
    """hostd stopped and bluecached stopped by `sig` (SIGTERM: snapshot; SIGKILL: journal
    replay), both started again: a fresh kernel mount, nothing cached from before."""
    stack.hostd.stop(timeout=30)
    force_unmount(stack.mnt)
    stack.daemon.stop(sig, timeout=60)
    stack.daemon.start()
    stack.hostd.start()


def make_tree(top: str, with_socket: bool = True) -> None:
    """A tree of every kind a tar or a copy of a home directory meets (tar skips sockets)."""
    os.makedirs(os.path.join(top, "d/sub"))
    with open(os.path.join(top, "d/file.bin"), "wb") as f:
        f.write(pattern("file", MiB + 17))
    with open(os.path.join(top, "d/sub/small"), "wb") as f:
        f.write(b"small\n")
    os.symlink("file.bin", os.path.join(top, "d/rel"))
    os.symlink("../d/sub", os.path.join(top, "d/dirlink"))
    os.symlink("/nowhere/at/all", os.path.join(top, "dangling"))
    os.symlink("s" * SYMLINK_MAX, os.path.join(top, "d/longest"))
    os.symlink("ünïcode \xff".encode("utf-8", "surrogateescape"), os.path.join(top, "d/bytes"))
    os.link(os.path.join(top, "d/file.bin"), os.path.join(top, "d/sub/hard"))
    os.link(os.path.join(top, "d/file.bin"), os.path.join(top, "hard-at-top"))
    os.link(os.path.join(top, "d/rel"), os.path.join(top, "d/sub/rel-hard"))   # a symlink's
    os.mkfifo(os.path.join(top, "d/fifo"), 0o640)
    os.mknod(os.path.join(top, "d/tty"), 0o620 | stat.S_IFCHR, os.makedev(4, 64))
    os.mknod(os.path.join(top, "blk"), 0o660 | stat.S_IFBLK, os.makedev(7, 3))
    if with_socket:
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(os.path.join(top, "d/sock"))
    os.lchown(os.path.join(top, "d/rel"), 1234, 5678)
    os.chown(os.path.join(top, "d/fifo"), 4321, 8765)
    for i, (dirpath, dirnames, filenames) in enumerate(sorted(os.walk(top), reverse=True)):
        for j, name in enumerate(filenames + dirnames):
            os.utime(os.path.join(dirpath, name), ns=(10**18 + i, 10**18 + 1000 * i + j),
                     follow_symlinks=False)


def describe(top: str, dir_times: bool = True) -> dict:
    """What lstat and readlink say of every entry below `top` (and the bytes of files, and
    the other names of the same inode)."""
    out = {}
    inodes: dict[int, list[str]] = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            kind = stat.S_IFMT(st.st_mode)
            entry = {"mode": st.st_mode, "uid": st.st_uid, "gid": st.st_gid,
                     "mtime": st.st_mtime_ns, "nlink": st.st_nlink if kind != stat.S_IFDIR else 0}
            if kind == stat.S_IFLNK:
                entry["target"] = os.readlink(os.fsencode(path))
                entry["size"] = st.st_size
            elif kind == stat.S_IFREG:
                with open(path, "rb") as f:
                    entry["bytes"] = f.read()
            elif kind in (stat.S_IFCHR, stat.S_IFBLK):
                entry["rdev"] = st.st_rdev
            if kind == stat.S_IFDIR and not dir_times:
                del entry["mtime"]
            out[os.path.relpath(path, top)] = entry
            if kind != stat.S_IFDIR:
                inodes.setdefault(st.st_ino, []).append(os.path.relpath(path, top))
    for names in inodes.values():
        for name in names:
            out[name]["names"] = sorted(names)
    return out


def assert_same_tree(src: str, dst: str) -> None:
    assert describe(dst) == describe(src)
    # diff has its say too: it compares every file and every symlink's target, and has
    # nothing to compare in a FIFO, socket or device but that both are one
    out = subprocess.run(["diff", "-r", "--no-dereference", src, dst], capture_output=True,
                         text=True, errors="replace")
    for line in out.stdout.splitlines():
        assert re.fullmatch(r"File (.*) is a (fifo|socket|character special file|block special "
                            r"file) while file (.*) is a \2", line), line
    assert out.stderr == ""


def test_symlinks_and_special_files_through_the_kernel(mounted):
    s = mounted()
    root = str(s.mnt)
    d = os.path.join(root, "d")
    os.mkdir(d)
    with open(os.path.join(d, "f"), "wb") as f:
        f.write(b"hello")
    link = os.path.join(d, "l")
    os.symlink("f", link)
    st = os.lstat(link)
    assert stat.S_ISLNK(st.st_mode) and st.st_size == 1 and st.st_nlink == 1
    assert os.readlink(link) == "f"
    with open(link, "rb") as f:                               # followed by the kernel
        assert f.read() == b"hello"
    assert os.stat(link).st_ino == os.stat(os.path.join(d, "f")).st_ino
    os.symlink(d, os.path.join(root, "dirlink"))                 # absolute, to a directory
    assert sorted(os.listdir(os.path.join(root, "dirlink"))) == ["f", "l"]
    with pytest.raises(OSError) as e:
        os.symlink("x", link)
    assert e.value.errno == errno.EEXIST
    os.symlink("t" * SYMLINK_MAX, os.path.join(d, "longest"))
    assert os.readlink(os.path.join(d, "longest")) == "t" * SYMLINK_MAX
    assert os.lstat(os.path.join(d, "longest")).st_size == SYMLINK_MAX
    with pytest.raises(OSError) as e:                            # the kernel's PATH_MAX
        os.symlink("t" * (SYMLINK_MAX + 1), os.path.join(d, "longer"))
    assert e.value.errno == errno.ENAMETOOLONG
    with pytest.raises(OSError) as e:
        os.readlink(os.path.join(d, "f"))
    assert e.value.errno == errno.EINVAL
    os.lchown(link, 77, 88)
    os.utime(link, ns=(5, 6), follow_symlinks=False)
    st = os.lstat(link)
    assert (st.st_uid, st.st_gid, st.st_mtime_ns) == (77, 88, 6)
    assert os.stat(os.path.join(d, "f")).st_uid == 0            # not followed

    # a FIFO passes bytes between two processes (the kernel's pipe: no bytes in the cache)
    fifo = os.path.join(d, "fifo")
    os.mkfifo(fifo, 0o600)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and os.lstat(fifo).st_size == 0
    got = []

    def read_fifo() -> None:
        with open(fifo, "rb") as f:
            got.append(f.read())

    reader = threading.Thread(target=read_fifo)
    reader.start()
    with open(fifo, "wb") as f:
        f.write(b"through the pipe")
    reader.join(30)
    assert got == [b"through the pipe"]
    # a unix socket bound on the mount (bind makes the node), devices by mknod
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(os.path.join(d, "sock"))
        assert stat.S_ISSOCK(os.lstat(os.path.join(d, "sock")).st_mode)
    os.mknod(os.path.join(d, "null"), stat.S_IFCHR | 0o666, os.makedev(1, 3))
    st = os.lstat(os.path.join(d, "null"))
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3)
    with pytest.raises(PermissionError):          # the mount is nodev, as FUSE mounts are
        open(os.path.join(d, "null"), "wb")
    os.mknod(os.path.join(d, "loop"), stat.S_IFBLK | 0o600, os.makedev(7, 300))
    assert os.lstat(os.path.join(d, "loop")).st_rdev == os.makedev(7, 300)
    entries = {e.name: e for e in os.scandir(d)}                 # d_type from readdirplus
    assert entries["l"].is_symlink() and entries["f"].is_file()
    assert not entries["fifo"].is_file() and not entries["fifo"].is_dir()
    assert entries["longest"].stat(follow_symlinks=False).st_size == SYMLINK_MAX
    assert sorted(entries) == ["f", "fifo", "l", "longest", "loop", "null", "sock"]

    # hard links: one inode, one content, several names
    os.link(os.path.join(d, "f"), os.path.join(root, "hard"))
    st = os.stat(os.path.join(root, "hard"))
    assert st.st_nlink == 2 and st.st_ino == os.stat(os.path.join(d, "f")).st_ino
    with open(os.path.join(root, "hard"), "r+b") as f:
        f.write(b"J")
    with open(os.path.join(d, "f"), "rb") as f:
        assert f.read() == b"Jello"
    os.unlink(os.path.join(d, "f"))
    assert os.stat(os.path.join(root, "hard")).st_nlink == 1
    os.link(os.path.join(root, "hard"), os.path.join(d, "f"))
    for src, dst, err in ((d, "dir-link", errno.EPERM), (os.path.join(d, "f"), "hard",
                                                         errno.EEXIST)):
        with pytest.raises(OSError) as e:
            os.link(src, os.path.join(root, dst))
        assert e.value.errno == err
    os.unlink(os.path.join(root, "hard"))

    # rename and unlink as for files; a symlink or FIFO may replace a file by rename
    os.rename(link, os.path.join(root, "moved"))
    assert os.readlink(os.path.join(root, "moved")) == "f"
    os.rename(fifo, os.path.join(d, "f"))
    assert stat.S_ISFIFO(os.lstat(os.path.join(d, "f")).st_mode)
    for name in ("f", "sock", "null", "loop", "longest"):
        os.unlink(os.path.join(d, name))
    os.unlink(os.path.join(root, "moved"))
    os.unlink(os.path.join(root, "dirlink"))
    os.rmdir(d)
    assert os.listdir(root) == []


def test_listings_show_dot_and_dotdot_to_those_who_ask(mounted, tmp_path):
    """ls -a shows `.` and `..` (with their inode numbers, as tmpfs does); os.listdir,
    os.scandir and find show neither."""
    s = mounted()
    root = str(s.mnt)
    os.makedirs(os.path.join(root, "a/b"))
    for i in range(300):    # more than one READDIRPLUS reply
        open(os.path.join(root, "a/b", f"f{i:03}"), "wb").close()
    os.symlink("b", os.path.join(root, "a/l"))

    def ls_ai(path: str) -> dict[str, int]:
        out = subprocess.run(["ls", "-ai1", path], capture_output=True, text=True, check=True)
        return {line.split(maxsplit=1)[1]: int(line.split()[0])
                for line in out.stdout.splitlines()}

    a, b = os.path.join(root, "a"), os.path.join(root, "a/b")
    assert ls_ai(a) == {".": os.stat(a).st_ino, "..": os.stat(root).st_ino,
                        "b": os.stat(b).st_ino, "l": os.lstat(os.path.join(a, "l")).st_ino}
    listed = ls_ai(b)
    assert (listed.pop("."), listed.pop("..")) == (os.stat(b).st_ino, os.stat(a).st_ino)
    assert sorted(listed) == [f"f{i:03}" for i in range(300)]
    top = ls_ai(root)     # at a mount's root, `..` is the directory it is mounted on
    assert (top["."], top[".."]) == (os.stat(root).st_ino, os.stat(root + "/..").st_ino)
    assert sorted(os.listdir(a)) == ["b", "l"]
    assert sorted(e.name for e in os.scandir(a)) == ["b", "l"]
    assert len(os.listdir(b)) == 300
    found = subprocess.run(["find", root], capture_output=True, text=True, check=True)
    assert sorted(found.stdout.split()) == sorted(
        [root, a, b, os.path.join(a, "l")] + [os.path.join(b, f"f{i:03}") for i in range(300)])
    assert os.listdir(os.path.join(root, "a/l")) == os.listdir(b)   # through the symlink
    # the same names as on tmpfs, in a tmpfs of its own
    ref = tmp_path / "tmpfs"
    ref.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(ref)], check=True)
    try:
        os.makedirs(ref / "a/b")
        os.symlink("b", ref / "a/l")
        assert sorted(ls_ai(str(ref / "a"))) == sorted(ls_ai(a)) == [".", "..", "b", "l"]
    finally:
        subprocess.run(["umount", str(ref)], check=True)


def test_tar_of_a_tree_with_symlinks_and_special_files(mounted, tmp_path):
    """Extracted onto the mount, the tree is what it was: every entry's type, mode, owner,
    mtime, target and bytes; archived again from the mount, it extracts the same elsewhere."""
    s = mounted()
    src = str(tmp_path / "src")
    make_tree(src, with_socket=False)
    archive = str(tmp_path / "tree.tar")
    subprocess.run(["tar", "--format=posix", "-cf", archive, "-C", src, "."], check=True)
    dst = os.path.join(str(s.mnt), "extracted")
    os.mkdir(dst)
    subprocess.run(["tar", "-xpf", archive, "-C", dst], check=True)
    assert_same_tree(src, dst)
    again = str(tmp_path / "again.tar")
    subprocess.run(["tar", "--format=posix", "-cf", again, "-C", dst, "."], check=True)
    back = str(tmp_path / "back")
    os.mkdir(back)
    subprocess.run(["tar", "-xpf", again, "-C", back], check=True)
    assert_same_tree(src, back)


def test_cp_a_and_rsync_a(mounted, tmp_path):
    s = mounted()
    src = str(tmp_path / "src")
    make_tree(src)
    onto = os.path.join(str(s.mnt), "copy")
    subprocess.run(["cp", "-a", src, onto], check=True)
    assert_same_tree(src, onto)
    within = os.path.join(str(s.mnt), "copy2")      # mount to mount
    subprocess.run(["cp", "-a", onto, within], check=True)
    assert_same_tree(src, within)
    if shutil.which("rsync") is None:
        pytest.skip("rsync is not installed (cp -a and tar were checked)")
    synced = os.path.join(str(s.mnt), "synced")
    subprocess.run(["rsync", "-aH", src + "/", synced + "/"], check=True)
    assert_same_tree(src, synced)
    os.unlink(os.path.join(synced, "d/rel"))         # a second run mends what changed
    os.unlink(os.path.join(synced, "d/sub/hard"))
    os.symlink("elsewhere", os.path.join(synced, "d/dirlink.new"))
    subprocess.run(["rsync", "-aH", "--delete", src + "/", synced + "/"], check=True)
    assert_same_tree(src, synced)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_they_outlive_a_restart_of_bluecached(mounted, tmp_path, sig):
    """SIGTERM: in the snapshot; SIGKILL: replayed from the journal. The bytes of files need
    write-behind to have run before a kill; the links and nodes do not."""
    s = mounted()
    src = str(tmp_path / "src")
    make_tree(src)
    dst = os.path.join(str(s.mnt), "tree")
    subprocess.run(["cp", "-a", src, dst], check=True)
    for name in ("d/file.bin", "d/sub/small"):   # on NVMe before the kill
        fd = os.open(os.path.join(dst, name), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    os.rename(os.path.join(dst, "d/rel"), os.path.join(dst, "rel-moved"))
    os.unlink(os.path.join(dst, "dangling"))
    os.lchown(os.path.join(dst, "rel-moved"), 42, 43)
    # A directory's mtime from entries made or removed in it is in the snapshot, not in the
    # journal (for every kind of entry): after a kill it is the one last set explicitly.
    dir_times = sig == signal.SIGTERM
    before = describe(dst, dir_times)
    restart(s, sig)
    assert describe(dst, dir_times) == before
    with open(os.path.join(dst, "d/dirlink/small"), "rb") as f:
        assert f.read() == b"small\n"


def test_a_symlink_to_an_evicted_file_dangles(mounted):
    """The cache evicts files, never symlinks: once the file is gone, the link resolves to
    nothing (ENOENT), as a link to a removed file does; written again, the file is back.
    A file's hard links go with it: no name shows bytes that are gone."""
    s = mounted()
    root = str(s.mnt)
    target = os.path.join(root, "blocks/b.bin")
    os.mkdir(os.path.join(root, "blocks"))
    with open(target, "wb") as f:
        f.write(pattern("b", 2 * MiB))
    link = os.path.join(root, "latest")
    os.symlink("blocks/b.bin", link)
    hard = os.path.join(root, "blocks/b-too.bin")
    os.link(target, hard)
    with open(link, "rb") as f:
        assert f.read() == pattern("b", 2 * MiB)
    assert os.stat(hard).st_nlink == 2
    client = s.daemon.client()
    try:
        # The kernel sends RELEASE after close(2) returns, so the read above may still count
        # as open for a moment: evict skips open files, so ask until the release has landed.
        deadline = time.monotonic() + 30
        while (evicted := client.call("evict", path="/blocks/b.bin"))["removed"] == 0:
            assert evicted["skipped_open"] == 1 and time.monotonic() < deadline, evicted
            time.sleep(0.05)
        assert evicted == {"removed": 1, "skipped_open": 0}
        assert client.call("evict", all=True) == {"removed": 0, "skipped_open": 0}
        tiers = {e["name"]: e["tier"] for e in client.call("ls", path="/")["entries"]}
        assert tiers[b"latest"] == "index"
        assert client.call("du", path="/")["other"] == 1
    finally:
        client.close()
    with pytest.raises(FileNotFoundError):
        open(link, "rb")
    # The kernel hears of the eviction from hostd after the fact (an entry invalidation sent on
    # bluecached's `removed` event): its cached entries may answer a moment longer under load.
    deadline = time.monotonic() + 30
    while os.path.exists(link) or os.path.lexists(hard):
        assert time.monotonic() < deadline, "the kernel kept the evicted file's entries"
        time.sleep(0.05)
    assert os.path.lexists(link)
    assert os.listdir(os.path.join(root, "blocks")) == []
    assert os.readlink(link) == "blocks/b.bin"
    with open(target, "wb") as f:
        f.write(b"again")
    with open(link, "rb") as f:
        assert f.read() == b"again"
