"""Host-side fault kinds of the chaos harness, as a mixin of ``Harness``.

Each runs one actor of ``localactors`` on a throwaway board next to the cluster (so it
cannot disturb the verdicts the checker follows) and breaches ``local-<kind>`` when the
actor reports a failure:

- ``embedded_stall``: a daemon takes the role from a worker's embedded agent, and a kill
  is DEAD within 1 s while that worker is stopped; a daemon started while the worker
  holding the role is stopped replaces it within 10 s, and the worker stands down;
- ``registry_attach``: attach, ``status`` and a new worker's registration do not wait
  for a stopped registry holder, and that worker's kill is DEAD within 1 s;
- ``torn_settings``: a torn settings write reads degraded (never "not configured" with
  exit 0) and a pinger with options heals it;
- ``forget_fds``: ``forget_after_s`` under a connection flood at 96 fds keeps the
  pinger running and forgets the dead once fds are back;
- ``settings_conflict``: a stray pinger with other flags is refused and changes no
  stored setting, authentication included;
- ``stopped_holder``: a host whose daemon holder is SIGSTOPped is heard again by the
  host that follows it while the daemon is still stopped.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

from ..conftest import ROOT
from .invariants import NS, actor_result, now_ns
from .schedule import Fault

#: fault kind -> (actor, whether it needs an address of its own)
LOCAL_ACTORS = {"embedded_stall": ("embstall", False), "registry_attach": ("regattach", False),
                "torn_settings": ("torn", True), "forget_fds": ("forgetfds", True),
                "settings_conflict": ("conflict", True), "stopped_holder": ("stoppedholder", True)}


class LocalFaults:
    """Mixed into ``Harness``; uses its cluster, env, jobs and checker."""

    cluster: Any
    env: dict[str, str]
    jobs: list[Any]

    def _local_fault(self, f: Fault) -> bool:
        actor, needs_ip = LOCAL_ACTORS[f.kind]
        if any(what == f.kind for _p, _d, what, _done in self.jobs):
            return False  # one at a time of each kind
        args = [f"127.0.2.{2 + f.salt % 200}", str(self.cluster.port)] if needs_ip else []
        p = subprocess.Popen([sys.executable, "-m", "tests.chaos.localactors", actor, *args],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=ROOT,
                             env=self.env)
        self.note(f"FAULT {f.kind}: {actor} on a throwaway board", "*")  # type: ignore[attr-defined]

        def done(out: str, rc: int) -> None:
            got = actor_result(out, rc)
            if got.get("ok"):
                self.checker.stats[f"local-{f.kind}"] += 1  # type: ignore[attr-defined]
                if "kill_ms" in got:
                    self.checker.lat[f"local-{f.kind}-kill"].append(got["kill_ms"] / 1e3)  # type: ignore[attr-defined]
            else:
                self.breach(f"local-{f.kind}", str(got.get("why")), "*")  # type: ignore[attr-defined]
        self.jobs.append((p, now_ns() + 90 * NS, f.kind, done))
        return True

    def _f_embedded_stall(self, f: Fault) -> bool:
        return self._local_fault(f)

    def _f_registry_attach(self, f: Fault) -> bool:
        return self._local_fault(f)

    def _f_torn_settings(self, f: Fault) -> bool:
        return self._local_fault(f)

    def _f_forget_fds(self, f: Fault) -> bool:
        return self._local_fault(f)

    def _f_settings_conflict(self, f: Fault) -> bool:
        return self._local_fault(f)

    def _f_stopped_holder(self, f: Fault) -> bool:
        return self._local_fault(f)
