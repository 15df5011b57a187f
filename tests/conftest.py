import pytest

from support import Harness


@pytest.fixture
def harness(tmp_path):
    made = []

    def make(**kw):
        h = Harness(tmp_path / f"h{len(made)}", **kw)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()
