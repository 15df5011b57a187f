"""Imports run one way: hostd may import bluecached and fusefs, bluecached never imports hostd or
fusefs (it ships alone on the DPU), fusefs neither of them, and the application library
hostd.zerocopy carries nothing of the daemons with it."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIRST_PARTY = ("bluecached", "hostd", "fusefs")


def _catches_import_error(node: ast.Try) -> bool:
    return any(isinstance(h.type, ast.Name) and h.type.id in ("ImportError",
                                                              "ModuleNotFoundError")
               for h in node.handlers)


def imported_modules(path: Path, optional: bool = True) -> set[str]:
    """Every module `path` imports, anywhere in it, relative imports resolved; with
    optional=False, not those imported in a `try` that catches ImportError."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            base = base[:len(base) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            if node.module:
                found.add(module)
            else:   # `from . import x`: x is a module of the package
                found.update(f"{module}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            if not optional and isinstance(node, ast.Try) and child in node.body \
                    and _catches_import_error(node):
                continue
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


def test_bluecached_imports_neither_hostd_nor_fusefs():
    """The one exception: bluecachectl's `up` finds hostd where the host package is installed,
    and refuses where it is not (the test below)."""
    wrong = [f"{path.relative_to(ROOT)}: {module}"
             for path in sorted((ROOT / "bluecached").rglob("*.py"))
             for module in imported_modules(path, optional=path.name != "ctl.py")
             if module.split(".")[0] in ("hostd", "fusefs")]
    assert not wrong, wrong
    assert "hostd.embedded" in imported_modules(ROOT / "bluecached" / "ctl.py")


def test_fusefs_imports_neither_hostd_nor_bluecached():
    """The kernel boundary defines the interfaces it needs (Cache, Transfers, StagingSlots);
    hostd implements them and hands them in."""
    wrong = [f"{path.relative_to(ROOT)}: {module}"
             for path in sorted((ROOT / "fusefs").rglob("*.py"))
             for module in imported_modules(path)
             if module.split(".")[0] in ("hostd", "bluecached")]
    assert not wrong, wrong


def test_zerocopy_imports_only_the_ioctl_abi_and_shared_memory():
    ours = {m for m in imported_modules(ROOT / "hostd" / "zerocopy.py")
            if m.split(".")[0] in FIRST_PARTY}
    assert ours == {"hostd.ioctl_abi", "bluecached.shm"}


def test_importing_zerocopy_loads_no_daemon_dependency():
    probe = ("import sys, hostd.zerocopy\n"
             "print(' '.join(m for m in ('zmq', 'trio', 'msgpack', 'yaml', 'pyfuse3') "
             "if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                       check=True)
    assert r.stdout.strip() == ""


def test_up_without_the_host_package_refuses_in_one_line(tmp_path):
    """On a DPU bluecachectl is installed without hostd: `up` says what it needs."""
    probe = ("import sys\n"
             "sys.modules['hostd'] = None   # as if not installed\n"
             "from bluecached.ctl import main\n"
             f"sys.exit(main(['up', '--state-dir', {str(tmp_path)!r}]))")
    r = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stdout == ""
    assert r.stderr.startswith("bluecachectl up needs the host package (bluecache-host)"), \
        r.stderr
    assert len(r.stderr.splitlines()) == 1, r.stderr
