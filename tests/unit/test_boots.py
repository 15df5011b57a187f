"""The state directory's boot counter (bluecached/boots.py)."""

import logging

from bluecached import boots


def test_a_state_directory_without_one_starts_at_zero(tmp_path):
    assert boots.last_boot(tmp_path) == 0


def test_a_recorded_boot_is_read_back_and_replaced_whole(tmp_path):
    boots.record_boot(tmp_path, 7)
    assert boots.last_boot(tmp_path) == 7
    boots.record_boot(tmp_path, 8)
    assert boots.last_boot(tmp_path) == 8
    assert sorted(p.name for p in tmp_path.iterdir()) == ["boot"]   # no temporary left


def test_a_file_without_a_number_is_logged_and_counts_as_none(tmp_path, caplog):
    for text in ("", "seven\n", "-3\n"):
        (tmp_path / "boot").write_text(text)
        with caplog.at_level(logging.WARNING, logger="bluecached.boots"):
            assert boots.last_boot(tmp_path) == 0
        assert "does not hold a boot number" in caplog.text
        caplog.clear()
