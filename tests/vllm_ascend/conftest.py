"""The vllm-ascend stage: vllm-ascend 0.23.0.post1's ``MooncakeConnectorV1`` over vLLM 0.23.0,
real Mooncake transfer engine (TCP), CPU only, the NPU device layer stubbed.

Skipped when those packages are absent (they live in a venv of their own: vLLM 0.23 cannot
share one with the 0.32/0.33 that tests/vllm need).  To run them, build that venv with the
project's own script, which then runs this folder (CI does the same):

    bash .ci/vllm_ascend DIR             # or: bash .ci/vllm_ascend DIR --install, then
    . DIR/venv/bin/activate && python -m pytest -q tests/vllm_ascend

``SHMHB_REQUIRE_VLLM_ASCEND=1`` (set by that script) turns a missing package into a failure.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from typing import Any

import pytest

# This process imports vLLM (shmhb.vllm): with vllm-ascend installed, vLLM's plugins would
# make its NPU platform current, which wants the real torch_npu.  The engines run the same
# way (tests/vllm_ascend/stack.py, ENV); nothing may look up a model hub.  (Only where
# vllm-ascend is installed: elsewhere these tests skip and the session's environment stays.)
if importlib.util.find_spec("vllm_ascend") is not None:
    for _k, _v in (("VLLM_PLUGINS", "none"), ("HF_HUB_OFFLINE", "1"),
                   ("TRANSFORMERS_OFFLINE", "1"), ("HF_ENDPOINT", "http://127.0.0.1:9")):
        os.environ.setdefault(_k, _v)

HOW = ("vllm-ascend 0.23.0.post1 with vLLM 0.23.0 not installed: run tests/vllm_ascend in "
       "their own venv (bash .ci/vllm_ascend DIR; see tests/vllm_ascend/conftest.py)")


def require_vllm_ascend() -> None:
    """At the top of each test module here: skip it with the reason above when the stack is
    absent; with ``SHMHB_REQUIRE_VLLM_ASCEND=1`` absent is a failure."""
    if os.environ.get("SHMHB_REQUIRE_VLLM_ASCEND"):
        import mooncake.engine  # noqa: F401
        import vllm  # noqa: F401
        import vllm_ascend  # noqa: F401
        return
    pytest.importorskip("vllm", reason=HOW)
    pytest.importorskip("vllm_ascend", reason=HOW)
    pytest.importorskip("mooncake.engine", reason=HOW)


def make_stack(tmp_path_factory: Any, *, wrapped: bool) -> Iterator[Any]:
    from tests.vllm.stack import stack_scope

    from .stack import AscendStack
    tmp = str(tmp_path_factory.mktemp("ascend-wrapped" if wrapped else "ascend-stock"))
    yield from stack_scope(tmp, lambda cluster, d: AscendStack(cluster, d, wrapped=wrapped))
