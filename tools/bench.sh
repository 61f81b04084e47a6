#!/usr/bin/env bash
# Runs splitproxy's synthetic scale benchmark, as root, on a fresh machine: set-up (Debian
# packages, the font for the plots, the pinned etcd / kube-apiserver / kube-proxy built from the
# Go module proxy), a release build, then the benchmark with the flags given.
#
#   sudo tools/bench.sh [--services 10000] [--endpoints 10] [--nodes 5000] [--real 3]
#                       [--virtual N] [--churn-seconds 60] [--churn-percent 1.0]
#                       [--skip-kube-proxy] [--out bench/results] [--report bench/RESULTS.md] ...
#   tools/bench.sh --help     lists every flag
#
# It writes bench/results/result.json, PNG plots beside it, component logs under
# bench/results/logs, and regenerates bench/RESULTS.md with the exact command.
set -euo pipefail
cd "$(dirname "$0")/.."
for a in "$@"; do
  case $a in -h | --help) exec cargo run --quiet --release -p splitproxy-bench -- --help ;; esac
done
[ "$(id -u)" -eq 0 ] || { echo "the benchmark creates network namespaces: run as root" >&2; exit 1; }
start=$SECONDS
tools/setup.sh bench
cargo build --release -p splitproxy-bench
echo "[bench] set-up and build done in $((SECONDS - start)) s" >&2
export SPLITPROXY_BENCH_COMMAND="tools/bench.sh $*"
exec target/release/splitproxy-bench "$@"
