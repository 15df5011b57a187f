"""CUDA device memory for tests/gpu: a real GPU where the machine has one, else the CUDA
driver simulator (tests/cuda_sim.py; no GPU is touched and nothing is measured then).
BLUECACHE_CUDA=gpu insists on a real GPU (the tests skip without one); =simulator forces the
simulator even on a GPU machine."""

import os

import cuda_sim
import pytest

ran_on: set[str] = set()


@pytest.fixture(scope="module")
def cuda_kind(tmp_path_factory):
    want = os.environ.get("BLUECACHE_CUDA", "auto")
    saved = os.environ.get("LD_LIBRARY_PATH")
    try:
        driver, kind = cuda_sim.cuda_driver(tmp_path_factory.getbasetemp() / "cuda-sim", want)
    except cuda_sim.Unavailable as e:
        pytest.skip(str(e))
    ran_on.add(kind)
    yield driver, kind
    # bluecached processes started by later tests must not find the simulator
    if saved is None:
        os.environ.pop("LD_LIBRARY_PATH", None)
    else:
        os.environ["LD_LIBRARY_PATH"] = saved


@pytest.fixture(scope="module")
def cu(cuda_kind):
    """cuda.bindings.driver with device 0's primary context current in this thread."""
    driver, _ = cuda_kind
    _, dev = driver.cuDeviceGet(0)
    _, ctx = driver.cuDevicePrimaryCtxRetain(dev)
    driver.cuCtxSetCurrent(ctx)
    return driver


def pytest_terminal_summary(terminalreporter):
    if ran_on:
        terminalreporter.write_line(
            "CUDA tests ran on: " + ", ".join(sorted(
                "a real GPU" if k == "gpu" else "the CUDA driver simulator (no GPU)"
                for k in ran_on)))
