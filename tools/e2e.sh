#!/usr/bin/env bash
# Kubernetes' own Service end-to-end tests (e2e.test v1.37.2) against tools/cluster.sh's cluster,
# with splitproxy as the only Service proxy. Nothing is pulled: e2e.test and agnhost are built
# from the Go module proxy (tools/build-tools.sh e2e) and the images the tests ask for are
# written here (tools/e2e-images.py) and imported into every node.
#
#   tools/e2e.sh [--focus REGEX] [--skip REGEX] [--timeout DURATION]
#
# Expects a running cluster with splitproxy installed (tools/cluster.sh start; tools/image.sh
# --repository localhost/splitproxy; tools/cluster.sh images; tools/cluster.sh install); deploys
# the cluster DNS (tools/cluster.sh dns), which the tests use and reach through splitproxy.
# Default focus: `\[sig-network\] Services`; default skip: tests that need what a one-machine
# cluster has not (a cloud load balancer, SSH to nodes, more nodes) or that disrupt the
# cluster itself ([Disruptive], [Serial]). Writes the JUnit report and the log under
# $SPLITPROXY_CLUSTER_DIR/e2e and prints a pass/fail/skip table.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache=${SPLITPROXY_TOOLS_CACHE:-$HOME/.cache/splitproxy-tools}
dir=$(realpath -m "${SPLITPROXY_CLUSTER_DIR:-/tmp/splitproxy-cluster}")
prefix=${SPLITPROXY_CLUSTER_PREFIX:-spcluster}
focus='\[sig-network\] Services'
skip='\[Disruptive\]|\[Serial\]|\[Flaky\]|\[Feature:|LoadBalancer|GCE'
timeout=90m
while (($#)); do
  case $1 in
    --focus) focus=$2; shift 2 ;;
    --skip) skip=$2; shift 2 ;;
    --timeout) timeout=$2; shift 2 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "e2e.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
say() { printf '[e2e] %s\n' "$*" >&2; }

[ -f "$dir/nodes-count" ] || { say "no cluster in $dir (tools/cluster.sh start)"; exit 1; }
need=()
[ -x /bin/busybox ] || need+=(busybox-static)
[ -x /usr/bin/nc.openbsd ] || need+=(netcat-openbsd)
command -v socat >/dev/null || need+=(socat)
command -v wget >/dev/null || need+=(wget)
if [ ${#need[@]} -gt 0 ]; then
  say "installing Debian's ${need[*]} (tools the tests run inside agnhost pods)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
"$here/build-tools.sh" e2e >/dev/null
# Most Service tests reach their Service by its DNS name.
"$here/cluster.sh" dns
"$here/pause-image.sh" >/dev/null
images=$dir/e2e/images
rm -rf "$images"; mkdir -p "$images"
SOURCE_DATE_EPOCH=0 python3 "$here/e2e-images.py" "$images" "$cache/bin/agnhost" \
  "$cache/pause/bin/splitproxy-pause" >&2
"$here/cluster.sh" import "$images/agnhost.oci.tar" "$images/pause.oci.tar"

report=$dir/e2e/report
rm -rf "$report"; mkdir -p "$report"
say "running e2e.test --ginkgo.focus='$focus' --ginkgo.skip='$skip' (log: $dir/e2e/e2e.log)"
set +e
nsenter --net="/run/netns/$prefix-fabric" -- timeout "$timeout" "$cache/bin/e2e.test" \
  --kubeconfig="$dir/kubeconfig/admin" --provider=skeleton \
  --ginkgo.focus="$focus" --ginkgo.skip="$skip" --ginkgo.timeout="$timeout" \
  --ginkgo.no-color --report-dir="$report" --disable-log-dump \
  >"$dir/e2e/e2e.log" 2>&1
rc=$?
set -e
python3 - "$report" <<'EOF'
import glob, sys, xml.etree.ElementTree as ET
rows = []
for f in sorted(glob.glob(sys.argv[1] + "/junit*.xml")):
    for case in ET.parse(f).getroot().iter("testcase"):
        name = case.get("name", "")
        if name.startswith("[SynchronizedBeforeSuite]") or name.startswith("[SynchronizedAfterSuite]") \
                or name.startswith("[ReportAfterSuite]") or name.startswith("[ReportBeforeSuite]"):
            continue
        status = case.get("status") or ("failed" if case.find("failure") is not None else
                                        "skipped" if case.find("skipped") is not None else "passed")
        rows.append((status, name, float(case.get("time", 0))))
ran = [r for r in rows if r[0] != "skipped"]
for status in ("passed", "failed"):
    for s, name, t in sorted(r for r in ran if r[0] == status):
        print(f"{s:7} {t:6.1f}s  {name}")
count = {}
for s, _, _ in rows:
    count[s] = count.get(s, 0) + 1
print("summary:", ", ".join(f"{k} {v}" for k, v in sorted(count.items())))
EOF
say "e2e.test exited $rc; report in $report"
exit $rc
