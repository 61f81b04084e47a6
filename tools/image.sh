#!/usr/bin/env bash
# Builds the OCI images of the brain and the actuator from this workspace: offline, without a
# container daemon, reproducibly (the same commit gives the same digests).
#
#   tools/image.sh [--out DIR] [--repository REPO] [--no-build]
#
# For each of splitproxy-brain, splitproxy-actuator, splitproxy-check and splitproxy-echo it writes
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
#   - splitproxy-echo (tests/src/bin/splitproxy-echo.rs), as 65532, is the test server and client
#     that tools/cluster.sh runs as pods on a real cluster: the lab's pod server and probe.
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
      --bin splitproxy-brain --bin splitproxy-actuator --bin splitproxy-check \
      --bin splitproxy-echo
fi
bin_dir=$target_dir/$triple/release
images=("splitproxy-brain=$bin_dir/splitproxy-brain=65532:65532=")
images+=("splitproxy-actuator=$bin_dir/splitproxy-actuator=0:0=")
images+=("splitproxy-check=$bin_dir/splitproxy-check=65532:65532=")
images+=("splitproxy-echo=$bin_dir/splitproxy-echo=65532:65532=")

version=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"/\1/p' Cargo.toml)
commit=$(git rev-parse HEAD)
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct HEAD)}
mkdir -p "$out"

python3 "$repo_root/tools/oci_image.py" "$out" "$repository" "$version" "$commit" "${images[@]}"
