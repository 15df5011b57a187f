import pytest


@pytest.fixture(params=["loopback", "doca"])
def engine(request):
    """Every mount test runs twice: with the loopback engine, and end to end with the doca
    engine on the DOCA API simulator (hostd exports, bluecached imports and DMAs; no DPU)."""
    return request.param
