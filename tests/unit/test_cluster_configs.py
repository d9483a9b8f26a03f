"""The cluster manifests an operator starts from are valid and say what the README says."""

from __future__ import annotations

from pathlib import Path

import yaml

CLUSTER = Path(__file__).resolve().parents[2] / "cluster"


def test_ray_up_config_parses_and_has_a_spare_failure_domain() -> None:
    config = yaml.safe_load((CLUSTER / "ray-cluster.yaml").read_text())
    assert config["cluster_name"] == "kvstore"
    # 12 machines hold a 10+2 stripe; the 13th is the spare repair rebuilds onto.
    assert len(config["provider"]["worker_ips"]) >= 13
    assert any("ray start --head" in line for line in config["head_start_ray_commands"])


def test_kuberay_manifest_parses_with_one_pod_per_node() -> None:
    manifest = yaml.safe_load((CLUSTER / "kuberay.yaml").read_text())
    assert manifest["kind"] == "RayCluster"
    (storage,) = manifest["spec"]["workerGroupSpecs"]
    assert storage["minReplicas"] >= 12 and storage["replicas"] >= 13
    anti = storage["template"]["spec"]["affinity"]["podAntiAffinity"]
    terms = anti["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms[0]["topologyKey"] == "kubernetes.io/hostname"
