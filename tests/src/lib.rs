//! Shared test harness for splitproxy.
//!
//! Tests use real components instead of mocks (docs/testing.md): a real etcd and
//! kube-apiserver, real network namespaces with veths and routes, and real packets. This crate
//! gives every test the same building blocks so that each end-to-end test only describes its
//! scenario:
//!
//! - [`tools`] finds the pinned third-party binaries (building them on demand),
//! - [`controlplane`] runs etcd and kube-apiserver on loopback with throwaway state,
//! - [`netns`] creates network namespaces and runs code or processes inside them,
//! - [`topology`] wires namespaces into a small dual-stack cluster network (fabric, nodes,
//!   pods, external clients),
//! - [`podserver`] runs the "who answered, on which endpoint, and whom did it see" server
//!   inside a pod,
//! - [`probe()`] sends one TCP or UDP request (or an HTTP GET) from a namespace and classifies the
//!   outcome,
//! - [`lab`] runs a whole installation (API server, brains, actuators, Node objects, pods for
//!   EndpointSlices) and probes from pods, nodes, external clients or addresses,
//! - [`scenario`] loads scenario directories (lab.yaml, Kubernetes YAML, probes.yaml) and
//!   replays their probes,
//! - [`manifests`] applies rendered manifests (helm template output) server-side,
//! - [`install`] installs the chart on the lab's nodes as a cluster runs it (pods from its
//!   templates with their rendered arguments, tokens, ConfigMaps and EndpointSlices),
//! - [`certs`] issues the CA, server and client certificates for mTLS and the API server,
//! - [`portfwd`] lets processes inside a namespace reach listeners on host loopback,
//! - [`process`] keeps spawned processes from outliving the test and offers wait helpers,
//! - [`otlp`] receives the OpenTelemetry traces brains and actuators export (OTLP gRPC),
//! - [`traffic`] keeps a bounded loop of new connections running while a fault test breaks things.
//!
//! Safety: everything that touches interfaces, routes, sysctls or nftables happens inside
//! namespaces created here (`ip -n <ns> ...` or a thread that has entered the namespace), and
//! every namespace is deleted when its owner is dropped, also while a test panics.

// One exception, reviewed: `install` sets up a child's private mount namespace before exec.
#![deny(unsafe_code)]

pub mod certs;
pub mod cluster;
pub mod controlplane;
pub mod deploy;
pub mod explain;
pub mod fixtures;
pub mod images;
pub mod install;
pub mod lab;
pub mod manifests;
pub mod netns;
pub mod otlp;
pub mod podserver;
pub mod portfwd;
pub mod probe;
pub mod process;
pub mod scenario;
pub mod tools;
pub mod topology;
pub mod traffic;

pub use controlplane::{ControlPlane, ControlPlaneOptions};
pub use netns::Netns;
pub use podserver::PodServer;
pub use portfwd::{Forwarder, forward_port};
pub use probe::{HttpResult, ProbeResult, Proto, http_get, probe, probe_async};
pub use topology::{Cluster, ClusterSpec, ExternalClient, Node, Pod, PodNetwork};

/// The result type used throughout the harness; errors carry their context chain.
pub type Result<T, E = anyhow::Error> = std::result::Result<T, E>;
