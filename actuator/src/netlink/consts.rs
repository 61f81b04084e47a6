//! Kernel numbers of netlink and nfnetlink themselves (uapi `linux/netlink.h`,
//! `linux/netfilter/nfnetlink.h`), shared by nf_tables (nft/consts.rs has its own) and
//! ctnetlink.
#![allow(dead_code)] // a complete, checked table is easier to review than a minimal one

pub use netlink_packet_core::{
    NLM_F_ACK, NLM_F_ACK_TLVS, NLM_F_APPEND, NLM_F_CAPPED, NLM_F_CREATE, NLM_F_DUMP, NLM_F_REQUEST,
};

// ---- netlink ----
pub const NLMSG_HDRLEN: usize = 16;
pub const NLMSG_ERROR: u16 = 2;
pub const NLMSG_DONE: u16 = 3;
pub const NLA_F_NESTED: u16 = 0x8000;
pub const NLA_F_NET_BYTEORDER: u16 = 0x4000;
pub const NLA_TYPE_MASK: u16 = !(NLA_F_NESTED | NLA_F_NET_BYTEORDER);
pub const NLA_HDRLEN: usize = 4;
/// `nla_len` is a u16: no attribute, nested ones included, can be longer.
pub const NLA_MAX_LEN: usize = u16::MAX as usize;
pub const NLMSGERR_ATTR_MSG: u16 = 1;
pub const NLMSGERR_ATTR_OFFS: u16 = 2;

// ---- nfnetlink ----
/// `struct nfgenmsg`: family, version, res_id (the subsystem, big-endian, on batch markers).
pub const NFGENMSG_LEN: usize = 4;
pub const NFNETLINK_V0: u8 = 0;
/// nlmsghdr + nfgenmsg, where the attributes of every nfnetlink message start.
pub const NFNL_HEADER_LEN: usize = NLMSG_HDRLEN + NFGENMSG_LEN;
