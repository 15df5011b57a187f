"""hostd's staging on 2 MiB pages (mount.huge_pages): the shmem policy it needs, and a region
that asks for them."""

import mmap
import re

import pytest

from bluecached import huge_pages
from bluecached.shm import SharedRegion

MiB = 1 << 20


def policy_file(tmp_path, text):
    path = tmp_path / "shmem_enabled"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text", ["always within_size [advise] never deny force",
                                  "[always] within_size advise never deny force",
                                  "always [within_size] advise never deny force"])
def test_a_policy_that_honours_advice_is_left_alone(tmp_path, text):
    path = policy_file(tmp_path, text)
    assert huge_pages.allow_advised(path)
    assert path.read_text() == text


def test_never_becomes_advise(tmp_path, caplog):
    path = policy_file(tmp_path, "always within_size advise [never] deny force")
    with caplog.at_level("INFO", "bluecache.huge_pages"):
        assert huge_pages.allow_advised(path)
    assert path.read_text() == "advise\n"
    assert "never -> advise" in caplog.text


@pytest.mark.parametrize("text", ["always within_size advise never [deny] force", "", "garbage"])
def test_deny_or_an_unreadable_policy_means_small_pages(tmp_path, text, caplog):
    path = policy_file(tmp_path, text)
    with caplog.at_level("INFO", "bluecache.huge_pages"):
        assert not huge_pages.allow_advised(path)
    assert path.read_text() == text   # nothing written
    assert "4 KiB pages" in caplog.text


def test_no_policy_file_means_small_pages(tmp_path):
    assert huge_pages.shmem_policy(tmp_path / "absent") is None
    assert not huge_pages.allow_advised(tmp_path / "absent")


def test_a_policy_that_cannot_be_written_means_small_pages(tmp_path, monkeypatch, caplog):
    path = policy_file(tmp_path, "always within_size advise [never] deny force")

    def refuse(self, text):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(type(path), "write_text", refuse)
    with caplog.at_level("INFO", "bluecache.huge_pages"):
        assert not huge_pages.allow_advised(path)
    assert "cannot set" in caplog.text and "Permission denied" in caplog.text


def _mapping_fields(region: SharedRegion) -> dict[str, int]:
    """The smaps fields (kB) of the mapping that holds the region's first byte."""
    import ctypes
    address = ctypes.addressof(ctypes.c_char.from_buffer(region.map))
    fields, inside = {}, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if head:
                inside = int(head[1], 16) <= address < int(head[2], 16)
            elif inside and line.split(":")[0].isidentifier() and line.rstrip().endswith("kB"):
                name, value = line.split(":")
                fields[name] = int(value.split()[0])
    return fields


def test_a_huge_region_is_allocated_whole_and_on_2mib_pages_where_granted():
    granted = huge_pages.allow_advised()
    region = SharedRegion(16 * MiB, "test-huge", huge=True)
    try:
        fields = _mapping_fields(region)
        assert fields["Rss"] * 1024 >= 16 * MiB   # every page there before anyone maps it
        if not granted:
            pytest.skip(f"the kernel's shmem policy is {huge_pages.shmem_policy()}")
        # At least some of it: a fragmented machine may fall back to 4 KiB for a few.
        assert fields.get("ShmemPmdMapped", 0) >= 2 * 1024, fields
    finally:
        region.close()


def test_a_plain_region_is_left_to_fault_in():
    region = SharedRegion(16 * MiB, "test-plain")
    try:
        assert _mapping_fields(region)["Rss"] * 1024 < 16 * MiB
        region.view[:mmap.PAGESIZE] = b"x" * mmap.PAGESIZE   # and works as before
        assert bytes(region.view[:1]) == b"x"
    finally:
        region.close()
