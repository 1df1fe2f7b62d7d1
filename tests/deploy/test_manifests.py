"""deploy/kserve/: schema-valid (kserve and kubernetes SDK models), and consistent with the
server they run: the probes hit real routes, the arguments parse and pass the server's own
start-up checks, ports, GPUs, the runtime, the model format and the volume line up."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("kserve", reason="the kserve SDK is not installed (the server's test extra "
                    "installs it: pip install './server[test]')")

sys.path.insert(0, str(Path(__file__).parent))
from k8s_schema import load_all, validate  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((REPO / "deploy" / "kserve").glob("*.yaml"))


def _docs() -> dict[str, dict[str, Any]]:
    return {doc["kind"]: doc for _, doc in load_all(MANIFESTS)}


def test_every_manifest_is_schema_valid() -> None:
    assert {p.name for p in MANIFESTS} >= {"servingruntime.yaml", "inferenceservice.yaml",
                                           "pvc.yaml"}
    for path, doc in load_all(MANIFESTS):
        assert validate(doc) == [], path


def _mutated(kind: str, edit) -> list[str]:  # type: ignore[no-untyped-def]
    doc = copy.deepcopy(_docs()[kind])
    edit(doc)
    return validate(doc)


def _container(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["containers"][0]


@pytest.mark.parametrize("kind,edit,expect", [
    ("ServingRuntime", lambda d: _container(d).update(readinesProbe=_container(d)
                                                      ["readinessProbe"]), "readinesProbe"),
    ("ServingRuntime", lambda d: d["spec"].pop("containers"), "containers"),
    ("ServingRuntime", lambda d: _container(d)["ports"][0].update(containerPort="8080"),
     "containerPort"),
    ("ServingRuntime", lambda d: _container(d).pop("name"), "name"),
    ("ServingRuntime", lambda d: d["spec"].update(protocolVersions="v2"), "expected a list"),
    ("ServingRuntime", lambda d: _container(d)["livenessProbe"]["httpGet"].update(
        pathh="/x"), "pathh"),
    ("InferenceService", lambda d: d["spec"]["predictor"].update(minReplicas="two"),
     "minReplicas"),
    ("InferenceService", lambda d: d["spec"]["predictor"]["model"].pop("modelFormat"),
     "model_format"),
    ("InferenceService", lambda d: d["spec"]["predictor"].update(replicas=2), "replicas"),
    ("InferenceService", lambda d: d["spec"]["predictor"]["volumes"][0].update(
        persistentVolumeClaim={"claim": "x"}), "persistentVolumeClaim"),
    ("InferenceService", lambda d: d.update(apiVersion="serving.kserve.io/v1"), "no schema"),
    ("PersistentVolumeClaim", lambda d: d["spec"].update(accessMode=["ReadWriteMany"]),
     "accessMode"),
    ("PersistentVolumeClaim", lambda d: d["spec"]["resources"].update(requests=[200]),
     "requests"),
])
def test_a_wrong_manifest_fails_the_check(kind: str, edit, expect: str) -> None:  # type: ignore[no-untyped-def]
    errors = _mutated(kind, edit)
    assert errors, f"{kind}: the broken manifest passed"
    assert any(expect in e for e in errors), errors


def test_manifests_fit_the_server() -> None:
    from moe_gemm_server.cli import settings_from_args
    from moe_gemm_server.security import check_exposure

    docs = _docs()
    runtime, isvc = docs["ServingRuntime"], docs["InferenceService"]
    pvc = docs["PersistentVolumeClaim"]
    c = _container(runtime)
    # the arguments are the server's own flags, and with the secret's admin key in the
    # environment they pass the exposure check (a non-loopback bind needs one)
    settings = settings_from_args(c["args"])
    env = {e["name"]: e for e in c["env"]}
    assert env["MOE_GEMM_ADMIN_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "moe-gemm-keys"
    assert "value" not in env["MOE_GEMM_ADMIN_KEY"]  # never a key in the manifest
    with_key = settings.model_copy(update={"admin_key": "from-the-secret",
                                           "api_key": ["from-the-secret"]})
    assert check_exposure(with_key) == [  # only the TLS note: TLS ends at the ingress
        f"listening on {settings.host} without TLS: keys cross the network in clear text "
        "(see --ssl-certfile / --ssl-keyfile)"]
    port = c["ports"][0]["containerPort"]
    assert settings.port == port
    # probes: the server's health routes, on its port
    probes = {name: c[name]["httpGet"] for name in ("startupProbe", "livenessProbe",
                                                     "readinessProbe")}
    assert probes["readinessProbe"]["path"] == "/v2/health/ready"
    assert probes["livenessProbe"]["path"] == "/v2/health/live"
    for probe in probes.values():
        assert probe["port"] == port
    # KServe wiring: v2, the runtime and the model format match, one GPU per replica
    assert runtime["spec"]["protocolVersions"] == ["v2"]
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["protocolVersion"] == "v2"
    assert model["modelFormat"]["name"] in [f["name"] for f in
                                            runtime["spec"]["supportedModelFormats"]]
    for res in (c["resources"], model["resources"]):
        assert res["limits"]["nvidia.com/gpu"] == "1"
    assert isvc["spec"]["predictor"]["minReplicas"] >= 2
    # the weight sets' volume: the PVC, shared by every replica, holding --data-dir
    vol = isvc["spec"]["predictor"]["volumes"][0]
    assert vol["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    mount = model["volumeMounts"][0]
    assert mount["name"] == vol["name"]
    assert Path(mount["mountPath"]) in settings.data_dir.parents
    assert settings.sync_interval_s > 0  # replicas notice each other's uploads
    # the drain fits in the grace period
    assert isvc["spec"]["predictor"]["terminationGracePeriodSeconds"] > settings.drain_timeout_s
    # the volume is writable by the user the server runs as (docker/README.md, "Data and
    # ownership"): without fsGroup a fresh root-owned volume refused every replica's start
    assert isvc["spec"]["predictor"]["securityContext"]["fsGroup"] == \
        c["securityContext"]["runAsUser"]


def test_probe_paths_are_real_routes(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from moe_gemm_server import Settings, create_app
    from moe_gemm_server.engine import Engine

    c = _container(_docs()["ServingRuntime"])
    app = create_app(Settings(data_dir=tmp_path), engine=Engine("cpu", warmup_rows=[1]))
    with TestClient(app) as client:
        for name in ("startupProbe", "livenessProbe", "readinessProbe"):
            path = c[name]["httpGet"]["path"]
            status = client.get(path).status_code
            assert status in (200, 503), (name, path, status)  # 404 = not our route
