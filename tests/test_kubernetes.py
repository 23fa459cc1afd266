"""The Kubernetes examples (packaging/kubernetes/, docs/KUBERNETES.md) parse and hold
the fields the guide relies on: /dev/shm shared, one uid, the secret's mode, the
pinger's addresses, the exporter's port scraped by the ServiceMonitor."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")  # PyYAML: part of the test extra

from .conftest import ROOT  # noqa: E402

K8S = Path(ROOT) / "packaging" / "kubernetes"
DOC = Path(ROOT) / "docs" / "KUBERNETES.md"


def docs() -> dict[str, list[dict[str, Any]]]:
    out = {}
    for p in sorted(K8S.glob("*.yaml")):
        out[p.name] = [d for d in yaml.safe_load_all(p.read_text()) if d]
    return out


def pod_spec(d: dict[str, Any]) -> dict[str, Any]:
    spec = d["spec"]
    return spec["template"]["spec"] if "template" in spec else spec  # type: ignore[no-any-return]


def running(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The containers that run beside the pod's main ones: native sidecars (init
    containers with ``restartPolicy: Always``) and the main containers."""
    return [c for c in spec.get("initContainers", []) if c.get("restartPolicy") == "Always"] \
        + spec["containers"]


def uses_board(c: dict[str, Any]) -> bool:
    return any(e.get("name") == "SHMHB_BOARD" for e in c.get("env", []))


def test_every_manifest_parses_and_is_in_the_guide() -> None:
    got = docs()
    assert set(got) == {"pinger-daemonset.yaml", "worker-pod.yaml", "sidecar-pod.yaml",
                        "servicemonitor.yaml"}
    text = DOC.read_text()
    for name, ds in got.items():
        assert f"`{name}`" in text, name
        for d in ds:
            assert d["apiVersion"] and d["kind"] and d["metadata"]["name"]


def test_dev_shm_is_shared_by_every_container_that_uses_the_board() -> None:
    for name, ds in docs().items():
        for d in ds:
            if d["kind"] not in ("DaemonSet", "Pod"):
                continue
            spec = pod_spec(d)
            board_users = [c for c in running(spec) if uses_board(c)]
            assert board_users, name
            if spec.get("hostIPC"):
                continue  # the node's /dev/shm, for every container of the pod
            # else: a memory-backed volume at /dev/shm in EVERY container of the pod
            mem = {v["name"] for v in spec.get("volumes", [])
                   if v.get("emptyDir", {}).get("medium") == "Memory"}
            for c in running(spec):
                mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
                assert mounts.get("/dev/shm") in mem, f"{name}: {c['name']} has no shared /dev/shm"


def test_one_uid_for_the_board_and_the_secret_0400_copied_0600() -> None:
    uids = set()
    for name, ds in docs().items():
        for d in ds:
            if d["kind"] not in ("DaemonSet", "Pod"):
                continue
            spec = pod_spec(d)
            uids.add(spec["securityContext"]["runAsUser"])
            for c in running(spec):
                assert c.get("securityContext", {}).get("runAsUser") in (None, spec["securityContext"]["runAsUser"])
                cmd = c.get("command", [])
                if "pinger" not in cmd:
                    continue
                secret_file = cmd[cmd.index("--secret-file") + 1]
                mounts = {m["name"]: m for m in c["volumeMounts"]}
                vols = {v["name"]: v for v in spec["volumes"]}
                # the Secret itself: read-only, defaultMode 0400, never in the pinger's container
                secrets = [v for v in vols.values() if "secret" in v]
                assert secrets and all(v["secret"]["defaultMode"] == 0o400 for v in secrets), name
                assert not any(m in mounts for m in (v["name"] for v in secrets)), name
                # the copy the pinger reads: 0600, its uid, a memory-backed volume, read-only here
                copy = next(m for m in mounts.values() if secret_file.startswith(m["mountPath"] + "/"))
                assert copy["readOnly"] is True and vols[copy["name"]]["emptyDir"]["medium"] == "Memory"
                init = " ".join(" ".join(i["command"]) for i in spec["initContainers"])
                uid = spec["securityContext"]["runAsUser"]
                assert f"install -m 0600 -o {uid} -g {uid}" in init and secret_file in init, name
    assert len(uids) == 1, uids


