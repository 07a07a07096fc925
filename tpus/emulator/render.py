"""Turn the emulator's JSON node records into the API's own message classes, for
either API version the portal speaks (``tpu_v2`` or ``tpu_v2alpha1``)."""

from __future__ import annotations

from datetime import datetime
from types import ModuleType
from typing import Any

from tpus.emulator.catalog import accelerator_family

_CONFIG_TYPES = {
    "v2": "V2",
    "v3": "V3",
    "v4": "V4",
    "v5litepod": "V5LITE_POD",
    "v5p": "V5P",
    "v6e": "V6E",
}


def split_node_name(name: str) -> tuple[str, str, str]:
    """``projects/p/locations/z/nodes/n`` → (p, z, n)."""
    parts = name.split("/")
    return parts[1], parts[3], parts[5]


def render_node(types: ModuleType, name: str, record: dict[str, Any]):
    """The ``types.Node`` message for a stored record."""
    project, zone, _ = split_node_name(name)
    config_type = _CONFIG_TYPES.get(accelerator_family(record["accelerator_type"]), "")
    endpoints = []
    for worker in record["workers"]:
        endpoint = types.NetworkEndpoint(ip_address=worker["internal_ip"], port=8470)
        # A worker without an external address has no access config at all.
        if worker["external_ip"]:
            endpoint.access_config = types.AccessConfig(external_ip=worker["external_ip"])
        endpoints.append(endpoint)
    node = types.Node(
        name=name,
        id=record["id"],
        accelerator_type=record["accelerator_type"],
        runtime_version=record["runtime_version"],
        state=types.Node.State[record["state"]],
        health=types.Node.Health[record["health"]],
        health_description=record["health_description"],
        description=record.get("description", ""),
        labels=record["labels"],
        metadata=record.get("metadata", {}),
        create_time=datetime.fromisoformat(record["create_time"].replace("Z", "+00:00")),
        network_endpoints=endpoints,
        network_config=types.NetworkConfig(
            network=f"projects/{project}/global/networks/default",
            subnetwork=f"projects/{project}/regions/{zone.rsplit('-', 1)[0]}/subnetworks/default",
            enable_external_ips=True,
        ),
        scheduling_config=types.SchedulingConfig(
            preemptible=record["preemptible"], spot=record.get("spot", False)
        ),
        data_disks=[
            types.AttachedDisk(
                source_disk=disk["source_disk"], mode=types.AttachedDisk.DiskMode[disk["mode"]]
            )
            for disk in record["data_disks"]
        ],
        api_version=_api_version(types),
    )
    if config_type:
        node.accelerator_config = types.AcceleratorConfig(
            type_=types.AcceleratorConfig.Type[config_type], topology=record["topology"]
        )
    return node


def _api_version(types: ModuleType):
    versions = types.Node.ApiVersion.__members__
    return versions["V2"] if "V2" in versions else versions["V2_ALPHA1"]
