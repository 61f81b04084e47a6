#!/usr/bin/env bash
# A small real Kubernetes cluster on this machine (issue #11): a control plane and N kubelet
# nodes built from the pinned v1.37.2 sources, every daemon inside network namespaces this script
# creates, all state under one directory. Nothing is pulled from the internet: the only image is
# the local pause image (tools/pause-image.sh), pinned as every node's sandbox image.
#
#   tools/cluster.sh start [NODES]   (default 2) bring the cluster up; stops what it started if
#                                    any step fails (SPLITPROXY_CLUSTER_KEEP=1 keeps it to debug)
#   tools/cluster.sh status          daemons, nodes and pods
#   tools/cluster.sh stop            kill (by pid) what start started, unmount everything under
#                                    the state directory, delete the namespaces and cgroups
#   tools/cluster.sh kubectl ARGS    kubectl as cluster-admin (run in the fabric namespace)
#   tools/cluster.sh smoke           a pause pod and a host-network pause pod on every node;
#                                    waits until each runs
#   tools/cluster.sh env             prints the namespace and kubeconfig paths, for scripts
#   tools/cluster.sh images [DIR]    imports splitproxy's images (tools/image.sh; default DIR
#                                    $CARGO_TARGET_DIR/oci) into every node's containerd
#   tools/cluster.sh import FILE...  imports OCI archives (e.g. tools/e2e.sh's images) into every
#                                    node's containerd under the names they carry
#   tools/cluster.sh tag TAG         tags every imported splitproxy image :TAG as well (on every
#                                    node), e.g. to `helm upgrade` to a new tag
#   tools/cluster.sh install [ARGS]  `helm upgrade --install` of charts/splitproxy as release
#                                    `splitproxy` in namespace `splitproxy`, replacing kube-proxy
#                                    (there is none), with the imported images; ARGS go to helm
#   tools/cluster.sh cleanup         after `helm uninstall`: `splitproxy-actuator --cleanup` in a
#                                    `kubectl debug node` pod on every node (README, "Uninstall")
#   tools/cluster.sh dns             CoreDNS (tools/build-tools.sh dns, a local image) at the
#                                    kube-dns ClusterIP 10.96.0.10 that every kubelet hands its pods
#   tools/cluster.sh helm ARGS       helm against this cluster (run in the fabric namespace)
#   tools/cluster.sh nft NODE ARGS   `nft ARGS` inside node NODE's namespace (e.g. `nft 0 list
#                                    tables`): where the actuator of that node programs
#
# Needs root, the `cluster` binaries (tools/build-tools.sh cluster, cached by version), runc
# and the CNI plugins from Debian (tools/setup.sh cluster).
#
# Layout (the addressing of tests/src/topology.rs, IPv4 only for now):
#
#   <prefix>-fabric  bridge br0 192.168.77.1/24; etcd (127.0.0.1:2379), kube-apiserver
#                    (192.168.77.1:6443 and 127.0.0.1:6443), kube-controller-manager and
#                    kube-scheduler. The control plane runs here, not in the machine's own
#                    namespace, because the kubelets live in node namespaces and cannot reach the
#                    machine's loopback; reach it with `tools/cluster.sh kubectl`.
#   <prefix>-node-i  eth0 192.168.77.(10+i)/24 (veth to br0), default route via the fabric; its
#                    own containerd (own root, state, socket; cgroupfs; CNI ptp: one routed veth
#                    per pod, pod CIDR 10.244.i.0/24) and kubelet (node name node-i, cgroupfs driver,
#                    failCgroupV1: false because this machine runs cgroup v1, cgroup root
#                    /<prefix>-node-i). Routes to the other nodes' pod CIDRs go straight over the
#                    fabric bridge. Host-network pods live in this namespace. Routed veths rather
#                    than a bridge: every pod packet, also between two pods of one node, crosses
#                    the node's IP layer and so its nftables, as on a cloud provider's routed pod
#                    network; a bridge would need bridge-netfilter for same-node Service traffic.
#
# The daemons enter the node's network namespace (nsenter --net). The kubelets also get a mount
# namespace of their own, only to show them the machine-wide sysctls they insist on without
# changing the machine's (see make_kubelet_sysctls); the state directory is a shared mount, so
# their volume mounts still reach containerd and runc. Every mount lies under the state
# directory and `stop` unmounts it. Written outside it, at
# fixed paths that the daemons use whatever their configuration: the kubelet's symlinks in
# /var/log/containers and its device-plugin socket /var/lib/kubelet/device-plugins/kubelet.sock,
# the CNI result cache /var/lib/cni/results, and the shims' sockets in /run/containerd/s (each
# removed when its shim exits). `stop` removes the symlinks that point into the state directory,
# the socket, and every such directory that did not exist before `start` (if empty).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache=${SPLITPROXY_TOOLS_CACHE:-$HOME/.cache/splitproxy-tools}
bin=$cache/bin
dir=${SPLITPROXY_CLUSTER_DIR:-/tmp/splitproxy-cluster}
prefix=${SPLITPROXY_CLUSTER_PREFIX:-spcluster}
fabric=$prefix-fabric
pause_image=localhost/splitproxy-pause:1
service_cidr=10.96.0.0/16
cluster_cidr=10.244.0.0/16
api_ip=192.168.77.1
# Bounds of every wait, in seconds.
api_timeout=${SPLITPROXY_CLUSTER_API_TIMEOUT:-90}
node_timeout=${SPLITPROXY_CLUSTER_NODE_TIMEOUT:-120}
stop_timeout=20
# Fixed paths the kubelet, the CNI library and the shims use (see above), deepest first.
host_dirs=(/var/log/containers /var/lib/kubelet/device-plugins /var/lib/kubelet
  /var/lib/cni/results /var/lib/cni /run/containerd/s /run/containerd)

