#!/usr/bin/env bash
# The splitproxy lab, as root: builds what it needs, then runs `splitproxy-lab` with the given
# subcommand (default `demo`: API server, brain and actuators in node namespaces, demo Services,
# live traffic through a ClusterIP). `tools/lab.sh --help` lists the subcommands.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" -eq 0 ] || { echo "the lab creates network namespaces: run as root" >&2; exit 1; }
tools/setup.sh test
cargo build --release --quiet --bins
exec target/release/splitproxy-lab "${@:-demo}"
