#!/usr/bin/env bash
# Builds the pinned third-party binaries that splitproxy's tests, lab and benchmark run against,
# from the Go module proxy, into a cache keyed by version outside the repository. A binary that
# is already in the cache is not rebuilt, so a warm run takes well under a second.
#
#   tools/build-tools.sh [SET|NAME ...]
#     test   etcd kube-apiserver grpcurl kube-proxy helm  (default; what the tests need, including
#            the benchmark's small-scale run and the chart's tests)
#     bench  test + kube-controller-manager kwok
#     all    bench
#     cluster  etcd kube-apiserver kubelet kube-scheduler kube-controller-manager kubectl
#            containerd containerd-shim-runc-v2 ctr crictl: what tools/cluster.sh runs (the
#            chart's real-cluster test, tests/tests/cluster_helm.rs); tools/test.sh builds it
#            too (about 15 minutes cold on 2 cores, once per version).
#            runc and the CNI plugins come from Debian (tools/setup.sh cluster).
#     dns    coredns v1.15.0, the real cluster's DNS (tools/cluster.sh dns)
#     e2e    e2e.test (Kubernetes' end-to-end tests, `go test -c k8s.io/kubernetes/test/e2e`) and
#            agnhost (their test server) v1.37.2, for tools/e2e.sh; about 5 minutes cold
#     NAME   any single binary of the above
#
# Binaries land in $SPLITPROXY_TOOLS_CACHE/<name>-<version>/<name> (default cache:
# ~/.cache/splitproxy-tools) and are linked from $SPLITPROXY_TOOLS_CACHE/bin/<name>, which is
# where the Rust harness looks for them.
set -euo pipefail

K8S_VERSION=v1.37.2
ETCD_VERSION=v3.6.16
GRPCURL_VERSION=v1.9.4
HELM_VERSION=v4.3.2
KWOK_VERSION=v0.8.0
# containerd v2 (Debian's 1.6 is too old for kubelet v1.37); its go.mod has no replace lines, so
# `go install` from the module proxy builds it. The 2.2 line still supports cgroup v1 (deprecated
# there, removal announced for no later than May 2029), which this project's machines run.
CONTAINERD_VERSION=v2.2.9
CRICTL_VERSION=v1.37.0
COREDNS_VERSION=v1.15.0

here=$(cd "$(dirname "$0")" && pwd)
cache=${SPLITPROXY_TOOLS_CACHE:-$HOME/.cache/splitproxy-tools}
mkdir -p "$cache/bin"

say() { printf '[build-tools] %s\n' "$*" >&2; }

version_of() {
  case $1 in
    etcd) echo "$ETCD_VERSION" ;;
    kube-apiserver | kube-proxy | kube-controller-manager | kubelet | kube-scheduler | kubectl | \
      e2e.test | agnhost)
      echo "$K8S_VERSION" ;;
    containerd | containerd-shim-runc-v2 | ctr) echo "$CONTAINERD_VERSION" ;;
    crictl) echo "$CRICTL_VERSION" ;;
    coredns) echo "$COREDNS_VERSION" ;;
    grpcurl) echo "$GRPCURL_VERSION" ;;
    helm) echo "$HELM_VERSION" ;;
    kwok) echo "$KWOK_VERSION" ;;
    *) say "unknown binary: $1"; exit 2 ;;
  esac
}

