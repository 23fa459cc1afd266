"""Build script: everything is in setup.cfg but the optional C extensions.

``shmhb._native`` (the board's hot paths in C) and ``shmhb._fence`` (the go-ahead's
grants, answered without the GIL) are optional: where no compiler or no Python headers
exist, ``pip install .`` still succeeds and shmhb runs on its pure-Python paths
(``shmhb.board.native.native`` and ``shmhb.kv.grants.native`` are then False).
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
        ),
        Extension(
            "shmhb._fence",
            sources=["shmhb/_fence.c"],
            extra_compile_args=["-std=gnu99", "-O2", "-pthread"],
            extra_link_args=["-pthread"],
            optional=True,
        ),
    ],
)
