#!/usr/bin/env bash
# Builds the pod sandbox (pause) image of tools/cluster.sh's nodes, offline: a static Go binary
# (tools/pause) in a one-layer OCI image written by tools/oci_image.py, reproducibly, the same way
# as the splitproxy images (tools/image.sh).
#
#   tools/pause-image.sh [--out DIR]
#
# Writes DIR/splitproxy-pause.oci.tar (default DIR: $SPLITPROXY_TOOLS_CACHE/pause, next to the
# cluster binaries) and prints `<name> <tag> sha256:<manifest digest> <archive>`. The archive's
# index names the image localhost/splitproxy-pause:1 (annotation io.containerd.image.name), so
# `ctr -n k8s.io images import` gives it that name, which the nodes' containerd pins as the
# sandbox image.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache=${SPLITPROXY_TOOLS_CACHE:-$HOME/.cache/splitproxy-tools}
out=$cache/pause
while (($#)); do
  case $1 in
    --out) out=$2; shift 2 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "pause-image.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
PAUSE_TAG=1
mkdir -p "$out/bin"
(cd "$here/pause" && CGO_ENABLED=0 go build -trimpath -ldflags '-s -w' -o "$out/bin/splitproxy-pause" .)
# The time and commit of the last change to tools/pause (HEAD's if it is not committed yet).
commit=$(git -C "$here" log -1 --format=%H -- pause)
commit=${commit:-$(git -C "$here" rev-parse HEAD)}
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git -C "$here" log -1 --format=%ct "$commit")}
python3 "$here/oci_image.py" "$out" localhost "$PAUSE_TAG" "$commit" \
  "splitproxy-pause=$out/bin/splitproxy-pause=65535:65535=$PAUSE_TAG"
