"""Builds braid's wheel with libbraid.so inside the package.

The library comes from BRAID_LIBRARY (a path to a built libbraid.so) when that is set at build time,
else from `cargo build --release -p braid-capi` in the source tree this directory belongs to.
"""

import os
import shutil
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = Path(__file__).resolve().parent
TREE = HERE.parent


def library():
    given = os.environ.get("BRAID_LIBRARY")
    if given:
        path = Path(given)
        if not path.is_file():
            raise SystemExit(f"braid: BRAID_LIBRARY={given} is not a file")
        return path
    if not (TREE / "Cargo.toml").is_file():
        raise SystemExit(
            "braid: no libbraid.so to package: build from braid's source tree (pip install ./python), "
            "or set BRAID_LIBRARY to a built libbraid.so")
    if shutil.which("cargo") is None:
        raise SystemExit("braid: building libbraid.so needs cargo (https://rustup.rs), or set BRAID_LIBRARY")
    subprocess.run(["cargo", "build", "--release", "-p", "braid-capi"], cwd=TREE, check=True)
    return TREE / "target" / "release" / "libbraid.so"


class BuildWithLibrary(build_py):
    def run(self):
        super().run()
        target = Path(self.build_lib) / "braid" / "libbraid.so"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(library(), target)


try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools before 70
    from wheel.bdist_wheel import bdist_wheel


class AnyPythonWheel(bdist_wheel):
    """The library is loaded with ctypes, so the wheel fits every Python 3 on this platform."""

    def get_tag(self):
        _, _, platform = super().get_tag()
        return "py3", "none", platform


class NativeDistribution(Distribution):
    """The wheel carries a native library: tag it for this platform, not as pure Python."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildWithLibrary, "bdist_wheel": AnyPythonWheel}, distclass=NativeDistribution)
