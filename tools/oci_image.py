#!/usr/bin/env python3
"""Writes single-layer OCI images (layout + archive) reproducibly; used by tools/image.sh (the
splitproxy images), tools/pause-image.sh (the real cluster's sandbox image) and, as a module
(`write_image`), by tools/e2e-images.py (the upstream e2e tests' images).

  oci_image.py OUT REPOSITORY VERSION COMMIT NAME=BINARY=USER=TAG ...

See tools/image.sh for what is inside an image and why it is reproducible.
"""
import gzip, hashlib, io, json, os, shutil, sys, tarfile, time

epoch = int(os.environ.get("SOURCE_DATE_EPOCH", "0"))
created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))

DESCRIPTIONS = {
    "splitproxy-brain": "splitproxy brain: watches the API server once and streams per-node nftables deltas over mTLS gRPC",
    "splitproxy-actuator": "splitproxy actuator: applies the brain's deltas to this node's nftables over netlink (needs CAP_NET_ADMIN)",
    "splitproxy-check": "splitproxy's helm test program: passes when every actuator's node holds its brain's latest state",
    "splitproxy-pause": "splitproxy's local pod sandbox (pause) image for tools/cluster.sh: sleeps until SIGTERM or SIGINT",
    "coredns": "CoreDNS, the cluster DNS of tools/cluster.sh (built from the Go module proxy)",
    "splitproxy-echo": "splitproxy's test server and probe client for pods on a real cluster (tools/cluster.sh)",
}

PASSWD = b"root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n"
GROUP = b"root:x:0:\nnonroot:x:65532:\n"


def dumps(obj):
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def tar_bytes(entries):
    """A tar of `entries` [(path, mode, bytes, or None for a directory, or ("symlink", target))],
    sorted, fixed metadata."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path, mode, data in sorted(entries, key=lambda e: e[0]):
            info = tarfile.TarInfo(path)
            info.mode = mode
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = epoch
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif isinstance(data, tuple):
                info.type = tarfile.SYMTYPE
                info.linkname = data[1]
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def gz(data):
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=6) as f:
        f.write(data)
    return buf.getvalue()


class Layout:
    def __init__(self, path):
        self.path = path
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(os.path.join(path, "blobs", "sha256"))

    def blob(self, media_type, data, annotations=None):
        digest = hashlib.sha256(data).hexdigest()
        with open(os.path.join(self.path, "blobs", "sha256", digest), "wb") as f:
            f.write(data)
        desc = {"mediaType": media_type, "digest": "sha256:" + digest, "size": len(data)}
        if annotations:
            desc["annotations"] = annotations
        return desc

    def finish(self, manifest_desc):
        with open(os.path.join(self.path, "oci-layout"), "wb") as f:
            f.write(dumps({"imageLayoutVersion": "1.0.0"}))
        index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
                 "manifests": [manifest_desc]}
        with open(os.path.join(self.path, "index.json"), "wb") as f:
            f.write(dumps(index))


def archive(layout_dir, dest):
    """The layout as one tar (an `oci-archive`), with the same fixed metadata as the layer."""
    entries = []
    for root, dirs, files in os.walk(layout_dir):
        rel = os.path.relpath(root, layout_dir)
        if rel != ".":
            entries.append((rel, 0o755, None))
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                entries.append((os.path.normpath(os.path.join(rel, name)), 0o644, f.read()))
    with open(dest + ".partial", "wb") as f:
        f.write(tar_bytes(entries))
    os.replace(dest + ".partial", dest)


def write_image(out, repository, commit, name, tag, description, entries, user, entrypoint,
                cmd=None, env=("PATH=/usr/bin",), author="tools/image.sh"):
    """One image `repository/name:tag` whose single layer holds `entries` (see tar_bytes), as
    a layout `out/name` and an archive `out/name.oci.tar`; returns the manifest digest."""
    layer = tar_bytes(entries)
    labels = {
        "org.opencontainers.image.title": name,
        "org.opencontainers.image.description": description,
        "org.opencontainers.image.version": tag,
        "org.opencontainers.image.revision": commit,
        "org.opencontainers.image.created": created,
        "org.opencontainers.image.licenses": "Apache-2.0",
    }
    image_config = {
        "User": user,
        "Entrypoint": entrypoint,
        "Env": list(env),
        "WorkingDir": "/",
        "Labels": labels,
    }
    if cmd:
        image_config["Cmd"] = cmd
    config = {
        "architecture": "amd64",
        "os": "linux",
        "created": created,
        "author": author,
        "config": image_config,
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(layer).hexdigest()]},
        "history": [{"created": created, "created_by": author + " " + name}],
    }
    layout = Layout(os.path.join(out, name))
    layer_desc = layout.blob("application/vnd.oci.image.layer.v1.tar+gzip", gz(layer))
    config_desc = layout.blob("application/vnd.oci.image.config.v1+json", dumps(config))
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": config_desc,
        "layers": [layer_desc],
        "annotations": labels,
    }
    manifest_desc = layout.blob(
        "application/vnd.oci.image.manifest.v1+json",
        dumps(manifest),
        {
            # The tag, as skopeo and podman read it (`oci-archive:FILE:TAG`) ...
            "org.opencontainers.image.ref.name": tag,
            # ... and the full name containerd gives the image on `ctr images import`.
            "io.containerd.image.name": f"{repository}/{name}:{tag}",
        },
    )
    layout.finish(manifest_desc)
    dest = os.path.join(out, name + ".oci.tar")
    archive(layout.path, dest)
    return manifest_desc["digest"], dest


def main():
    out, repository, version, commit = sys.argv[1:5]
    # name=binary=user=tag (an empty tag: the workspace version)
    images = [arg.split("=") for arg in sys.argv[5:]]
    for name, path, user, tag in images:
        tag = tag or version
        with open(path, "rb") as f:
            binary = f.read()
        entries = [
            ("etc", 0o755, None),
            ("etc/group", 0o644, GROUP),
            ("etc/passwd", 0o644, PASSWD),
            ("usr", 0o755, None),
            ("usr/bin", 0o755, None),
            ("usr/bin/" + name, 0o755, binary),
        ]
        digest, dest = write_image(out, repository, commit, name, tag, DESCRIPTIONS[name],
                                   entries, user, ["/usr/bin/" + name])
        print(name, tag, digest, dest)


if __name__ == "__main__":
    if "SOURCE_DATE_EPOCH" not in os.environ:
        sys.exit("oci_image.py: SOURCE_DATE_EPOCH must be set (reproducible timestamps)")
    main()
