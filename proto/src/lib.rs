//! `splitproxy.v1`: the brain/actuator protocol and the ruleset IR, generated from `proto/`,
//! plus what both sides must agree on byte for byte (the ruleset digest) and the nft-syntax
//! rendering used by logs, introspection and golden tests.
#![forbid(unsafe_code)]

pub mod compress;
pub mod explain;
pub mod family;
pub mod frames;
pub mod model;
pub mod parts;
pub mod process;
pub mod render;
pub mod telemetry;
pub mod transport;

#[allow(clippy::all, missing_docs)]
pub mod v1 {
    tonic::include_proto!("splitproxy.v1");
}

/// The brain's side of `splitproxy.v1.Dataplane`, streaming [`frames::UpdateFrame`]s.
#[allow(clippy::all, missing_docs)]
pub mod frames_server {
    include!(concat!(env!("OUT_DIR"), "/frames/splitproxy.v1.rs"));
}

/// Encoded `FileDescriptorSet` of splitproxy.v1, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("splitproxy_descriptor");

pub use v1::*;
