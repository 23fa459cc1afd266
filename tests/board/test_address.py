"""The address door (shmhb.board.address): one validator for endpoints, watches, --peer and
--listen, with the wire's limits, and what it refuses at register/watch/PingerConfig."""

from __future__ import annotations

import pytest

import shmhb
from shmhb.board.core import board_words
from shmhb.board.address import (
    MAX_ADDRESS_TEXT, check_endpoint, format_address, is_canonical, is_endpoint, parse_address,
)
from shmhb.board.config import PingerConfig, parse_hostport
from shmhb.errors import InvalidAddress
from shmhb.net.protocol import MAX_ENDPOINT_BYTES


K8S = "decode-rank-3.decode-headless.llm-inference-prod.svc.cluster.local:30003"

REFUSED = [
    "a b:1", "*:1", "hé:1", "[a:b]:1", "-x:1", "x-:1", "[h:99999]:1", "host_a, host_b",
    "host_a:1", "not an ip:45645", "h:0", "h:65536", "h:99999", "h:01", "h:+1", "h: 1",
    "h:1\n", " h:1", ":1", "[]:1", "[::1", "[::1]x:1", "[10.0.0.1]:1", "1.2.3:4",
    "0x7f:1", "123:1", "127.1:1", "01.2.3.4:1", "h.:1", ".h:1", "a..b:1", "h:1:2",
    "[fe80::1%eth0]:1", "h:١", "x" * 64 + ":1", K8S, "h", "10.0.0.2", "", "h,g:1",
]


@pytest.mark.parametrize("text", REFUSED)
def test_endpoint_door_refuses(text: str) -> None:
    with pytest.raises(InvalidAddress):
        check_endpoint(text)
    assert not is_endpoint(text)


@pytest.mark.parametrize("text,canonical", [
    ("10.0.0.2:30003", "10.0.0.2:30003"), ("[::1]:5", "[::1]:5"), ("[0::A]:5", "[::a]:5"),
    ("localhost:1", "localhost:1"), ("a-b.C9:65535", "a-b.c9:65535"),
    ("pod-3.svc:30003", "pod-3.svc:30003"), ("x" * 61 + ":1", "x" * 61 + ":1"),
])
def test_endpoint_door_round_trips(text: str, canonical: str) -> None:
    assert check_endpoint(text) == canonical
    a = parse_address(canonical, need_port=True)
    assert str(a) == canonical == format_address(a.host, a.port)
    assert check_endpoint(canonical) == canonical and is_endpoint(canonical)


def test_limits_are_the_wires() -> None:
    assert MAX_ENDPOINT_BYTES == 63 and MAX_ADDRESS_TEXT == 63
    ok = "h" * 60 + ":12"  # 63 bytes
    assert check_endpoint(ok) == ok
    with pytest.raises(InvalidAddress, match="63"):
        check_endpoint("h" * 60 + ":123")
    with pytest.raises(InvalidAddress):
        parse_address("a." * 32 + "b")  # 65 characters: over a board row and a frame


def test_hosts_and_default_ports() -> None:
    assert parse_hostport("10.0.0.2") == ("10.0.0.2", shmhb.DEFAULT_PORT)
    assert parse_hostport("[::1]:7") == ("::1", 7)
    assert str(parse_address("::1")) == "[::1]" and parse_address("::1").port is None
    assert is_canonical("10.0.0.2") and not is_canonical("[0::1]")
    with pytest.raises(InvalidAddress):
        parse_hostport("a b")


def test_an_octet_above_255_is_named_as_such() -> None:
    # not "it reads as a number": the operator wrote an IPv4 address with a typo
    with pytest.raises(InvalidAddress, match="300 is above 255"):
        parse_hostport("127.0.0.300")
    with pytest.raises(InvalidAddress, match="reads as a number"):
        parse_hostport("127.1")  # the resolver's shorthand for 127.0.0.1: still refused so


def test_invalid_address_is_both_key_and_config_error() -> None:
    e = InvalidAddress("x")
    assert isinstance(e, shmhb.InvalidKey) and isinstance(e, shmhb.InvalidConfig)
    assert isinstance(e, ValueError) and isinstance(e, shmhb.ShmhbError)


def test_register_refuses_a_kubernetes_service_name(board: shmhb.Board) -> None:
    with pytest.raises(InvalidAddress, match=r"wire limit is 63 bytes: advertise the pod IP"):
        board.register("decode-rank-3", endpoints=(K8S,), agent=False)
    assert board.slot("decode-rank-3") is None and board.slots() == []


@pytest.mark.parametrize("text", ["a b:1", "*:1", "10.0.0.2", "not an ip:45645", "[a:b]:1"])
def test_register_and_watch_refuse(board: shmhb.Board, text: str) -> None:
    with pytest.raises(InvalidAddress):
        board.register("k", endpoints=(text,), agent=False)
    with pytest.raises(InvalidAddress):
        board.watch(text)
    assert board_words(board).watches.watched_hosts() == {} and board.slots() == []


def test_register_stores_the_canonical_endpoint(board: shmhb.Board) -> None:
    with board.register("k", endpoints=("[0::1]:30003",), agent=False):
        assert board.slot("k").endpoints == ("[::1]:30003",)  # type: ignore[union-attr]
    board.watch("[0::1]:30003")
    assert board_words(board).watches.watched_hosts() == {"[::1]": 1}


@pytest.mark.parametrize("peer", ["host_a, host_b", "a b", "*", "hé", "[a:b]:1", "-x:1",
                                  "[h:99999]:1", "h:0", "x" * 64])
def test_pinger_config_refuses_bad_peers(peer: str) -> None:
    with pytest.raises(InvalidAddress):
        PingerConfig(listen="127.0.0.1:45645", peers=(peer,))


@pytest.mark.parametrize("listen", ["*:1", "0.0.0.0:0", "a b:1", "h:99999", "[::1"])
def test_pinger_config_refuses_bad_listen(listen: str) -> None:
    with pytest.raises(InvalidAddress):
        PingerConfig(listen=listen)


def test_pinger_config_canonical() -> None:
    cfg = PingerConfig(listen="10.0.0.1", peers=("10.0.0.2", "[0::2]:7"))
    assert cfg.listen == "10.0.0.1:45645" and cfg.peers == ("10.0.0.2", "[::2]:7")
    with pytest.raises(shmhb.InvalidConfig):
        PingerConfig(peers="10.0.0.2")  # type: ignore[arg-type]
