"""Docs that mirror code stay in sync with it."""

from pathlib import Path

from bluecached import config as bluecached_config
from bluecached.wire import protocol
from hostd import config as hostd_config

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_shipped_config_references_match_the_schemas():
    assert (DOCS / "config/bluecached.yaml").read_text() == bluecached_config.default_yaml()
    assert (DOCS / "config/hostd.yaml").read_text() == hostd_config.default_yaml()


def test_protocol_doc_names_every_operation():
    text = (DOCS / "protocol.md").read_text()
    for op in protocol.OPS:
        assert f"`{op}`" in text, op
