"""Build script: everything is in setup.cfg but the optional C extension.

``shmhb._native`` (the hot paths in C) is optional: where no compiler or no Python
headers exist, ``pip install .`` still succeeds and shmhb runs on its pure-Python path
(``shmhb.native`` is then False).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "shmhb._native",
            sources=["shmhb/_native.c"],
            depends=["shmhb/include/shmhb.h"],
            extra_compile_args=["-std=c99", "-O2"],
            optional=True,
        )
    ],
)
