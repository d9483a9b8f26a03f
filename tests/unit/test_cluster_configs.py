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


def _ray_starts(commands: list[str]) -> list[str]:
    return [command for command in commands if "ray start" in command]


def test_ray_up_config_starts_every_node_with_token_auth_and_ships_the_token() -> None:
    config = yaml.safe_load((CLUSTER / "ray-cluster.yaml").read_text())
    starts = _ray_starts(config["head_start_ray_commands"] + config["worker_start_ray_commands"])
    assert len(starts) == 2  # the head's and the workers'
    for command in starts:
        # `ray start` leaves auth off unless told (only ray.init() turns it on by default).
        assert command.startswith("RAY_AUTH_MODE=token ray start"), command
    # Every machine gets the token file Ray reads by default, private to its user.
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    assert "chmod 600 ~/.ray/auth_token" in config["setup_commands"]
    assert "RAY_AUTH_MODE=disabled" not in (CLUSTER / "ray-cluster.yaml").read_text()


def test_kuberay_manifest_gives_every_ray_container_token_auth() -> None:
    manifest = yaml.safe_load((CLUSTER / "kuberay.yaml").read_text())
    templates = [manifest["spec"]["headGroupSpec"]["template"]] + [
        group["template"] for group in manifest["spec"]["workerGroupSpecs"]
    ]
    for template in templates:
        for container in template["spec"]["containers"]:
            env = {item["name"]: item for item in container["env"]}
            assert env["RAY_AUTH_MODE"]["value"] == "token", container["name"]
            secret = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
            assert secret == {"name": "kvstore-ray-token", "key": "auth_token"}, container["name"]


def test_cluster_configs_say_how_to_add_ray_tls_and_a_private_bind_address() -> None:
    # The variables Ray 2.60 reads for TLS (ray/_common/tls_utils.py, _raylet), by their names.
    for name in ("ray-cluster.yaml", "kuberay.yaml", "README.md"):
        text = (CLUSTER / name).read_text()
        for variable in (
            "RAY_USE_TLS",
            "RAY_TLS_SERVER_CERT",
            "RAY_TLS_SERVER_KEY",
            "RAY_TLS_CA_CERT",
        ):
            assert variable in text, (name, variable)
        assert "private" in text and "every interface" in text, name
