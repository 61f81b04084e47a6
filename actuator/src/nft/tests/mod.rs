//! Tests across modules: the IR fixture, an independent decode of whole batches with
//! `netlink-packet-netfilter`, and the kernel tests, which run in private network namespaces.

pub(crate) mod fixture;

mod crosscheck;
pub(crate) mod dump;
mod kernel;
mod kernel_ct;
pub(crate) mod netns;
mod read;
