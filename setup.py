"""The package's build (pyproject.toml holds its metadata): a wheel or a non-editable install also compiles
the quantized kernel's instruction-set variants (AVX-512 VNNI, AVX2, portable x86-64) into the package
(``leapdecode/models/kernels/prebuilt``), so that it runs exactly on a machine with no compiler; the
library picks the best variant the CPU runs at load (``models/kernel_build.py``).  An editable install
(``make install``) builds the kernel for its CPU at first use instead.  ``LEAPDECODE_NO_PREBUILT=1``
skips the variants (the package then builds at first use, as from a checkout)."""

import importlib.util
import os
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


def _kernel_build():
    """models/kernel_build.py, loaded by its path (the package itself imports torch, absent here)."""
    spec = importlib.util.spec_from_file_location("kernel_build", HERE / "src/leapdecode/models/kernel_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildWithKernels(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False) or os.environ.get("LEAPDECODE_NO_PREBUILT"):
            return
        kb = _kernel_build()
        cxx = next((c for c in (os.environ.get("CXX"), "g++", "c++", "clang++") if c and shutil.which(c)), None)
        if cxx is None:
            print("leapdecode: no C++ compiler: the wheel holds no prebuilt kernel (it builds at first use where a "
                  "compiler is)")
            return
        out = Path(self.build_lib) / "leapdecode" / "models" / "kernels" / "prebuilt"
        manifest = kb.build_prebuilt(cxx, out)
        print("leapdecode: kernel variants " + ", ".join(f"{n} ({v['seconds']} s)" for n, v in manifest["variants"].items()))


class PlatformWheel(bdist_wheel):
    """A wheel for this platform (it holds x86-64 shared libraries), for any Python 3 (they do not link Python)."""

    def finalize_options(self):
        super().finalize_options()
        self.root_is_pure = False

    def get_tag(self):
        return "py3", "none", super().get_tag()[2]


setup(cmdclass={"build_py": BuildWithKernels, "bdist_wheel": PlatformWheel})
