//! Kubernetes objects for tests, as YAML a reader can compare with the scenario.
use std::fmt::Write;

/// One endpoint of a hand-written EndpointSlice.
#[derive(Debug, Clone)]
pub struct Ep {
    pub ip: String,
    pub node: String,
    pub ready: bool,
    pub pod: String,
}

impl Ep {
    pub fn new(ip: impl Into<String>, node: impl Into<String>, pod: impl Into<String>) -> Ep {
        Ep {
            ip: ip.into(),
            node: node.into(),
            ready: true,
            pod: pod.into(),
        }
    }
    pub fn not_ready(mut self) -> Ep {
        self.ready = false;
        self
    }
}

/// A selectorless ClusterIP Service: `ports` are (name, protocol, port, targetPort).
pub fn service(ns: &str, name: &str, cluster_ip: &str, ports: &[(&str, &str, u16, u16)]) -> String {
    let mut y = format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\n  namespace: {ns}\nspec:\n  clusterIP: {cluster_ip}\n  ports:\n"
    );
    for (pname, proto, port, target) in ports {
        let _ = writeln!(
            y,
            "    - {{name: {pname}, protocol: {proto}, port: {port}, targetPort: {target}}}"
        );
    }
    y
}

/// An EndpointSlice of Service `service`: `ports` are (name, protocol, port).
pub fn slice(
    ns: &str,
    name: &str,
    service: &str,
    ports: &[(&str, &str, u16)],
    eps: &[Ep],
) -> String {
    let mut y = format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}\n  namespace: {ns}\n  labels:\n    kubernetes.io/service-name: {service}\naddressType: IPv4\nports:\n"
    );
    for (pname, proto, port) in ports {
        let _ = writeln!(y, "  - {{name: {pname}, protocol: {proto}, port: {port}}}");
    }
    if eps.is_empty() {
        y.push_str("endpoints: []\n");
    } else {
        y.push_str("endpoints:\n");
    }
    for e in eps {
        let _ = writeln!(
            y,
            "  - addresses: [\"{}\"]\n    conditions: {{ready: {}, serving: {}}}\n    nodeName: {}\n    targetRef: {{kind: Pod, namespace: {ns}, name: {}}}",
            e.ip, e.ready, e.ready, e.node, e.pod
        );
    }
    y
}

pub fn namespace(name: &str) -> String {
    format!("apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {name}\n")
}

/// Joins YAML documents.
pub fn docs(parts: &[String]) -> String {
    parts.join("---\n")
}