export PATH=$bin:/usr/sbin:/usr/bin:/sbin:/bin:$PATH

say() { printf '[cluster] %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }

dir=$(realpath -m "$dir")
case $dir in
  /tmp/?* | /var/tmp/?* | /work/?* | "$HOME"/?*) ;;
  *) die "refusing state directory $dir (must be below /tmp, /var/tmp, /work or \$HOME)" ;;
esac
[[ $prefix =~ ^[a-z][a-z0-9-]{0,15}$ ]] || die "bad SPLITPROXY_CLUSTER_PREFIX $prefix"

node_ns() { echo "$prefix-node-$1"; }
node_name() { echo "node-$1"; }
node_ip() { echo "192.168.77.$((10 + $1))"; }
node_dir() { echo "$dir/nodes/node-$1"; }
cgroup_root() { echo "$prefix-node-$1"; }
in_ns() { local ns=$1; shift; nsenter --net="/run/netns/$ns" -- "$@"; }

# ---------------------------------------------------------------------------------------------
# Processes: started with setsid (their own session, so a terminal's signals do not reach them)
# and nsenter (which execs), so $! is the daemon's own pid; recorded with the binary's path so
# that `stop` never signals a reused pid.

start_daemon() { # NAME NETNS BINARY ARGS... (with $launcher, if set, between nsenter and BINARY)
  local name=$1 ns=$2 exe=$3; shift 3
  mkdir -p "$dir/pids" "$dir/logs"
  setsid nsenter --net="/run/netns/$ns" -- ${launcher[@]+"${launcher[@]}"} "$exe" "$@" \
    >"$dir/logs/$name.log" 2>&1 </dev/null &
  local pid=$!
  printf '%s %s\n' "$pid" "$(realpath "$exe")" >"$dir/pids/$name"
  say "started $name (pid $pid) in $ns"
}

alive() { # PIDFILE: the pid if it still runs the recorded binary
  local pid exe
  read -r pid exe <"$1" || return 1
  [ -n "$pid" ] && [ "$(readlink "/proc/$pid/exe" 2>/dev/null)" = "$exe" ] && echo "$pid"
}

kill_pid() { # PID: TERM, bounded wait, KILL
  local pid=$1 i
  kill -TERM "$pid" 2>/dev/null || return 0
  for ((i = 0; i < stop_timeout * 10; i++)); do
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 0.1
  done
  say "pid $pid ignored SIGTERM for ${stop_timeout}s; SIGKILL"
  kill -KILL "$pid" 2>/dev/null || true
}

stop_daemon() { # NAME
  local f=$dir/pids/$1 pid
  [ -f "$f" ] || return 0
  if pid=$(alive "$f"); then
    say "stopping $1 (pid $pid)"
    kill_pid "$pid"
  fi
  rm -f "$f"
}

wait_for() { # DESCRIPTION SECONDS COMMAND...: polls COMMAND every half second, bounded
  local what=$1 limit=$2 deadline; shift 2
  deadline=$((SECONDS + limit))
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || { say "timed out after ${limit}s waiting for $what"; return 1; }
    sleep 0.5
  done
}

# ---------------------------------------------------------------------------------------------
# Certificates (openssl, EC P-256): one CA for everything, like a kubeadm cluster's.

cert() { # NAME CN [O] [SANS]: a key and a certificate signed by the cluster CA
  local name=$1 cn=$2 o=${3:-} sans=${4:-} pki=$dir/pki subj ext
  subj="/CN=$cn"
  [ -n "$o" ] && subj="/O=$o$subj"
  ext=$pki/$name.ext
  {
    echo "basicConstraints=CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    if [ -n "$sans" ]; then
      echo "extendedKeyUsage=serverAuth,clientAuth"
      echo "subjectAltName=$sans"
    else
      echo "extendedKeyUsage=clientAuth"
    fi
  } >"$ext"
  openssl ecparam -name prime256v1 -genkey -noout -out "$pki/$name.key" 2>/dev/null
  openssl req -new -key "$pki/$name.key" -subj "$subj" -out "$pki/$name.csr" 2>/dev/null
  openssl x509 -req -in "$pki/$name.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" \
    -CAcreateserial -days 30 -extfile "$ext" -out "$pki/$name.crt" 2>/dev/null
  rm -f "$pki/$name.csr" "$ext"
}

kubeconfig() { # NAME SERVER: a kubeconfig from pki/NAME.{crt,key}
  local name=$1 server=$2 pki=$dir/pki
  cat >"$dir/kubeconfig/$name" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: splitproxy
  cluster:
    server: $server
    certificate-authority: $pki/ca.crt
users:
- name: $name
  user:
    client-certificate: $pki/$name.crt
    client-key: $pki/$name.key
contexts:
- name: $name
  context: {cluster: splitproxy, user: $name}
current-context: $name
EOF
}

