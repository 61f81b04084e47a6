#!/usr/bin/env bash
# Everything a fresh Debian machine needs before splitproxy's tests or lab run: Debian packages
# (nftables for `nft -j` checks, iproute2 for namespaces, conntrack, nsenter), then the pinned
# Go-built binaries (cached by version, so a warm run is instant).
#   tools/setup.sh [test|bench|all|cluster]
# (cluster: the real-cluster binaries of tools/cluster.sh, plus Debian's runc and CNI plugins;
# tools/test.sh runs both `test` and `cluster`)
# (the test set includes kube-proxy: the benchmark's small-scale run is part of the tests)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
need=()
command -v nft >/dev/null || need+=(nftables)
command -v ip >/dev/null || need+=(iproute2)
command -v conntrack >/dev/null || need+=(conntrack)
command -v nsenter >/dev/null || need+=(util-linux)
command -v curl >/dev/null || need+=(curl)
# tools/image.sh (the chart test builds the images) writes OCI layouts with tools/oci_image.py.
command -v python3 >/dev/null || need+=(python3)
# The image test reads the OCI archives as a registry client would.
command -v skopeo >/dev/null || need+=(skopeo)
# The benchmark's plots (also drawn by its small-scale test) need a font file, not fontconfig.
[ -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || need+=(fonts-dejavu-core)
if [ "${1:-test}" = cluster ]; then
  # containerd's OCI runtime and the pod network plugins (ptp, host-local, loopback in
  # /usr/lib/cni) of tools/cluster.sh's nodes.
  command -v runc >/dev/null || need+=(runc)
  # tools/cluster.sh makes the cluster's certificates with openssl and sets each node's
  # ip_forward with sysctl (procps); neither is in a minimal Debian.
  command -v openssl >/dev/null || need+=(openssl)
  command -v sysctl >/dev/null || need+=(procps)
  [ -x /usr/lib/cni/ptp ] || need+=(containernetworking-plugins)
fi
if [ ${#need[@]} -gt 0 ]; then
  echo "[setup] installing Debian packages: ${need[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need[@]}" >/dev/null
fi
command -v go >/dev/null || { echo "[setup] Go is required to build the pinned Kubernetes binaries" >&2; exit 1; }
"$here/build-tools.sh" "${1:-test}" >/dev/null