def test_a_pinger_in_the_engines_pod_is_a_native_sidecar_started_first() -> None:
    # The engine attaches to the board and never creates it: the pinger must be up (and
    # have created the board with its flags) before the engine starts.
    spec = pod_spec(docs()["sidecar-pod.yaml"][0])
    assert not any("pinger" in c.get("command", []) for c in spec["containers"])
    pinger = next(c for c in spec["initContainers"] if "pinger" in c.get("command", []))
    assert pinger["restartPolicy"] == "Always"
    assert pinger["startupProbe"]["exec"]["command"] == ["shmhb", "status", "--agent-only"]
    assert any(c["name"] == "engine" and uses_board(c) for c in spec["containers"])
    assert "native sidecar" in DOC.read_text()


def test_pinger_listens_where_peers_reach_it_and_the_exporter_is_scraped() -> None:
    got = docs()
    ds = got["pinger-daemonset.yaml"][0]
    spec = pod_spec(ds)
    assert ds["kind"] == "DaemonSet" and spec["hostIPC"] is True and spec["hostNetwork"] is True
    pinger = next(c for c in spec["containers"] if c["name"] == "pinger")
    listen = pinger["command"][pinger["command"].index("--listen") + 1]
    assert listen == "$(NODE_IP):45645"
    env = {e["name"]: e for e in pinger["env"]}
    assert env["NODE_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    proxy = next(c for c in spec["containers"] if c["name"] == "kube-rbac-proxy")
    ports = {p["name"]: p["containerPort"] for p in proxy["ports"]}
    assert ports == {"metrics": 9645}
    svc, sm = got["servicemonitor.yaml"]
    assert svc["kind"] == "Service" and sm["kind"] == "ServiceMonitor"
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in svc["spec"]["selector"].items())
    assert all(svc["metadata"]["labels"].get(k) == v for k, v in sm["spec"]["selector"]["matchLabels"].items())
    assert svc["spec"]["ports"][0]["targetPort"] == "metrics"
    assert sm["spec"]["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"]
    assert sm["metadata"]["namespace"] in sm["spec"]["namespaceSelector"]["matchNames"]


# -- hardening, probes, scheduling, the image ----------------------------------------------

DOCKERFILE = Path(ROOT) / "packaging" / "docker" / "Dockerfile"


