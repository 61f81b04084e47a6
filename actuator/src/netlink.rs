//! Netlink, as both of the actuator's netfilter clients use it: nf_tables (nft/) and conntrack
//! (conntrack/netlink.rs). One place walks received datagrams and decodes acknowledgements
//! and errors (`message`), reads and writes attributes (`attr`), and opens the socket, so that
//! a fix to any of them reaches both.
//!
//! Everything is encoded by hand rather than through `netlink-packet-*` object trees: a batch
//! of 100,000 set elements must cost a few memcpys, not an allocation per attribute (see
//! nft/mod.rs).

pub(crate) mod attr;
pub(crate) mod consts;
pub(crate) mod message;

use std::io;
use std::time::Duration;

use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_NETFILTER};
use nix::sys::socket::{setsockopt, sockopt};
use nix::sys::time::TimeVal;

/// A NETLINK_NETFILTER socket in the network namespace of the calling thread, talking to the
/// kernel: acknowledgements capped to the original header (NETLINK_CAP_ACK, so that a refusal
/// does not echo a 60 KiB message back), extended acks (the kernel's own words and the
/// offending attribute) if `ext_ack`, and reads that give up after `timeout`.
pub(crate) fn open(timeout: Duration, ext_ack: bool) -> io::Result<Socket> {
    let mut sock = Socket::new(NETLINK_NETFILTER)?;
    sock.bind_auto()?;
    sock.connect(&SocketAddr::new(0, 0))?;
    sock.set_cap_ack(true)?;
    if ext_ack {
        sock.set_ext_ack(true)?;
    }
    let timeout = TimeVal::new(timeout.as_secs() as _, timeout.subsec_micros() as _);
    setsockopt(&sock, sockopt::ReceiveTimeout, &timeout).map_err(io::Error::from)?;
    Ok(sock)
}
