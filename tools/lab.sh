#!/usr/bin/env bash
# The splitproxy lab, as root: builds what it needs, then runs `splitproxy-lab` with the given
# subcommand (default `demo`: API server, brain and actuators in node namespaces, demo Services,
# live traffic through a ClusterIP). `tools/lab.sh --help` lists the subcommands, e.g.
#   tools/lab.sh up --detach --scenario tests/lab/scenarios/nodeport-local --probe
#   tools/lab.sh up --chart --detach     (the Helm chart's objects, installed as chart_lab.rs does)
#   tools/lab.sh replay tests/lab/scenarios/nodeport-local
#   tools/lab.sh probe --from external 192.168.77.10:30080
#   tools/lab.sh down
# Paths are taken relative to the directory the script is run from.
set -euo pipefail
caller=$(pwd)
repo=$(cd "$(dirname "$0")/.." && pwd)
[ "$(id -u)" -eq 0 ] || { echo "the lab creates network namespaces: run as root" >&2; exit 1; }
(
  cd "$repo"
  tools/setup.sh test
  cargo build --release --quiet --bins
)
cd "$caller"
target_dir=${CARGO_TARGET_DIR:-$repo/target}
case $target_dir in /*) ;; *) target_dir=$repo/$target_dir ;; esac
exec "$target_dir/release/splitproxy-lab" "${@:-demo}"
