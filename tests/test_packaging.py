"""The source distribution and the wheel: what they carry, and that building the sdist
warns of nothing."""

from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _build(hook: str, out: Path) -> tuple[str, str]:
    """Run setuptools' PEP 517 ``hook`` (what `python -m build` calls, without an isolated
    env) into ``out``; return the file's name and the build's output."""
    code = ("import sys\nfrom setuptools import build_meta\n"
            f"print(build_meta.{hook}(sys.argv[1]))\n")
    res = subprocess.run([sys.executable, "-c", code, str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip().splitlines()[-1], res.stdout + res.stderr


def test_sdist_has_tests_examples_license_and_no_deprecation(tmp_path: Path) -> None:
    name, output = _build("build_sdist", tmp_path)
    assert "deprecat" not in output.lower(), output
    with tarfile.open(tmp_path / name) as tar:
        names = {n.partition("/")[2] for n in tar.getnames()}
        top = name.removesuffix(".tar.gz")
        info = tar.extractfile(f"{top}/PKG-INFO")
        assert info is not None
        pkg_info = info.read().decode()
    for path in ("LICENSE", "tests/conftest.py", "tests/collective_cases.py",
                 "tests/transport_conformance.py", "tests/netns.py", "tests/mp_kill.py",
                 "tests/test_run.py", "examples/seed_program.py", "examples/allreduce_demo.py",
                 "Makefile", "src/acoll/_native/ring.c"):
        assert path in names, path
    assert "License-Expression: Apache-2.0" in pkg_info
    assert "Apache License" in (ROOT / "LICENSE").read_text()


def test_wheel_carries_the_native_ring_source(tmp_path: Path) -> None:
    """The C file is package data: an installed acoll builds its native ring from it."""
    import zipfile

    name, _ = _build("build_wheel", tmp_path)
    with zipfile.ZipFile(tmp_path / name) as whl:
        assert "acoll/_native/ring.c" in whl.namelist()
