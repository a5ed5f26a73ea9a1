"""Build the compiled hot path in place: ``python kvindex/native/build.py`` (``make install`` runs
it, and so does the Dockerfile; it imports nothing of the project). Cython turns ``_native.pyx``
into C++ under ``var/build/native``, the C++ compiler makes ``kvindex/native/_native.<abi>.so``.
Exits non-zero when it cannot; ``kvindex.native`` then says why, and the pure-Python versions run
instead."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
BUILD = ROOT / "var" / "build" / "native"


def main() -> None:
    from Cython.Build import cythonize
    from setuptools import Extension, setup

    extension = Extension(
        "kvindex.native._native",
        [str((HERE / "_native.pyx").relative_to(ROOT))],
        include_dirs=[str(HERE)],
        language="c++",
        extra_compile_args=["-O2", "-std=c++17"],
        depends=[str(HERE / name) for name in ("core.hpp", "flatmap.hpp", "sha256.h")],
    )
    setup(
        name="kvindex-native",
        packages=[],
        py_modules=[],
        script_args=[
            "-q",
            "build_ext",
            "--inplace",
            "--build-temp",
            str(BUILD / "temp"),
            "--build-lib",
            str(BUILD / "lib"),
        ],
        ext_modules=cythonize([extension], build_dir=str(BUILD), quiet=True, language_level=3),
    )


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
