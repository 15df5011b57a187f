"""hostd's two deadlines (docs/operations.md, Bounded I/O time): the kernel's request timeout
must outlast what a healthy hostd can take while bluecached is away, or it would abort a mount
that works."""

import pytest

from hostd.config import ConfigError, load_config


def test_defaults_bound_both_daemons():
    cfg = load_config(None)
    assert cfg.daemon.request_timeout == 5.0
    assert cfg.mount.kernel_request_timeout == 60


def test_a_kernel_timeout_hostd_could_outlast_is_refused(tmp_path):
    path = tmp_path / "hostd.yaml"
    path.write_text("daemon: {request_timeout: 5s}\nmount: {kernel_request_timeout: 14}\n")
    with pytest.raises(ConfigError, match=r"mount\.kernel_request_timeout: 14 s is less than 3 x "
                                          r"daemon\.request_timeout \(5 s\)") as e:
        load_config(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("seconds", [0, 15, 65535])
def test_off_or_long_enough_is_taken(seconds):
    cfg = load_config(None, assignments=[f"mount.kernel_request_timeout={seconds}"])
    assert cfg.mount.kernel_request_timeout == seconds


@pytest.mark.parametrize("value", [-1, 65536, "1m"])
def test_out_of_range_is_refused(value):
    with pytest.raises(ConfigError, match=r"mount\.kernel_request_timeout"):
        load_config(None, assignments=[f"mount.kernel_request_timeout={value}"])
