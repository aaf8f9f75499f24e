"""A wheel of the project carries every C++ kernel source: the kernels are compiled from them on first use, and
a kernel whose source is missing would silently leave its PyTorch path."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_holds_every_kernel_source(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for package in ("hybrid", "moe"):
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "wheel"
    out.mkdir()
    build = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
                            "print(build_meta.build_wheel(sys.argv[1]))", str(out)],
                           cwd=source, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    wheel = out / build.stdout.strip().splitlines()[-1]
    names = set(zipfile.ZipFile(wheel).namelist())
    kernels = {p.relative_to(ROOT).as_posix() for package in ("hybrid", "moe") for p in (ROOT / package).rglob("*.cpp")}
    assert len(kernels) >= 6 and kernels <= names, sorted(kernels - names)