k8s_ldflags() {
  local major minor
  major=${K8S_VERSION#v}; major=${major%%.*}
  minor=${K8S_VERSION#v*.}; minor=${minor%%.*}
  local v=k8s.io/component-base/version
  printf -- '-s -w -X %s.gitVersion=%s -X %s.gitMajor=%s -X %s.gitMinor=%s -X %s.gitTreeState=clean' \
    "$v" "$K8S_VERSION" "$v" "$major" "$v" "$minor" "$v"
}

build_one() {
  local name=$1 version out
  version=$(version_of "$name")
  out="$cache/$name-$version"
  if [ -x "$out/$name" ]; then
    ln -sfn "$out/$name" "$cache/bin/$name"
    return 0
  fi
  say "building $name $version (cold builds of Kubernetes binaries take tens of minutes on 2 cores)"
  local start=$SECONDS tmp="$out.partial"
  rm -rf "$tmp"; mkdir -p "$tmp"
  case $name in
    etcd)
      (cd "$here/etcd" && CGO_ENABLED=0 go build -trimpath -ldflags '-s -w' -o "$tmp/etcd" .) ;;
    kube-apiserver | kube-proxy | kube-controller-manager | kubelet | kube-scheduler | kubectl)
      (cd "$here/k8s" && CGO_ENABLED=0 go build -trimpath -ldflags "$(k8s_ldflags)" \
        -o "$tmp/$name" "k8s.io/kubernetes/cmd/$name") ;;
    e2e.test)
      (cd "$here/k8s" && CGO_ENABLED=0 go test -c -trimpath -ldflags "$(k8s_ldflags)" \
        -o "$tmp/e2e.test" k8s.io/kubernetes/test/e2e) ;;
    agnhost)
      (cd "$here/k8s" && CGO_ENABLED=0 go build -trimpath -ldflags '-s -w' \
        -o "$tmp/agnhost" k8s.io/kubernetes/test/images/agnhost) ;;
    grpcurl)
      GOBIN="$tmp" CGO_ENABLED=0 go install "github.com/fullstorydev/grpcurl/cmd/grpcurl@$version" ;;
    helm)
      GOBIN="$tmp" CGO_ENABLED=0 go install "helm.sh/helm/v4/cmd/helm@$version" ;;
    kwok)
      GOBIN="$tmp" CGO_ENABLED=0 go install "sigs.k8s.io/kwok/cmd/kwok@$version" ;;
    containerd | containerd-shim-runc-v2 | ctr)
      # Static, without the cgo-only snapshotters (btrfs, devmapper); overlayfs and native stay.
      GOBIN="$tmp" CGO_ENABLED=0 go install -tags 'no_btrfs no_devmapper no_zfs' \
        -ldflags "-s -w -X github.com/containerd/containerd/v2/version.Version=$version" \
        "github.com/containerd/containerd/v2/cmd/$name@$version" ;;
    coredns)
      GOBIN="$tmp" CGO_ENABLED=0 go install -trimpath -ldflags '-s -w' \
        "github.com/coredns/coredns@$version" ;;
    crictl)
      GOBIN="$tmp" CGO_ENABLED=0 go install \
        -ldflags "-s -w -X sigs.k8s.io/cri-tools/pkg/version.Version=$version" \
        "sigs.k8s.io/cri-tools/cmd/crictl@$version" ;;
  esac
  rm -rf "$out"; mv "$tmp" "$out"
  ln -sfn "$out/$name" "$cache/bin/$name"
  say "built $name $version in $((SECONDS - start)) s -> $out/$name"
}

names=()
[ $# -eq 0 ] && set -- test
for arg in "$@"; do
  case $arg in
    test) names+=(etcd kube-apiserver grpcurl kube-proxy helm) ;;
    bench) names+=(etcd kube-apiserver grpcurl kube-proxy helm kube-controller-manager kwok) ;;
    all) names+=(etcd kube-apiserver grpcurl kube-proxy kube-controller-manager kwok helm) ;;
    e2e) names+=(e2e.test agnhost) ;;
    dns) names+=(coredns) ;;
    cluster) names+=(etcd kube-apiserver containerd containerd-shim-runc-v2 ctr crictl kubelet
      kube-scheduler kube-controller-manager kubectl) ;;
    *) names+=("$arg") ;;
  esac
done

total=$SECONDS
for n in "${names[@]}"; do build_one "$n"; done
if [ $((SECONDS - total)) -gt 1 ]; then say "all done in $((SECONDS - total)) s"; fi
echo "$cache/bin"
