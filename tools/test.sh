#!/usr/bin/env bash
# Runs every test of splitproxy on a fresh machine, as root: set-up (Debian packages, pinned
# etcd/kube-apiserver/grpcurl/helm and the real cluster's kubelet, containerd and friends, built
# from the Go module proxy and cached by version), formatting, lints and the documentation's
# links, then the whole workspace's tests (unit, kernel-in-namespace, API server, end to end,
# the chart on a real cluster).
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" -eq 0 ] || { echo "tests create network namespaces: run as root" >&2; exit 1; }
start=$SECONDS
tools/setup.sh test
tools/setup.sh cluster
echo "[test] set-up done in $((SECONDS - start)) s" >&2
# Incremental caches double the size of target/ and only help edit-compile loops, not one run.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
echo "[test] free disk for target/: $(df -h --output=avail . | tail -1 | tr -d ' ')" >&2
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --quiet -- -D warnings
# The documentation's links must resolve (a renamed item leaves a link to nothing behind).
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --quiet
cargo test --workspace --no-fail-fast "$@"
