"""2 MiB pages for hostd's staging (mount.huge_pages) and the DRAM tier's prefaulted memfds
(tiers.dram.huge_pages): the shmem policy they need, and memory that asks for them."""

import mmap
import os

import pytest

from bluecached import huge_pages
from bluecached.shm import SharedRegion
from bluecached.tiers.dram import CHUNK_SIZE, populated_memfd
from support import pmd_mapped_kib, smaps_fields

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


@pytest.mark.parametrize("policy", ["always", "within_size", "force"])
def test_a_policy_that_covers_writes_is_left_alone(tmp_path, policy):
    text = "always within_size advise never deny force".replace(policy, f"[{policy}]")
    path = policy_file(tmp_path, text)
    assert huge_pages.allow_within_size(path)
    assert path.read_text() == text


@pytest.mark.parametrize("policy", ["never", "advise"])
def test_never_or_advise_becomes_within_size(tmp_path, policy, caplog):
    path = policy_file(tmp_path, "always within_size advise never deny force".replace(
        policy, f"[{policy}]"))
    with caplog.at_level("INFO", "bluecache.huge_pages"):
        assert huge_pages.allow_within_size(path)
    assert path.read_text() == "within_size\n"
    assert f"{policy} -> within_size" in caplog.text


@pytest.mark.parametrize("text", ["always within_size advise never [deny] force", "garbage"])
def test_deny_or_an_unreadable_policy_leaves_the_dram_tier_small(tmp_path, text, caplog):
    path = policy_file(tmp_path, text)
    with caplog.at_level("INFO", "bluecache.huge_pages"):
        assert not huge_pages.allow_within_size(path)
    assert path.read_text() == text
    assert "DRAM tier stays on 4 KiB pages" in caplog.text


def region_fields(region: SharedRegion) -> dict[str, int]:
    return smaps_fields(os.fstat(region.fd).st_ino, region.length)


def test_a_huge_region_is_allocated_whole_and_on_2mib_pages_where_granted():
    granted = huge_pages.allow_advised()
    region = SharedRegion(16 * MiB, "test-huge", huge=True)
    try:
        fields = region_fields(region)
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
        assert region_fields(region)["Rss"] * 1024 < 16 * MiB
        region.view[:mmap.PAGESIZE] = b"x" * mmap.PAGESIZE   # and works as before
        assert bytes(region.view[:1]) == b"x"
    finally:
        region.close()


@pytest.mark.parametrize("policy", ["within_size", "advise"])
def test_a_spare_memfd_is_on_2mib_pages_where_the_policy_covers_fallocate(policy,
                                                                          shmem_policy_kept):
    """tiers.dram.huge_pages sets within_size: the spares' fallocate then allocates 2 MiB
    pages, as a kernel writer's write(2) does; under advise (hostd's alone) it does not."""
    huge_pages.SHMEM_ENABLED.write_text(f"{policy}\n")
    granted = huge_pages.shmem_policy() == policy
    memfd = populated_memfd(8)
    try:
        for index, window in memfd.ahead.items():   # the windows work as before
            window[:5] = b"chunk"
            window[-1:] = bytes([index])
        assert os.pread(memfd.fd, 5, 3 * CHUNK_SIZE) == b"chunk"
        assert os.pread(memfd.fd, 1, 4 * CHUNK_SIZE - 1) == bytes([3])
        pmd_mapped = pmd_mapped_kib(memfd.fd, 8 * CHUNK_SIZE)
        if policy == "advise":
            assert pmd_mapped == 0
            return
        if not granted:
            pytest.skip(f"the kernel's shmem policy is {huge_pages.shmem_policy()}")
        # At least some of it: a fragmented machine may fall back to 4 KiB for a few.
        assert pmd_mapped >= 2 * 1024, pmd_mapped
    finally:
        memfd.close()
