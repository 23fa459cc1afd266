"""The command line's shape: options that work wherever an operator types them."""

from __future__ import annotations


from shmhb.cli.main import build_parser



def test_verbose_works_before_and_after_the_subcommand() -> None:
    p = build_parser()
    assert p.parse_args(["status"]).verbose == 0
    assert p.parse_args(["-v", "status"]).verbose == 1
    assert p.parse_args(["status", "-v"]).verbose == 1
    assert p.parse_args(["gc", "-vv", "--yes"]).verbose == 2
    for cmd in ("pinger", "monitor", "events", "exporter", "units", "demo"):
        assert p.parse_args([cmd, "-v"]).verbose == 1, cmd
    assert p.parse_args(["forget", "-v", "k"]).verbose == 1

