"""The deployment files in deploy/: the example config is valid and the units/manifests agree with it."""

from __future__ import annotations

import configparser
import re
from pathlib import Path
from typing import Any

import pytest

from engine.config import ROLES, load_config

import yaml  # noqa: E402  (pyyaml, a dependency of transformers)

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _k8s() -> list[dict[str, Any]]:
    docs = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d and "kind" in d]
    return docs


def test_example_config_is_complete_and_valid() -> None:
    cfg = load_config(DEPLOY / "examples" / "deploy.toml", environ={})
    assert cfg.roles == list(ROLES)
    assert cfg.telemetry.http_port == 9100 and cfg.telemetry.control_token is None  # secrets come from the env
    assert cfg.kafka.sasl_password is None and cfg.nats.password is None
    text = (DEPLOY / "examples" / "deploy.toml").read_text()
    for section in ("kafka", "nats", "scheduler", "inference", "sandbox", "reward", "learner", "telemetry",
                    "supervision"):
        assert f"[{section}]" in text


def _deploy_configs() -> list[tuple[str, str]]:
    """Every config in deploy/: the example files and the TOML the ConfigMap carries."""
    configs = [(str(p), p.read_text()) for p in sorted((DEPLOY / "examples").glob("*.toml"))]
    for d in _k8s():
        if d["kind"] == "ConfigMap":
            configs += [(f"configmap {d['metadata']['name']}: {key}", text)
                        for key, text in d["data"].items() if key.endswith(".toml")]
    return configs


def test_every_sglang_config_names_the_model_it_serves(tmp_path: Path) -> None:
    configs = _deploy_configs()
    assert len(configs) >= 2
    for i, (name, text) in enumerate(configs):
        path = tmp_path / f"{i}.toml"
        path.write_text(text)
        cfg = load_config(path, environ={})
        if cfg.inference.backend == "sglang":
            assert cfg.inference.model_dir, name
            assert cfg.inference.urls, name


def test_k8s_mounts_the_served_model_where_the_config_says() -> None:
    model_dir = load_config(DEPLOY / "examples" / "deploy.toml", environ={}).inference.model_dir
    for d in _k8s():
        if d["kind"] in ("Deployment", "StatefulSet"):
            [container] = d["spec"]["template"]["spec"]["containers"]
            args = container["args"]
            if args[args.index("--role") + 1] in ("inference", "learner"):
                mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
                assert model_dir in mounts and mounts[model_dir].get("readOnly"), d["metadata"]["name"]


def test_k8s_inference_pods_get_the_api_key_from_the_secret() -> None:
    docs = _k8s()
    [secret] = [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == "rollout-secrets"]
    assert "ROLLOUT__INFERENCE__API_KEY" in secret["stringData"]
    [inference] = [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "rollout-inference"]
    [container] = inference["spec"]["template"]["spec"]["containers"]
    assert {"secretRef": {"name": "rollout-secrets"}} in container["envFrom"]
    assert load_config(DEPLOY / "examples" / "deploy.toml", environ={}).inference.api_key is None  # not in the file


def test_configmap_carries_the_example_config() -> None:
    [cm] = [d for d in _k8s() if d["kind"] == "ConfigMap"]
    assert cm["data"]["deploy.toml"] == (DEPLOY / "examples" / "deploy.toml").read_text()


@pytest.mark.parametrize("role", ROLES)
def test_systemd_unit_runs_its_role_and_drains(role: str) -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read(DEPLOY / "systemd" / f"rollout-{role}@.service")
    service = unit["Service"]
    assert re.search(rf"^/opt/rollout/bin/rollout run --config /etc/rollout/deploy.toml --role {role}\b",
                     service["ExecStart"])
    assert service["KillSignal"] == "SIGTERM" and service["Restart"] == "on-failure"
    drain = load_config(DEPLOY / "examples" / "deploy.toml", environ={}).supervision.drain_timeout_s
    assert float(service["TimeoutStopSec"]) > drain


def test_k8s_one_workload_per_role() -> None:
    docs = _k8s()
    drain = load_config(DEPLOY / "examples" / "deploy.toml", environ={}).supervision.drain_timeout_s
    workloads = {}
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            [container] = d["spec"]["template"]["spec"]["containers"]
            args = container["args"]
            workloads[args[args.index("--role") + 1]] = d
            assert d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > drain
            assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert set(workloads) == set(ROLES)
    assert workloads["scheduler"]["spec"]["replicas"] == 1 and workloads["learner"]["spec"]["replicas"] == 1
    learner_volumes = workloads["learner"]["spec"]["template"]["spec"]["volumes"]
    claims = {v["persistentVolumeClaim"]["claimName"] for v in learner_volumes if "persistentVolumeClaim" in v}
    assert claims == {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    sandbox = workloads["sandbox"]["spec"]["template"]["spec"]["containers"][0]
    assert sandbox["securityContext"]["runAsUser"] == 0
    [hpa] = [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == workloads["sandbox"]["metadata"]["name"]
    assert hpa["spec"]["metrics"][0]["type"] == "External"
    kustomization = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    assert all((DEPLOY / "k8s" / r).exists() for r in kustomization["resources"])