def shmhb_containers() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(manifest, pod spec, container) for every container running the shmhb image."""
    out = []
    for name, ds in docs().items():
        for d in ds:
            if d["kind"] in ("DaemonSet", "Pod"):
                spec = pod_spec(d)
                for c in spec.get("initContainers", []) + spec["containers"]:
                    if "/shmhb:" in c["image"]:
                        out.append((name, spec, c))
    return out


def test_every_shmhb_container_is_hardened() -> None:
    got = shmhb_containers()
    assert len(got) >= 6
    for name, spec, c in got:
        sc = c.get("securityContext", {})
        assert sc.get("allowPrivilegeEscalation") is False, (name, c["name"])
        assert sc.get("readOnlyRootFilesystem") is True, (name, c["name"])
        assert sc.get("capabilities", {}).get("drop") == ["ALL"], (name, c["name"])
        added = set(sc.get("capabilities", {}).get("add", []))
        assert added <= {"CHOWN", "FOWNER"} and (not added or c["name"] == "secret-0600"), c["name"]
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name


def test_the_pinger_and_the_exporter_have_real_probes() -> None:
    for name, _, c in shmhb_containers():
        cmd = c.get("command", [])
        if "pinger" in cmd:
            assert c["livenessProbe"]["exec"]["command"] == ["shmhb", "status", "--agent-only"]
        elif "exporter" in cmd:
            for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
                if "ports" in c:
                    port = c["ports"][0]["name"]
                    assert c[probe]["httpGet"] == {"path": path, "port": port}, name
                else:  # listening on loopback: probed from inside the container
                    addr, port = (cmd[cmd.index(f) + 1] for f in ("--addr", "--port"))
                    assert f"http://{addr}:{port}{path}" in " ".join(c[probe]["exec"]["command"])


def test_the_daemonset_schedules_on_tainted_accelerator_nodes_first() -> None:
    spec = pod_spec(docs()["pinger-daemonset.yaml"][0])
    assert spec["priorityClassName"] == "system-node-critical"
    tol = spec["tolerations"]
    assert {"operator": "Exists", "effect": "NoSchedule"} in tol
    assert {"operator": "Exists", "effect": "NoExecute"} in tol


def test_the_image_runs_as_the_manifests_uid_with_the_c_path() -> None:
    text = DOCKERFILE.read_text()
    uid = int(text.split("ARG SHMHB_UID=")[1].split()[0])
    assert "USER ${SHMHB_UID}:${SHMHB_UID}" in text  # numeric: runAsNonRoot can check it
    assert "import shmhb, sys; sys.exit(0 if shmhb.native else 1)" in text  # the C path built
    uids = {pod_spec(d)["securityContext"]["runAsUser"] for ds in docs().values() for d in ds
            if d["kind"] in ("DaemonSet", "Pod")}
    assert uids == {uid}
    # what the image copies is what a wheel is built from
    for f in ("pyproject.toml", "setup.cfg", "setup.py", "README.md"):
        assert (Path(ROOT) / f).exists() and f in text
    guide = DOC.read_text()
    for needle in ("packaging/docker/Dockerfile", "pod-security.kubernetes.io/enforce",
                   "priorityClassName", "tolerations", "--agent-only", "/readyz",
                   "serving images run as root", "--board-group 1000"):
        assert needle in guide, needle


# -- metrics only to who may read them ---------------------------------------------------

def test_no_exporter_serves_unauthenticated_metrics_on_a_node_address() -> None:
    """With hostNetwork an exporter on the node's address serves keys, endpoints and
    peers to anyone who reaches the node, and a NetworkPolicy does not select hostNetwork
    pods: such an exporter listens on loopback, and kube-rbac-proxy (TLS, a TokenReview
    and a SubjectAccessReview per scrape) serves /metrics on the node's address."""
    got = docs()
    for name, ds in got.items():
        for d in ds:
            if d["kind"] not in ("DaemonSet", "Pod"):
                continue
            spec = pod_spec(d)
            for c in spec["containers"]:
                cmd = c.get("command", [])
                if "exporter" not in cmd:
                    continue
                addr = cmd[cmd.index("--addr") + 1]
                assert addr not in ("0.0.0.0", "::", "$(NODE_IP)"), (name, addr)
                if spec.get("hostNetwork"):
                    assert addr == "127.0.0.1" and not c.get("ports"), name
                    port = cmd[cmd.index("--port") + 1]
                    proxy = next(p for p in spec["containers"] if p["name"] == "kube-rbac-proxy")
                    assert f"--upstream=http://127.0.0.1:{port}/" in proxy["args"]
                    assert "--allow-paths=/metrics" in proxy["args"]
                    assert any(a.startswith("--secure-listen-address=$(NODE_IP):")
                               for a in proxy["args"])
                    sc = proxy["securityContext"]
                    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"]
                    assert sc["capabilities"]["drop"] == ["ALL"]
                    sa = spec["serviceAccountName"]
                    rbac = {(x["kind"], x["metadata"]["name"]): x for x in ds}
                    assert ("ServiceAccount", sa) in rbac
                    binding = next(x for x in ds if x["kind"] == "ClusterRoleBinding"
                                   and {"kind": "ServiceAccount", "name": sa,
                                        "namespace": "serving"} in x["subjects"])
                    role = rbac[("ClusterRole", binding["roleRef"]["name"])]
                    assert {r["resources"][0] for r in role["rules"]} == {
                        "tokenreviews", "subjectaccessreviews"}
                    readers = [x for x in ds if x["kind"] == "ClusterRole"
                               and {"nonResourceURLs": ["/metrics"], "verbs": ["get"]} in x["rules"]]
                    assert readers, name
    sm = got["servicemonitor.yaml"][1]
    ep = sm["spec"]["endpoints"][0]
    assert ep["scheme"] == "https" and ep["bearerTokenFile"].endswith("serviceaccount/token")
    guide = DOC.read_text()
    for needle in ("kube-rbac-proxy", "127.0.0.1", "NetworkPolicy", "shmhb-metrics-reader"):
        assert needle in guide, needle