make_pki() {
  local pki=$dir/pki
  mkdir -p "$pki" "$dir/kubeconfig"
  openssl ecparam -name prime256v1 -genkey -noout -out "$pki/ca.key" 2>/dev/null
  openssl req -x509 -new -key "$pki/ca.key" -subj "/CN=splitproxy-cluster-ca" -days 30 \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -out "$pki/ca.crt" 2>/dev/null
  cert apiserver kube-apiserver "" \
    "IP:$api_ip,IP:127.0.0.1,IP:10.96.0.1,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,DNS:localhost"
  cert apiserver-kubelet-client kube-apiserver-kubelet-client system:masters
  cert admin cluster-admin system:masters
  cert controller-manager system:kube-controller-manager
  cert scheduler system:kube-scheduler
  openssl ecparam -name prime256v1 -genkey -noout -out "$pki/sa.key" 2>/dev/null
  openssl ec -in "$pki/sa.key" -pubout -out "$pki/sa.pub" 2>/dev/null
  kubeconfig admin "https://$api_ip:6443"
  kubeconfig controller-manager https://127.0.0.1:6443
  kubeconfig scheduler https://127.0.0.1:6443
}

# Its discovery cache under the state directory, not in $HOME.
kubectl_admin() {
  in_ns "$fabric" "$bin/kubectl" --kubeconfig "$dir/kubeconfig/admin" \
    --cache-dir "$dir/kubectl-cache" "$@"
}

# ---------------------------------------------------------------------------------------------
# Network: the fabric and one namespace per node.

make_fabric() {
  ip netns add "$fabric"
  echo "/run/netns/$fabric" >>"$dir/netns"
  ip -n "$fabric" link set lo up
  ip -n "$fabric" link add br0 type bridge
  ip -n "$fabric" addr add "$api_ip/24" dev br0
  ip -n "$fabric" link set br0 up
}

make_node_net() { # INDEX COUNT
  local i=$1 n=$2 ns j
  ns=$(node_ns "$i")
  ip netns add "$ns"
  echo "/run/netns/$ns" >>"$dir/netns"
  ip -n "$ns" link set lo up
  ip -n "$ns" link add eth0 type veth peer name "node$i" netns "$fabric"
  ip -n "$fabric" link set "node$i" master br0 up
  ip -n "$ns" addr add "$(node_ip "$i")/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" route add default via "$api_ip"
  for ((j = 0; j < n; j++)); do
    ((j == i)) && continue
    ip -n "$ns" route add "10.244.$j.0/24" via "$(node_ip "$j")"
  done
  # The fabric reaches pods (API server to pod traffic) through their node; it never forwards.
  ip -n "$fabric" route add "10.244.$i.0/24" via "$(node_ip "$i")"
  in_ns "$ns" sysctl -qw net.ipv4.ip_forward=1
}

# ---------------------------------------------------------------------------------------------
# Control plane (in the fabric namespace).

start_control_plane() {
  local pki=$dir/pki
  mkdir -p "$dir/etcd"
  start_daemon etcd "$fabric" "$bin/etcd" --name=default --data-dir="$dir/etcd" \
    --listen-client-urls=http://127.0.0.1:2379 --advertise-client-urls=http://127.0.0.1:2379 \
    --listen-peer-urls=http://127.0.0.1:2380 --initial-advertise-peer-urls=http://127.0.0.1:2380 \
    --initial-cluster=default=http://127.0.0.1:2380 --unsafe-no-fsync
  wait_for "etcd" 30 in_ns "$fabric" curl -sf http://127.0.0.1:2379/health
  start_daemon kube-apiserver "$fabric" "$bin/kube-apiserver" \
    --etcd-servers=http://127.0.0.1:2379 --bind-address=0.0.0.0 --secure-port=6443 \
    --advertise-address="$api_ip" --cert-dir="$dir/pki/apiserver-generated" \
    --tls-cert-file="$pki/apiserver.crt" --tls-private-key-file="$pki/apiserver.key" \
    --client-ca-file="$pki/ca.crt" \
    --kubelet-client-certificate="$pki/apiserver-kubelet-client.crt" \
    --kubelet-client-key="$pki/apiserver-kubelet-client.key" \
    --kubelet-preferred-address-types=InternalIP \
    --authorization-mode=Node,RBAC --enable-admission-plugins=NodeRestriction \
    --allow-privileged=true --service-cluster-ip-range="$service_cidr" \
    --service-account-issuer=https://kubernetes.default.svc.cluster.local \
    --service-account-key-file="$pki/sa.pub" --service-account-signing-key-file="$pki/sa.key"
  wait_for "kube-apiserver /readyz" "$api_timeout" in_ns "$fabric" curl -sf \
    --cacert "$pki/ca.crt" --cert "$pki/admin.crt" --key "$pki/admin.key" \
    "https://127.0.0.1:6443/readyz"
  # No --allocate-node-cidrs: each node's pod CIDR is fixed by its CNI configuration and written
  # into its Node object by this script, so that node-i always has 10.244.i.0/24.
  start_daemon kube-controller-manager "$fabric" "$bin/kube-controller-manager" \
    --kubeconfig="$dir/kubeconfig/controller-manager" \
    --authentication-kubeconfig="$dir/kubeconfig/controller-manager" \
    --authorization-kubeconfig="$dir/kubeconfig/controller-manager" \
    --bind-address=127.0.0.1 --secure-port=10257 --leader-elect=false \
    --use-service-account-credentials=true --service-account-private-key-file="$pki/sa.key" \
    --root-ca-file="$pki/ca.crt" --cluster-signing-cert-file="$pki/ca.crt" \
    --cluster-signing-key-file="$pki/ca.key" --service-cluster-ip-range="$service_cidr" \
    --cluster-cidr="$cluster_cidr" --allocate-node-cidrs=false --cert-dir="$dir/pki/kcm-generated"
  start_daemon kube-scheduler "$fabric" "$bin/kube-scheduler" \
    --kubeconfig="$dir/kubeconfig/scheduler" \
    --authentication-kubeconfig="$dir/kubeconfig/scheduler" \
    --authorization-kubeconfig="$dir/kubeconfig/scheduler" \
    --bind-address=127.0.0.1 --secure-port=10259 --leader-elect=false
}

