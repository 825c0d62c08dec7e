"""The Kubernetes manifests in deploy/k8s against the Kubernetes API's JSON schemas (strict: no unknown
fields), with the schemas the kubernetes-validate package ships (no network), and the scaling shape the
host-failure run relies on: every scaled-out role has two or more replicas, the singletons exactly one."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
NOT_RESOURCES = {"kustomization.yaml", "prometheus-adapter-values.yaml"}  # kustomize / helm inputs
VERSION = "1.30.0"


def _docs() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name not in NOT_RESOURCES:
            out += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return out


@pytest.mark.parametrize("name, doc", _docs(), ids=lambda v: v if isinstance(v, str) else v.get("kind", "?"))
def test_manifest_matches_the_kubernetes_schema(name: str, doc: dict) -> None:
    kubernetes_validate.validate(doc, VERSION, strict=True)  # raises ValidationError naming the field


def test_an_unknown_field_is_rejected() -> None:
    (_, doc), *_ = [(n, d) for n, d in _docs() if d["kind"] == "Deployment"]
    bad = dict(doc, spec=dict(doc["spec"], replica=2))
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, VERSION, strict=True)


def test_scaled_out_roles_have_replicas_and_singletons_have_one() -> None:
    replicas = {d["metadata"]["name"]: d["spec"].get("replicas") for _, d in _docs()
                if d["kind"] in ("Deployment", "StatefulSet")}
    for role in ("inference", "reward", "sandbox"):
        assert replicas[f"rollout-{role}"] >= 2, replicas
    for role in ("scheduler", "learner"):
        assert replicas[f"rollout-{role}"] == 1, replicas
