"""Each adapter runs only on the releases it was written for, and says what to install on
any other; vllm-ascend's layerwise and hybrid connectors are refused with the reason."""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import require_vllm_ascend

require_vllm_ascend()

from shmhb.vllm.adapters import adapter_class
from shmhb.vllm.ascend_adapter import HINT, RELEASES, AscendMooncakeAdapter
from shmhb.vllm.inner import Release, check_release, installed

from .conftest import make_stack
from .stack import AscendStack


def test_release_lines_and_exact_versions() -> None:
    line, exact = Release("vllm", ("0.32", "0.33")), Release("vllm-ascend", ("0.23.0.post1",))
    assert line.matches("0.32.0") and line.matches("0.33.1+cpu") and not line.matches("0.23.0")
    assert exact.matches("0.23.0.post1") and not exact.matches("0.23.0")
    assert not exact.matches("0.23.0.post10") and not line.matches(None)
    assert not line.matches("dev")


def test_this_venv_is_the_pair_the_ascend_adapter_supports() -> None:
    assert installed("vllm") == "0.23.0" and installed("vllm-ascend") == "0.23.0.post1"
    check_release("vllm-ascend MooncakeConnectorV1", RELEASES, HINT)  # no error


def test_the_upstream_adapters_refuse_vllm_0_23_naming_what_to_install() -> None:
    with pytest.raises(TypeError, match=r"vllm 0\.32 or 0\.33, not vllm 0\.23\.0.*"
                                        r"install 'vllm>=0\.32,<0\.34'"):
        check_release("Mooncake")


def test_the_ascend_adapter_refuses_another_pair_naming_what_to_install() -> None:
    other = (Release("vllm", ("0.33.0",)), RELEASES[1])
    with pytest.raises(TypeError, match=r"install 'vllm==0\.23\.0' and "
                                        r"'vllm-ascend==0\.23\.0\.post1'"):
        check_release("vllm-ascend MooncakeConnectorV1", other, HINT)


@pytest.mark.parametrize("name", ["MooncakeLayerwiseConnector", "MooncakeHybridConnector"])
def test_layerwise_and_hybrid_are_refused_with_the_reason(name: str) -> None:
    with pytest.raises(TypeError, match=f"{name} is not supported by shmhb"):
        adapter_class(name)
    assert adapter_class("MooncakeConnectorV1") is AscendMooncakeAdapter


def test_a_wrapped_worker_naming_the_layerwise_connector_refuses_to_start(
        tmp_path_factory: Any) -> None:
    gen = make_stack(tmp_path_factory, wrapped=True)
    stack: AscendStack = next(gen)
    try:
        e = stack.start("decode", wait=False,
                        env={"SHMHB_TEST_ASCEND_CONNECTOR": "MooncakeLayerwiseConnector"})
        assert e.p.wait(120) != 0
        assert "MooncakeLayerwiseConnector is not supported by shmhb" in e.log_tail(80)
    finally:
        gen.close()
