#!/usr/bin/env bash
# Installs what bluecache needs on a Debian/Ubuntu machine (idempotent):
# FUSE 3 (the mount), a virtual environment in .venv with the project and its test tools.
# --test also installs what the packaging tests use (Debian build tools, lintian, systemd's
# container tools, debootstrap, qemu-user for the arm64 package) and the single-node Ceph
# cluster (mon, mgr, osd, radosgw) the remote tier's tests run against, and podman with runc for
# the container images (kubectl, for tests/deploy/test_manifests.py, is not a Debian package:
# those tests are skipped where it is missing; docs/kubernetes.md).
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(fuse3 libfuse3-dev pkg-config gcc)
if [ "${1:-}" = "--test" ]; then
  packages+=(systemd systemd-container debootstrap qemu-user-static binfmt-support
             lintian dpkg-dev debhelper dh-python
             pybuild-plugin-pyproject python3-all-dev python3-setuptools python3-cffi
             ceph-mon ceph-mgr ceph-osd radosgw ceph-common uuid-runtime
             rsync    # tests/mount/test_special_files.py: rsync -aH of links
             btrfs-progs   # the NVMe tier on btrfs: hits as clones (tests' scratch btrfs)
             stress-ng fio   # tests/mount/test_posix_tools.py: POSIX torture, verified I/O
             podman runc)   # tests/deploy/test_images.py: the container images, run for real
fi
need_apt=()
for pkg in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need_apt+=("$pkg")
done
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: installing ${need_apt[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  # Waits for another apt run (a parallel setup) instead of failing on the dpkg lock.
  apt-get -o DPkg::Lock::Timeout=600 update -q
  apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends "${need_apt[@]}"
fi

python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
.venv/bin/pip install -q --upgrade pip >/dev/null
.venv/bin/pip install -q -e '.[test]'
if [ "${1:-}" = "--test" ]; then
  # The connectors' own modules the tests check bluecache against (tests/connector_code.py).
  .venv/bin/python scripts/fetch_connector_code.py
fi
echo "setup: ready (.venv)" >&2
