"""shmhb.sglang's pure parts, without SGLang: the settings read at the door, the board
keys, the release check, and the frame a decode adds to its transfer requests (untrusted
input on the prefill)."""

from __future__ import annotations

import json

import pytest

from shmhb.errors import InvalidConfig
from shmhb.kv.fence import TOKEN_HEX
from shmhb.sglang import release
from shmhb.sglang.settings import SglangSettings, enabled, rank_key
from shmhb.sglang.wire import MAGIC, MAX_FRAME, STOCK_FRAMES, decode_extra, encode_extra

STOCK = [b"x"] * STOCK_FRAMES
TOKEN = "ab" * (TOKEN_HEX // 2)


def test_settings_from_the_environment() -> None:
    s = SglangSettings.from_env({"SHMHB_BOARD": "b1", "SHMHB_SGLANG_GRANT_TIMEOUT_S": "0.5",
                                 "SHMHB_SGLANG_ACT_ON_SUSPECT": "yes",
                                 "SHMHB_SGLANG_SERVING_URL": "http://10.1.2.3:30000"})
    assert (s.board, s.grant_timeout_s, s.act_on_suspect) == ("b1", 0.5, True)
    assert SglangSettings.from_env({}) == SglangSettings()


@pytest.mark.parametrize("env", [
    {"SHMHB_SGLANG_GRANT_TIMEOUT_S": "soon"}, {"SHMHB_SGLANG_GRANT_TIMEOUT_S": "0"},
    {"SHMHB_SGLANG_BEAT_INTERVAL_S": "99"}, {"SHMHB_SGLANG_ACT_ON_SUSPECT": "maybe"},
    {"SHMHB_SGLANG_SERVING_URL": "http://no port"},
])
def test_a_bad_setting_is_refused_by_name(env: dict[str, str]) -> None:
    with pytest.raises(InvalidConfig, match=next(iter(env))):
        SglangSettings.from_env(env)


def test_enabled_only_when_asked_and_a_typo_is_an_error() -> None:
    assert not enabled({}) and not enabled({"SHMHB_SGLANG": "0"})
    assert enabled({"SHMHB_SGLANG": "1"}) and enabled({"SHMHB_SGLANG": "On"})
    with pytest.raises(InvalidConfig):
        enabled({"SHMHB_SGLANG": "yess"})


def test_rank_keys_fit_a_slot_and_name_the_instance() -> None:
    assert rank_key("prefill", "10.0.0.1:8998", 0, 1, 0) == "sglang/p/10.0.0.1:8998/dp0/tp1/pp0"
    long = rank_key("decode", "a-very-long-kubernetes-service-name.namespace.svc:12345", 3, 7, 1)
    assert len(long.encode()) <= 63 and long.startswith("sglang/d/") and long.endswith("/dp3/tp7/pp1")


def test_only_the_supported_release_passes() -> None:
    assert release.refusal(release.SUPPORTED) is None
    for other in ("0.5.22", "0.6.0", "0.5.23.post1", None):
        why = release.refusal(other)
        assert why is not None and f"sglang=={release.SUPPORTED}" in why


def test_the_frame_round_trips() -> None:
    frame = encode_extra(7, "127.0.0.3:4000", TOKEN)
    assert decode_extra(STOCK + [frame]) == (7, "127.0.0.3:4000", TOKEN)


@pytest.mark.parametrize("frame", [
    b"", b"shmhb1:", MAGIC + b"{", MAGIC + b"\xff\xfe", MAGIC + b"[]",
    MAGIC + json.dumps({"inc": 0, "fence": "127.0.0.3:4000", "tok": TOKEN}).encode(),
    MAGIC + json.dumps({"inc": 1, "fence": "not an endpoint", "tok": TOKEN}).encode(),
    MAGIC + json.dumps({"inc": True, "fence": "127.0.0.3:4000"}).encode(),
    MAGIC + b" " * MAX_FRAME, b"other:" + encode_extra(1, "127.0.0.3:4000", TOKEN)[len(MAGIC):],
])
def test_anything_else_in_that_place_is_ignored(frame: bytes) -> None:
    assert decode_extra(STOCK + [frame]) is None
    assert decode_extra(STOCK) is None and decode_extra([]) is None


@pytest.mark.system
def test_importing_the_package_imports_no_sglang() -> None:
    import subprocess
    import sys

    from shmhb.testing.loopback import child_env
    out = subprocess.run([sys.executable, "-c", "import sys, shmhb, shmhb.sglang, "
                          "shmhb.sglang.decode, shmhb.sglang.prefill; "
                          "print('sglang' in sys.modules)"],
                         capture_output=True, text=True, env=child_env(), check=True)
    assert out.stdout.strip() == "False", out


# -- the lease rule's bookkeeping (shmhb.sglang.lease) ------------------------------------------


def test_the_prefill_writes_a_granted_room_only_while_its_lease_runs() -> None:
    from shmhb.sglang.lease import Lease, PrefillLeases, RoomRank
    leases, key, other = PrefillLeases(), RoomRank(7, "127.0.0.3:4000"), RoomRank(7, "127.0.0.4:4000")
    assert leases.check(key, 0) is Lease.NOT_ASKED
    leases.granted(key, 1_000)
    assert leases.check(key, 999) is Lease.RUNS
    assert leases.check(key, 1_000) is Lease.RAN_OUT  # the end itself is past the lease
    assert leases.check(other, 999) is Lease.NOT_ASKED  # per decode rank
    leases.granted(other, None)  # a decode without shmhb: no lease binds it
    assert leases.check(other, 10**18) is Lease.RUNS
    leases.forget([key])
    assert leases.check(key, 0) is Lease.NOT_ASKED and len(leases) == 1


def test_the_decode_fails_a_held_room_once_its_last_lease_ran_out() -> None:
    from shmhb.sglang.lease import DecodeHolds
    holds = DecodeHolds()
    holds.hold(1, 100, "a")
    assert holds.hold(1, 50, "b").until_ns == 100  # an earlier end never shortens a hold
    holds.hold(1, 200, "c")  # a later one (another rank's grant) extends it
    holds.hold(2, 150, "d")
    assert holds.due(99) == []
    assert [h.room for h in holds.due(150)] == [2]  # room 1 waits for its later lease
    assert holds.due(199) == []
    (h,) = holds.due(200)
    assert (h.room, h.until_ns, h.reason) == (1, 200, "c")
    assert holds.due(10**9) == [] and len(holds) == 0  # each handed out once


def test_a_room_that_concluded_is_not_failed_at_its_lease_end() -> None:
    from shmhb.sglang.lease import DecodeHolds
    holds = DecodeHolds()
    holds.hold(3, 100, "r")
    assert holds.release(3) and not holds.release(3)
    assert holds.due(10**9) == [] and holds.held(3) is None


def test_the_lease_is_a_setting_with_its_unit_and_outlasts_the_wait() -> None:
    assert SglangSettings().grant_lease_s == 30.0
    assert SglangSettings.from_env({"SHMHB_SGLANG_GRANT_LEASE_S": "4",
                                    "SHMHB_SGLANG_GRANT_TIMEOUT_S": "1"}).grant_lease_s == 4.0
    with pytest.raises(InvalidConfig, match="SHMHB_SGLANG_GRANT_LEASE_S"):
        SglangSettings.from_env({"SHMHB_SGLANG_GRANT_LEASE_S": "0.5"})
    with pytest.raises(InvalidConfig, match="twice"):
        SglangSettings.from_env({"SHMHB_SGLANG_GRANT_LEASE_S": "3",
                                 "SHMHB_SGLANG_GRANT_TIMEOUT_S": "2"})
