#!/usr/bin/env bash
# Runs splitproxy's scale benchmarks, as root. One binary (splitproxy-bench), two modes:
#
# End to end (default): set-up (Debian packages, the font for the plots, the pinned etcd /
# kube-apiserver / kube-proxy built from the Go module proxy), a release build, then a real API
# server, the brain, real actuators in node namespaces, a virtual fleet over real gRPC and
# kube-proxy side by side, with the flags given.
#
#   sudo tools/bench.sh [--services 10000] [--endpoints 10] [--nodes 5000] [--real 3]
#                       [--virtual N] [--brains 1] [--single-changes 20] [--churn-seconds 60]
#                       [--churn-percent 1.0] [--failover-seconds 10] [--skip-kube-proxy]
#                       [--out bench/results] [--report bench/RESULTS.md]
#                       [--brain-arg=--min-publish-interval-ms=50] ...
#
#   --brain-arg passes a flag to every brain replica (it replaces the benchmark's own setting of
#   that flag): runs that differ in one brain setting, compared in the same session.
#
#   With --brains 2 or more, nodes spread over the replicas and a failover phase kills one of
#   them during churn; a restart phase stops every replica and starts it again (--skip-restart).
#
#   It writes bench/results/result.json, PNG plots beside it, component logs under
#   bench/results/logs, and regenerates bench/RESULTS.md with the exact command.
#
# Scale: brain compute and kernel apply alone, without an API server (no set-up beyond a release
# build): full rebuild, every node's overlay, single-Service changes (compute / diff / delta
# size), publications of --churn-batch changed Services as churn makes them, then in a private
# network namespace a node's cold start, single-endpoint changes (p50 / p99 over
# --endpoint-changes) and a Service added and deleted. It prints the figures, after the command
# that produced them.
#
#   sudo tools/bench.sh scale [--services 10000] [--endpoints 10] [--nodes 5000]
#                             [--service-changes 100] [--endpoint-changes 200]
#                             [--churn-publications 20] [--churn-batch 100]
#
#   tools/bench.sh --help          lists every flag of the end-to-end mode
#   tools/bench.sh scale --help    lists every flag of the scale mode
set -euo pipefail
cd "$(dirname "$0")/.."
for a in "$@"; do
  case $a in -h | --help) exec cargo run --quiet --release -p splitproxy-bench -- "$@" ;; esac
done
[ "$(id -u)" -eq 0 ] || { echo "the benchmark creates network namespaces: run as root" >&2; exit 1; }
start=$SECONDS
# The scale mode needs no API server, kube-proxy or plots.
[ "${1:-}" = scale ] || tools/setup.sh bench
cargo build --release -p splitproxy-bench
echo "[bench] set-up and build done in $((SECONDS - start)) s" >&2
export SPLITPROXY_BENCH_COMMAND="tools/bench.sh $*"
exec "${CARGO_TARGET_DIR:-target}/release/splitproxy-bench" "$@"
