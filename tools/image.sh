#!/usr/bin/env bash
# Builds the OCI images of the brain and the actuator from this workspace: offline, without a
# container daemon, reproducibly (the same commit gives the same digests).
#
#   tools/image.sh [--out DIR] [--repository REPO] [--no-build]
#
# For each of splitproxy-brain, splitproxy-actuator and splitproxy-check it writes
#   DIR/<name>/              an OCI image layout (oci-layout, index.json, blobs/sha256/...)
#   DIR/<name>.oci.tar       the same layout as one archive, for `skopeo copy oci-archive:...`,
#                            `podman load -i` and `ctr images import`
# and prints one line per image: `<name> <tag> sha256:<manifest digest> <archive>`.
#
# What is inside: one layer holding the static binary (/usr/bin/<name>), /etc/passwd and
# /etc/group (root and nonroot 65532, so tools that read them show names), nothing else: no shell,
# no package manager, no libc (the binaries are linked with `+crt-static`).
#   - The brain runs as 65532:65532: it only talks to the API server and serves gRPC/HTTP on
#     unprivileged ports.
#   - The actuator runs as root (uid 0) with every capability dropped but NET_ADMIN (the chart
#     does this): Kubernetes grants added capabilities to the effective set of uid 0 only (no
#     ambient capabilities for other users), and file capabilities are ignored under
#     no_new_privs (allowPrivilegeEscalation: false). NET_ADMIN covers both things it does to
#     the kernel: nf_tables transactions and deleting conntrack entries over ctnetlink.
#   - splitproxy-check (tests/src/bin/splitproxy-check.rs), as 65532, is the chart's `helm test`
#     program: it passes when every actuator's node is in sync.
#
# Reproducible: the layer is a tar written with sorted entries, uid/gid 0, no user or group names
# and every mtime set to SOURCE_DATE_EPOCH (default: the commit time of HEAD), compressed with
# gzip's header mtime 0 and no file name; the config's only timestamp is that same time; JSON is
# written with sorted keys. Labels and annotations carry the version (workspace Cargo.toml) and
# the git commit (org.opencontainers.image.version / .revision).
#
# Pushing to a registry (no daemon needed):
#   skopeo copy oci-archive:DIR/splitproxy-brain.oci.tar docker://REGISTRY/splitproxy-brain:TAG
set -euo pipefail

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo_root"

target_dir=${CARGO_TARGET_DIR:-$repo_root/target}
out=$target_dir/oci
repository=ghcr.io/splitproxy
build=1
while (($#)); do
  case $1 in
    --out) out=$2; shift 2 ;;
    --repository) repository=$2; shift 2 ;;
    --no-build) build=0; shift ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) echo "image.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

triple=x86_64-unknown-linux-gnu
if ((build)); then
  # Static binaries: no libc in the image. Only this target is installed here. The checkout's,
  # the target directory's and the registry's paths are remapped (for Rust and for the C that
  # ring compiles), so where they lie does not enter the binaries.
  cargo_home=${CARGO_HOME:-$HOME/.cargo}
  remap="$repo_root=/build/splitproxy $target_dir=/build/target $cargo_home=/build/cargo"
  rustflags="-C target-feature=+crt-static"
  cflags=""
  for m in $remap; do
    rustflags+=" --remap-path-prefix=$m"
    cflags+=" -ffile-prefix-map=$m"
  done
  RUSTFLAGS=$rustflags CFLAGS_x86_64_unknown_linux_gnu=$cflags CARGO_TARGET_DIR=$target_dir \
    cargo build --locked --release --target "$triple" \
      -p splitproxy-brain -p splitproxy-actuator -p splitproxy-tests \
      --bin splitproxy-brain --bin splitproxy-actuator --bin splitproxy-check
fi
bin_dir=$target_dir/$triple/release
images=("splitproxy-brain=$bin_dir/splitproxy-brain=65532:65532=")
images+=("splitproxy-actuator=$bin_dir/splitproxy-actuator=0:0=")
images+=("splitproxy-check=$bin_dir/splitproxy-check=65532:65532=")

version=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"/\1/p' Cargo.toml)
commit=$(git rev-parse HEAD)
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct HEAD)}
mkdir -p "$out"

python3 - "$out" "$repository" "$version" "$commit" "${images[@]}" <<'PY'
import gzip, hashlib, io, json, os, shutil, sys, tarfile, time

out, repository, version, commit = sys.argv[1:5]
# name=binary=user=tag (an empty tag: the workspace version)
images = [arg.split("=") for arg in sys.argv[5:]]
epoch = int(os.environ["SOURCE_DATE_EPOCH"])
created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))

DESCRIPTIONS = {
    "splitproxy-brain": "splitproxy brain: watches the API server once and streams per-node nftables deltas over mTLS gRPC",
    "splitproxy-actuator": "splitproxy actuator: applies the brain's deltas to this node's nftables over netlink (needs CAP_NET_ADMIN)",
    "splitproxy-check": "splitproxy's helm test program: passes when every actuator's node holds its brain's latest state",
}

PASSWD = b"root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n"
GROUP = b"root:x:0:\nnonroot:x:65532:\n"


def dumps(obj):
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def tar_bytes(entries):
    """A tar of `entries` [(path, mode, bytes or None for a directory)], sorted, fixed metadata."""
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


for name, path, user, tag in images:
    tag = tag or version
    description = DESCRIPTIONS[name]
    with open(path, "rb") as f:
        binary = f.read()
    layer = tar_bytes([
        ("etc", 0o755, None),
        ("etc/group", 0o644, GROUP),
        ("etc/passwd", 0o644, PASSWD),
        ("usr", 0o755, None),
        ("usr/bin", 0o755, None),
        ("usr/bin/" + name, 0o755, binary),
    ])
    labels = {
        "org.opencontainers.image.title": name,
        "org.opencontainers.image.description": description,
        "org.opencontainers.image.version": tag,
        "org.opencontainers.image.revision": commit,
        "org.opencontainers.image.created": created,
        "org.opencontainers.image.licenses": "Apache-2.0",
    }
    config = {
        "architecture": "amd64",
        "os": "linux",
        "created": created,
        "author": "tools/image.sh",
        "config": {
            "User": user,
            "Entrypoint": ["/usr/bin/" + name],
            "Env": ["PATH=/usr/bin"],
            "WorkingDir": "/",
            "Labels": labels,
        },
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(layer).hexdigest()]},
        "history": [{"created": created, "created_by": "tools/image.sh " + name}],
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
    print(name, tag, manifest_desc["digest"], dest)
PY
