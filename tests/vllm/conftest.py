"""The vLLM stage: real vLLM, real Mooncake transfer engine (TCP), CPU only.

Skipped when vLLM or Mooncake is absent.  To run them, make their venv, one per supported
vLLM release, 0.32.0 or 0.33.0 (the second stage of .ci/run does exactly this, for both):

    python3 -m venv .venv-vllm && . .venv-vllm/bin/activate
    pip install vllm==0.33.0 mooncake-transfer-engine-non-cuda && pip uninstall -y torchvision torchaudio torchcodec
    apt-get install -y libibverbs1 librdmacm1 libnuma1
    pip install --no-deps nixl==1.5.1 nixl-cu13==1.5.1   # NIXL (tests/vllm/test_nixl.py)
    pip install -e '.[test,vllm]' && python -m pytest -q tests/vllm
"""

from __future__ import annotations

import os

from collections.abc import Iterator
from typing import Any

import pytest

HOW = "vLLM not installed: run tests/vllm in their own venv (see tests/vllm/conftest.py, or .ci/run)"


def require_vllm() -> None:
    """At the top of each test module here: skip it with a clear reason when vLLM or
    Mooncake is absent; in CI's vLLM stage (``SHMHB_REQUIRE_VLLM=1``) absent is a failure."""
    if os.environ.get("SHMHB_REQUIRE_VLLM"):
        import mooncake.engine  # noqa: F401
        import vllm  # noqa: F401
        return
    pytest.importorskip("vllm", reason=HOW)
    pytest.importorskip("mooncake.engine", reason=HOW)


def require_nixl() -> None:
    """As ``require_vllm``, for NIXL (``nixl._api``, what vLLM's NixlConnector imports:
    the ``nixl`` meta package over ``nixl-cu13``, which vLLM's CUDA 13 torch matches)."""
    require_vllm()
    if os.environ.get("SHMHB_REQUIRE_VLLM"):
        import nixl._api  # noqa: F401
        return
    pytest.importorskip("nixl._api", reason="NIXL not installed: " + HOW)


from .stack import Stack, stack_scope


def make_stack(tmp_path_factory: Any, *, wrapped: bool, env: dict[str, str] | None = None,
               inner: str = "mooncake") -> Iterator[Stack]:
    tmp = str(tmp_path_factory.mktemp(("vllm-wrapped" if wrapped else "vllm-stock") + f"-{inner}"))
    yield from stack_scope(tmp, lambda cluster, d: Stack(cluster, d, wrapped=wrapped, env=env,
                                                           inner=inner))
