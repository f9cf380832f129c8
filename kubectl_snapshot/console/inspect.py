"""What a snapshot holds, as data and as text: shared by `kubectl snapshot inspect` and
`ks-agent inspect` so both print the same thing."""

from __future__ import annotations

from typing import Any

from kubectl_snapshot.core.artifact import Artifact
from kubectl_snapshot.core.provenance import Provenance
from kubectl_snapshot.core.status import human_bytes


def inspect_data(artifact: Artifact, provenance: Provenance | None = None) -> dict[str, Any]:
    cfg, ref = artifact.config, artifact.reference
    sizes = {layer.digest: layer.size for layer in artifact.manifest.layers}
    data: dict[str, Any] = {
        "reference": f"{ref.registry}/{ref.repository}@{ref.digest}",
        "created": cfg.created,
        "group": cfg.group,
        "namespace": cfg.namespace,
        "stopped": cfg.stopped,
        "freezeMs": cfg.freeze_ms,
        "host": cfg.host.to_dict(),
        "containers": [
            {
                "name": c.name,
                "image": c.image,
                "imageDigest": c.image_digest,
                "layer": c.layer_digest,
                "layerSize": sizes.get(c.layer_digest, 0),
                **c.stats.to_dict(),
            }
            for c in cfg.containers
        ],
        "volumes": [v.to_dict() for v in cfg.volumes],
        "size": sum(sizes.values()) + artifact.manifest.config.size,
        "formatVersion": cfg.format_version,
    }
    if provenance is not None:
        data["provenance"] = provenance.to_dict()
    if cfg.pod is not None:
        data["pod"] = {"name": cfg.pod.name, "namespace": cfg.pod.namespace, "uid": cfg.pod.uid, "node": cfg.pod.node}
    enc = cfg.encryption
    data["encryption"] = (
        {"scheme": enc.scheme, "namespace": enc.namespace, "keyId": enc.key_id} if enc is not None else None
    )
    return data


def inspect_text(d: dict[str, Any]) -> str:
    h = d["host"]
    lines = [
        f"Reference:  {d['reference']}",
        f"Created:    {d['created']}",
        f"Group:      {d['group']} (namespace {d['namespace'] or '-'})",
    ]
    if d.get("pod"):
        p = d["pod"]
        lines.append(f"Pod:        {p['namespace']}/{p['name']} on node {p['node'] or '-'} (uid {p['uid'] or '-'})")
    enc = d.get("encryption")
    lines.append(
        f"Encrypted:  {enc['scheme']} with the key of namespace {enc['namespace']} ({enc['keyId']})"
        if enc
        else "Encrypted:  no: memory, rootfs diff and volumes are stored in clear"
    )
    lines += [
        f"Size:       {human_bytes(d['size'])}; frozen for {d['freezeMs']:.0f} ms; "
        f"{'stopped' if d['stopped'] else 'left running'} after the snapshot",
        f"Host:       {h['arch']} kernel {h['kernel']}, CRIU {h['criuVersion']}, runc {h['runcVersion']}, "
        f"containerd {h['containerdVersion']}, cgroup {h['cgroupVersion']}",
        "Containers:",
    ]
    for c in d["containers"]:
        lines.append(
            f"  {c['name']}: image {c['image']}; {c['processCount']} process(es), "
            f"{c['pagesWritten']} pages ({human_bytes(c['memoryBytes'])}) of memory; "
            f"layer {human_bytes(c['layerSize'])}"
        )
        for p in c["processes"]:
            lines.append(f"    pid {p['pid']:<6} ppid {p['ppid']:<6} {p['comm']}")
    for v in d["volumes"]:
        lines.append(f"Volume:     {v['name']} (from {v['source']})")
    lines += provenance_text(d.get("provenance"))
    return "\n".join(lines)


def provenance_text(p: dict[str, Any] | None) -> list[str]:
    if p is None:
        return []
    if not p["verified"]:
        return [f"Signature:  NOT VERIFIED: {p['reason']}"]
    o = p["origin"]
    return [
        f"Signature:  verified: {p['reason']}",
        f"Origin:     cluster {o['cluster'] or '-'}, namespace {o['namespace']}, pod {o['pod'] or '-'} "
        f"(uid {o['podUID'] or '-'}) on node {o['node'] or '-'}, at {o['created']}, format v{o['formatVersion']}",
    ]
