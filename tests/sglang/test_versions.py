"""The wrapper on the one SGLang release it supports, and a refusal on any other: SGLang
only logs a plugin that raises, so the refusal is a manager that will not start,
naming what to install.  Each case runs SGLang's own plugin loading in a child process."""

from __future__ import annotations

import subprocess
import sys

import pytest

from shmhb.testing.loopback import child_env

from .conftest import require_sglang

require_sglang()

from .stack import ENV, STUB  # noqa: E402

pytestmark = pytest.mark.system

PROGRAM = """
import sys
import sglang
if sys.argv[1] != "-":
    sglang.__version__ = sys.argv[1]  # stands for another release
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
m = get_kv_class(TransferBackend.MOONCAKE, KVClassType.MANAGER)
r = get_kv_class(TransferBackend.MOONCAKE, KVClassType.RECEIVER)
print(m.__module__, r.__module__)
try:
    m(None, None, None, False)
except Exception as e:
    print(type(e).__name__, e)
"""


def run(version: str, enabled: str) -> list[str]:
    env = child_env(**ENV, SHMHB_SGLANG=enabled)
    env["PYTHONPATH"] += ":" + STUB
    p = subprocess.run([sys.executable, "-c", PROGRAM, version], capture_output=True,
                       text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout.splitlines()


def test_switched_on_the_supported_release_builds_the_wrapped_classes() -> None:
    out = run("-", "1")
    assert out[0] == "shmhb.sglang.manager shmhb.sglang.manager", out


def test_switched_off_sglang_is_untouched() -> None:
    out = run("-", "0")
    assert out[0].split() == ["sglang.srt.disaggregation.mooncake.conn"] * 2, out


def test_another_release_refuses_to_start_naming_what_to_install() -> None:
    out = run("0.5.22", "1")
    assert out[1].startswith("UnsupportedRelease"), out
    assert "install sglang==0.5.23" in out[1] and "runs 0.5.22" in out[1], out