# ---------------------------------------------------------------------------------------------
# Nodes.

make_cgroup_root() { # INDEX: the kubelet's cgroupRoot, in every hierarchy (cgroup v1 + unified)
  local root h
  root=$(cgroup_root "$1")
  for h in /sys/fs/cgroup/*/; do
    [ -f "$h/cgroup.procs" ] || continue
    mkdir -p "$h$root"
    echo "$h$root" >>"$dir/cgroups"
    if [ -f "$h/cpuset.cpus" ]; then
      cat "$h/cpuset.cpus" >"$h$root/cpuset.cpus"
      cat "$h/cpuset.mems" >"$h$root/cpuset.mems"
    fi
  done
}

write_node_config() { # INDEX
  local i=$1 d name ip pki=$dir/pki
  d=$(node_dir "$i"); name=$(node_name "$i"); ip=$(node_ip "$i")
  mkdir -p "$d/containerd/root" "$d/containerd/state" "$d/cni/net.d" "$d/cni/ipam" \
    "$d/kubelet" "$d/pod-logs" "$d/opt"
  cat >"$d/containerd/config.toml" <<EOF
version = 3
root = "$d/containerd/root"
state = "$d/containerd/state"
disabled_plugins = [
  "io.containerd.nri.v1.nri",
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.blockfile",
  "io.containerd.tracing.processor.v1.otlp",
  "io.containerd.internal.v1.tracing",
]

[grpc]
  address = "$d/containerd.sock"

[ttrpc]
  address = "$d/containerd.sock.ttrpc"

[debug]
  address = "$d/containerd-debug.sock"

[plugins."io.containerd.internal.v1.opt"]
  path = "$d/opt"

[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"

[plugins."io.containerd.cri.v1.images".pinned_images]
  sandbox = "$pause_image"

# Pod network namespaces under the state directory (not /var/run/netns); and no negative
# oom_score_adj: this machine's root lacks CAP_SYS_RESOURCE, so runc could not lower it (the
# kubelet asks -998 for sandboxes), and a clamp to containerd's own score is all that is possible.
[plugins."io.containerd.cri.v1.runtime"]
  netns_mounts_under_state_dir = true
  restrict_oom_score_adj = true
  enable_selinux = false

[plugins."io.containerd.cri.v1.runtime".containerd]
  default_runtime_name = "runc"

[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
  SystemdCgroup = false
  BinaryName = "/usr/sbin/runc"
  Root = "$d/runc"

[plugins."io.containerd.cri.v1.runtime".cni]
  bin_dirs = ["/usr/lib/cni"]
  conf_dir = "$d/cni/net.d"
  max_conf_num = 1
EOF
  cat >"$d/cni/net.d/10-splitproxy.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "splitproxy-cluster",
  "plugins": [
    {
      "type": "ptp",
      "ipMasq": false,
      "mtu": 1500,
      "ipam": {
        "type": "host-local",
        "dataDir": "$d/cni/ipam",
        "ranges": [[{"subnet": "10.244.$i.0/24", "gateway": "10.244.$i.1"}]],
        "routes": [{"dst": "0.0.0.0/0"}]
      }
    },
    {"type": "loopback"}
  ]
}
EOF
  cert "node-$i" "system:node:$name" system:nodes
  kubeconfig "node-$i" "https://$api_ip:6443"
  cat >"$d/kubelet/config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# This machine runs cgroup v1 without systemd.
cgroupDriver: cgroupfs
failCgroupV1: false
cgroupRoot: /$(cgroup_root "$i")
failSwapOn: false
# Never write the machine-wide sysctls it wants (see make_kubelet_sysctls in tools/cluster.sh).
protectKernelDefaults: true
containerRuntimeEndpoint: unix://$d/containerd.sock
podLogsDir: $d/pod-logs
address: $ip
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $pki/ca.crt}
authorization: {mode: Webhook}
clusterDomain: cluster.local
# The kube-dns ClusterIP of tools/cluster/coredns.yaml (`tools/cluster.sh dns`): reached through
# the Service proxy, so only once splitproxy runs; unanswered until then.
clusterDNS: [10.96.0.10]
resolvConf: /etc/resolv.conf
# The machine's disk is shared with everything else: never evict or collect images for it.
evictionHard: {memory.available: 100Mi, nodefs.available: 1%, imagefs.available: 1%, nodefs.inodesFree: 1%}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
rotateCertificates: false
serverTLSBootstrap: false
maxPods: 50
EOF
}

start_node() { # INDEX
  local i=$1 d ns
  d=$(node_dir "$i"); ns=$(node_ns "$i")
  start_daemon "containerd-$i" "$ns" "$bin/containerd" --config "$d/containerd/config.toml"
  wait_for "containerd of node-$i" 30 "$bin/ctr" --address "$d/containerd.sock" version
  "$bin/ctr" --address "$d/containerd.sock" -n k8s.io images import --local \
    "$cache/pause/splitproxy-pause.oci.tar" >/dev/null
  make_cgroup_root "$i"
  # The kubelet in a mount namespace of its own, only so that it sees the kernel settings it
  # insists on (below) without changing the machine's; its volume mounts under the state
  # directory still reach containerd and runc, through the shared mount made by start.
  local launcher=(unshare --mount --propagation unchanged -- /bin/sh -c "$kubelet_prelude" sh)
  start_daemon "kubelet-$i" "$ns" "$bin/kubelet" --config="$d/kubelet/config.yaml" \
    --kubeconfig="$dir/kubeconfig/node-$i" --hostname-override="$(node_name "$i")" \
    --node-ip="$(node_ip "$i")" --root-dir="$d/kubelet/root" --cert-dir="$d/kubelet/pki"
}

# The kubelet sets six machine-wide sysctls at start (vm.overcommit_memory=1, vm.panic_on_oom=0,
# kernel.panic=10, kernel.panic_on_oops=1, kernel.keys.root_maxkeys/root_maxbytes) unless
# protectKernelDefaults, which instead refuses to start when they differ. Changing them would
# change the machine for everything else on it (panic_on_oops=1 turns any kernel oops into a
# reboot), so each kubelet gets protectKernelDefaults: true and, in its private mount namespace,
# read-only files holding the values it expects bound over those /proc/sys entries; /proc is
# private, so the binds stay in that namespace.
kubelet_sysctls=(vm/overcommit_memory=1 vm/panic_on_oom=0 kernel/panic=10 kernel/panic_on_oops=1
  kernel/keys/root_maxkeys=1000000 kernel/keys/root_maxbytes=25000000)
kubelet_prelude='
set -e
mount --make-rprivate /proc
for f in "$SPLITPROXY_SYSCTL_DIR"/*; do
  mount --bind -o ro "$f" "/proc/sys/$(basename "$f" | tr . /)"
done
exec "$@"'

make_kubelet_sysctls() {
  local kv
  mkdir -p "$dir/kubelet-sysctls"
  for kv in "${kubelet_sysctls[@]}"; do
    echo "${kv#*=}" >"$dir/kubelet-sysctls/$(echo "${kv%%=*}" | tr / .)"
  done
  export SPLITPROXY_SYSCTL_DIR=$dir/kubelet-sysctls
}

# The state directory as a shared mount, so that mounts made below it in the kubelets' own mount
# namespaces appear in the machine's (where containerd and runc look for them).
make_shared_dir() {
  mount --bind "$dir" "$dir"
  echo "$dir" >"$dir/shared-mount"
  mount --make-shared "$dir"
}

node_ready() { # NAME
  [ "$(kubectl_admin get node "$1" \
    -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}')" = True ]
}

# ---------------------------------------------------------------------------------------------

cmd_start() {
  local n=${1:-2} i
  [[ $n =~ ^[1-9]$ ]] || die "NODES must be 1..9"
  [ "$(id -u)" = 0 ] || die "needs root (namespaces, mounts, cgroups)"
  for b in etcd kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl containerd \
    containerd-shim-runc-v2 ctr; do
    [ -x "$bin/$b" ] || die "$bin/$b missing: run tools/build-tools.sh cluster"
  done
  [ -x /usr/sbin/runc ] || die "runc missing: run tools/setup.sh cluster"
  [ -x /usr/lib/cni/ptp ] || die "CNI plugins missing: run tools/setup.sh cluster"
  if [ -d "$dir" ] && [ -n "$(ls -A "$dir/pids" 2>/dev/null)$(cat "$dir/netns" 2>/dev/null)" ]; then
    die "$dir holds a running or unclean cluster: tools/cluster.sh stop first"
  fi
  findmnt -rn -o TARGET | grep -qxF "$dir" && die "$dir is still mounted: tools/cluster.sh stop first"
  ip netns list | grep -q "^$prefix-" && die "namespaces $prefix-* exist: tools/cluster.sh stop first"
  # Only ever delete a directory this script made (it holds nodes-count) or an empty one.
  if [ -d "$dir" ] && [ -n "$(ls -A "$dir")" ] && [ ! -f "$dir/nodes-count" ]; then
    die "$dir is not empty and not a cluster state directory; choose another SPLITPROXY_CLUSTER_DIR"
  fi
  # Rebuilt every time (about a second, reproducible): the cached archive follows tools/pause.
  "$here/pause-image.sh" >/dev/null || die "tools/pause-image.sh failed"
  rm -rf "$dir"
  mkdir -p "$dir"
  echo "$n" >"$dir/nodes-count"
  local h
  for h in "${host_dirs[@]}"; do [ -e "$h" ] || echo "$h" >>"$dir/host-dirs"; done
  if [ "${SPLITPROXY_CLUSTER_KEEP:-0}" != 1 ]; then
    trap 'say "start failed; logs kept in $dir/logs; stopping"; cmd_stop' EXIT
  fi
  local t0=$SECONDS
  make_shared_dir
  make_kubelet_sysctls
  make_pki
  make_fabric
  for ((i = 0; i < n; i++)); do make_node_net "$i" "$n"; done
  start_control_plane
  for ((i = 0; i < n; i++)); do
    write_node_config "$i"
    start_node "$i"
  done
  for ((i = 0; i < n; i++)); do
    wait_for "node-$i registered" "$node_timeout" kubectl_admin get node "node-$i"
    # Empty until now (no CIDR allocation in the controller manager); written once.
    kubectl_admin patch node "node-$i" --type merge \
      -p "{\"spec\":{\"podCIDR\":\"10.244.$i.0/24\",\"podCIDRs\":[\"10.244.$i.0/24\"]}}" >/dev/null
  done
  for ((i = 0; i < n; i++)); do
    wait_for "node-$i Ready" "$node_timeout" node_ready "node-$i"
  done
  wait_for "the default ServiceAccount" 60 kubectl_admin get serviceaccount default
  trap - EXIT
  say "cluster up in $((SECONDS - t0)) s: $n nodes Ready; state in $dir"
  kubectl_admin get nodes -o wide
}

cmd_stop() {
  trap - EXIT
  set +e
  local n i f pid
  n=$(cat "$dir/nodes-count" 2>/dev/null || echo 9)
  # Pods first, through the CRI, while the runtime still runs (bounded by crictl's timeout).
  for ((i = 0; i < n; i++)); do
    local d
    d=$(node_dir "$i")
    stop_daemon "kubelet-$i"
    if [ -f "$dir/pids/containerd-$i" ] && alive "$dir/pids/containerd-$i" >/dev/null; then
      timeout 60 "$bin/crictl" --runtime-endpoint "unix://$d/containerd.sock" --timeout 20s \
        rmp -af >/dev/null 2>&1
    fi
  done
  # Shims (and their containers) left behind, e.g. after a runtime crashed: containerd 2 keeps
  # no pid file for them, so they are found in /proc by their binary (ours) and by the socket
  # address of one of this cluster's containerds on their command line.
  local shim_exe p
  shim_exe=$(realpath "$bin/containerd-shim-runc-v2" 2>/dev/null)
  for p in /proc/[0-9]*; do
    [ "$(readlink "$p/exe" 2>/dev/null)" = "$shim_exe" ] || continue
    tr '\0' ' ' <"$p/cmdline" 2>/dev/null | grep -q -- "-address $dir/nodes/" || continue
    pid=${p#/proc/}
    say "killing the containers of leftover shim $pid"
    for c in $(cat "$p"/task/*/children 2>/dev/null); do kill -KILL "$c" 2>/dev/null; done
    kill_pid "$pid"
  done
  for ((i = 0; i < n; i++)); do stop_daemon "containerd-$i"; done
  for name in kube-scheduler kube-controller-manager kube-apiserver etcd; do stop_daemon "$name"; done
  # Mounts under the state directory, deepest first (container rootfs, volumes, pod netns).
  local m tries
  for tries in 1 2 3; do
    mapfile -t mounts < <(findmnt -rn -o TARGET | awk -v d="$dir/" 'index($0, d) == 1' | sort -r)
    [ ${#mounts[@]} -eq 0 ] && break
    for m in "${mounts[@]}"; do umount "$m" 2>/dev/null || umount -l "$m"; done
  done
  # Cgroups the kubelets made under their roots (deepest first); empty once every pod is gone.
  # A list keeps what could not be removed, so that a later stop tries again.
  keep_missing() { # FILE COMMAND: runs COMMAND LINE for each line, keeps the lines that remain
    local f=$1 line rest=(); shift
    [ -f "$f" ] || return 0
    while read -r line; do
      "$@" "$line"
      [ -e "$line" ] && rest+=("$line")
    done < <(awk '!seen[$0]++' "$f")
    if [ ${#rest[@]} -eq 0 ]; then rm -f "$f"; else printf '%s\n' "${rest[@]}" >"$f"; fi
  }
  rm_cgroup() { [ -d "$1" ] && find "$1" -depth -type d -exec rmdir {} + 2>/dev/null; }
  keep_missing "$dir/cgroups" rm_cgroup
  # The kubelet's symlinks in its fixed /var/log/containers, when they point at this cluster.
  for f in /var/log/containers/*.log; do
    [ -L "$f" ] && [[ $(readlink "$f") == "$dir/"* ]] && rm -f "$f"
  done
  # The fixed host directories that start found missing, deepest first, if empty (the kubelet's
  # device-plugin socket is the one file removed from them; with several kubelets on one
  # machine they share it, and no device plugin is used).
  # The CNI library's cached results of this cluster's pods whose teardown never ran (a
  # runtime killed before removing them): named after the network and the sandbox id.
  for f in "$dir"/nodes/*/containerd/state/io.containerd.runtime.v2.task/k8s.io/*; do
    [ -d "$f" ] || continue
    rm -f "/var/lib/cni/results/splitproxy-cluster-$(basename "$f")-eth0" \
      "/var/lib/cni/results/cni-loopback-$(basename "$f")-lo"
  done
  if [ -f "$dir/host-dirs" ] && grep -qx /var/lib/kubelet/device-plugins "$dir/host-dirs"; then
    rm -f /var/lib/kubelet/device-plugins/kubelet.sock
  fi
  rm_dir() { rmdir "$1" 2>/dev/null; }
  keep_missing "$dir/host-dirs" rm_dir
  del_netns() { ip netns del "$(basename "$1")" 2>/dev/null; }
  keep_missing "$dir/netns" del_netns
  # The state directory's own bind mount (made shared by start), last.
  if [ -f "$dir/shared-mount" ] && findmnt -rn -o TARGET | grep -qxF "$dir"; then
    umount "$dir" 2>/dev/null || umount -l "$dir"
  fi
  local left
  left=$(findmnt -rn -o TARGET | awk -v d="$dir" '$0 == d || index($0, d "/") == 1' | wc -l)
  say "stopped; logs in $dir/logs"
  for f in cgroups netns host-dirs; do
    [ -f "$dir/$f" ] && say "left behind ($f; run stop again): $(tr '\n' ' ' <"$dir/$f")"
  done
  [ "$left" -eq 0 ] || say "$left mounts left under $dir"
  set -e
  [ "$left" -eq 0 ] && [ ! -f "$dir/cgroups" ] && [ ! -f "$dir/netns" ]
}

cmd_status() {
  local f name pid
  [ -d "$dir/pids" ] || { say "no cluster in $dir"; return 1; }
  for f in "$dir"/pids/*; do
    name=$(basename "$f")
    if pid=$(alive "$f"); then echo "$name running (pid $pid)"; else echo "$name DEAD"; fi
  done
  kubectl_admin get nodes -o wide && kubectl_admin get pods -A -o wide
}

pod_running() { # NAME (namespace default)
  [ "$(kubectl_admin get pod "$1" -o jsonpath='{.status.phase}')" = Running ]
}

cmd_smoke() {
  local n i
  n=$(cat "$dir/nodes-count")
  for ((i = 0; i < n; i++)); do
    kubectl_admin apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata: {name: pause-node-$i, namespace: default, labels: {app: splitproxy-cluster-smoke}}
spec:
  nodeName: node-$i
  automountServiceAccountToken: false
  containers:
  - {name: pause, image: $pause_image, imagePullPolicy: Never}
---
apiVersion: v1
kind: Pod
metadata: {name: pause-host-node-$i, namespace: default, labels: {app: splitproxy-cluster-smoke}}
spec:
  nodeName: node-$i
  hostNetwork: true
  containers:
  - {name: pause, image: $pause_image, imagePullPolicy: Never}
EOF
  done
  for ((i = 0; i < n; i++)); do
    for p in "pause-node-$i" "pause-host-node-$i"; do
      wait_for "pod $p Running" "$node_timeout" pod_running "$p"
    done
  done
  kubectl_admin get pods -l app=splitproxy-cluster-smoke -o wide
}

cmd_env() {
  echo "SPLITPROXY_CLUSTER_DIR=$dir"
  echo "FABRIC_NETNS=$fabric"
  echo "KUBECONFIG=$dir/kubeconfig/admin"
  echo "API_SERVER=https://$api_ip:6443"
  local n i
  n=$(cat "$dir/nodes-count" 2>/dev/null || echo 0)
  for ((i = 0; i < n; i++)); do echo "NODE_${i}_NETNS=$(node_ns "$i") NODE_${i}_IP=$(node_ip "$i")"; done
}

# ---------------------------------------------------------------------------------------------
# splitproxy on the cluster.

release=splitproxy
release_ns=splitproxy
image_repo=localhost/splitproxy
images=(splitproxy-brain splitproxy-actuator splitproxy-check splitproxy-echo)

# The chart's appVersion: the tag tools/image.sh gives the images.
chart_version() {
  sed -n 's/^appVersion: "\(.*\)"/\1/p' "$here/../charts/splitproxy/Chart.yaml"
}

# Helm's caches and configuration under the state directory, not in $HOME.
helm_admin() {
  HELM_CACHE_HOME=$dir/helm/cache HELM_CONFIG_HOME=$dir/helm/config \
    HELM_DATA_HOME=$dir/helm/data in_ns "$fabric" "$bin/helm" \
    --kubeconfig "$dir/kubeconfig/admin" "$@"
}

# ctr against node INDEX's containerd, without its warning that cgroup v1 is deprecated.
ctr_node() { # INDEX ARGS...
  local i=$1; shift
  "$bin/ctr" --address "$(node_dir "$i")/containerd.sock" -n k8s.io "$@" \
    2> >(grep -v 'support for cgroup v1 is deprecated' >&2)
}

cmd_import() { # FILE...
  local n i f
  n=$(cat "$dir/nodes-count" 2>/dev/null) || die "no cluster in $dir"
  for f in "$@"; do [ -f "$f" ] || die "$f missing"; done
  for ((i = 0; i < n; i++)); do
    for f in "$@"; do ctr_node "$i" images import --local "$f" >/dev/null; done
  done
  say "imported $# archives into $n nodes"
}

cmd_images() { # [DIR]
  local oci=${1:-${CARGO_TARGET_DIR:-$here/../target}/oci} n i name
  n=$(cat "$dir/nodes-count" 2>/dev/null) || die "no cluster in $dir"
  for name in "${images[@]}"; do
    [ -f "$oci/$name.oci.tar" ] || die "$oci/$name.oci.tar missing: run tools/image.sh --repository $image_repo"
  done
  for ((i = 0; i < n; i++)); do
    for name in "${images[@]}"; do
      ctr_node "$i" images import --local "$oci/$name.oci.tar" >/dev/null
    done
  done
  say "imported ${images[*]} into $n nodes"
  ctr_node 0 images ls -q | grep "^$image_repo/"
}

cmd_tag() { # TAG
  local tag=${1:-} n i name version
  [[ $tag =~ ^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$ ]] || die "bad TAG '$tag'"
  n=$(cat "$dir/nodes-count" 2>/dev/null) || die "no cluster in $dir"
  version=$(chart_version)
  for ((i = 0; i < n; i++)); do
    for name in "${images[@]}"; do
      ctr_node "$i" images tag --force "$image_repo/$name:$version" "$image_repo/$name:$tag" \
        >/dev/null
    done
  done
  say "tagged ${images[*]} :$version as :$tag on $n nodes"
}

# The values that fit this cluster: no kube-proxy (so the API server's own address, not the
# `kubernetes` ClusterIP), the local images never pulled, the pod CIDR, one brain per node up to
# the chart's three (brains never share a node).
cmd_install() { # [HELM ARGS]
  local n version
  n=$(cat "$dir/nodes-count" 2>/dev/null) || die "no cluster in $dir"
  version=$(chart_version)
  helm_admin upgrade --install "$release" "$here/../charts/splitproxy" \
    --namespace "$release_ns" --create-namespace \
    --set kubeProxy.mode=replace --set k8sServiceHost="$api_ip" --set k8sServicePort=6443 \
    --set image.brain.repository="$image_repo/splitproxy-brain" \
    --set image.actuator.repository="$image_repo/splitproxy-actuator" \
    --set helmTest.image.repository="$image_repo/splitproxy-check" \
    --set image.pullPolicy=Never \
    --set "proxy.clusterCIDRs={$cluster_cidr}" \
    --set brain.replicas=$((n < 3 ? n : 3)) \
    --wait --timeout 5m "$@"
  say "splitproxy $version installed"
  kubectl_admin -n "$release_ns" get pods -o wide
}

# What `helm uninstall` leaves on a node, and its documented removal (README, "Uninstall"): the
# actuators exit without touching their tables (a restart must never leave a node without its
# Services), so the last ruleset stays until deleted. Removed as a user without a shell on the
# nodes would: `splitproxy-actuator --cleanup` in a node debugging pod (host network,
# NET_ADMIN) on every node.
cmd_cleanup() {
  local n i version pod phase
  n=$(cat "$dir/nodes-count" 2>/dev/null) || die "no cluster in $dir"
  version=$(chart_version)
  for ((i = 0; i < n; i++)); do
    # kubectl debug says "Creating debugging pod NAME with container ..." and returns.
    pod=$(kubectl_admin debug "node/$(node_name "$i")" --profile=netadmin \
      --image="$image_repo/splitproxy-actuator:$version" --image-pull-policy=Never \
      -- splitproxy-actuator --cleanup 2>&1 | sed -n 's/^Creating debugging pod \([^ ]*\) .*/\1/p')
    [ -n "$pod" ] || die "kubectl debug node/$(node_name "$i") made no pod"
    pod_done() {
      phase=$(kubectl_admin get pod "$pod" -o jsonpath='{.status.phase}')
      [ "$phase" = Succeeded ] || [ "$phase" = Failed ]
    }
    wait_for "clean-up pod $pod" "$node_timeout" pod_done || phase=unknown
    kubectl_admin logs "$pod" >&2 || true
    kubectl_admin delete pod "$pod" --wait=false >/dev/null
    [ "$phase" = Succeeded ] || die "clean-up on node-$i: pod $pod $phase"
    say "node-$i: splitproxy's tables deleted"
  done
}

cmd_dns() {
  local version out
  "$here/build-tools.sh" dns >/dev/null
  version=$(readlink -f "$cache/bin/coredns" | sed -n 's|.*/coredns-v\([^/]*\)/coredns$|\1|p')
  [ -n "$version" ] || die "cannot tell the coredns version from $cache/bin/coredns"
  out=$dir/images
  mkdir -p "$out"
  SOURCE_DATE_EPOCH=0 python3 "$here/oci_image.py" "$out" localhost "$version" "coredns v$version" \
    "coredns=$cache/bin/coredns=65532:65532=$version" >/dev/null
  cmd_import "$out/coredns.oci.tar"
  sed "s/COREDNS_VERSION/$version/" "$here/cluster/coredns.yaml" | kubectl_admin apply -f - >/dev/null
  kubectl_admin -n kube-system rollout status deployment/coredns --timeout=120s
}

cmd_nft() { # NODE ARGS
  local i=$1; shift
  [[ $i =~ ^[0-9]$ ]] || die "NODE is a node index (0, 1, ...)"
  in_ns "$(node_ns "$i")" nft "$@"
}

case ${1:-} in
  images) shift; cmd_images "$@" ;;
  import) shift; cmd_import "$@" ;;
  tag) shift; cmd_tag "$@" ;;
  install) shift; cmd_install "$@" ;;
  helm) shift; helm_admin "$@" ;;
  nft) shift; cmd_nft "$@" ;;
  cleanup) cmd_cleanup ;;
  dns) cmd_dns ;;
  start) shift; cmd_start "$@" ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  smoke) cmd_smoke ;;
  env) cmd_env ;;
  kubectl) shift; kubectl_admin "$@" ;;
  *) sed -n '2,34p' "$0"; exit 2 ;;
esac
