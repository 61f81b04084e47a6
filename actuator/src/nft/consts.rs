//! Kernel numbers of the nf_tables netlink protocol, from the uapi headers
//! `linux/netlink.h`, `linux/netfilter/nfnetlink.h`, `linux/netfilter/nf_tables.h` and
//! `linux/netfilter/nf_nat.h`, and of libnftnl's userdata (`libnftnl/udata.h`), which `nft`
//! reads back when it lists the ruleset. Only what the encoder uses is here.
#![allow(dead_code)] // a complete, checked table is easier to review than a minimal one

// ---- netlink and nfnetlink, shared with ctnetlink ----
pub use crate::netlink::consts::*;

// ---- nfnetlink ----
pub const NFNL_SUBSYS_NFTABLES: u16 = 10;
pub const NFNL_MSG_BATCH_BEGIN: u16 = 16; // NLMSG_MIN_TYPE
pub const NFNL_MSG_BATCH_END: u16 = 17;
pub const AF_UNSPEC: u8 = 0;

// ---- families (NFPROTO_*) ----
pub const NFPROTO_INET: u8 = 1;
pub const NFPROTO_IPV4: u8 = 2;
pub const NFPROTO_IPV6: u8 = 10;

// ---- message types (enum nf_tables_msg_types) ----
pub const NFT_MSG_NEWTABLE: u8 = 0;
pub const NFT_MSG_GETTABLE: u8 = 1;
pub const NFT_MSG_DELTABLE: u8 = 2;
pub const NFT_MSG_NEWCHAIN: u8 = 3;
pub const NFT_MSG_GETCHAIN: u8 = 4;
pub const NFT_MSG_DELCHAIN: u8 = 5;
pub const NFT_MSG_NEWRULE: u8 = 6;
pub const NFT_MSG_GETRULE: u8 = 7;
pub const NFT_MSG_DELRULE: u8 = 8;
pub const NFT_MSG_NEWSET: u8 = 9;
pub const NFT_MSG_GETSET: u8 = 10;
pub const NFT_MSG_DELSET: u8 = 11;
pub const NFT_MSG_NEWSETELEM: u8 = 12;
pub const NFT_MSG_GETSETELEM: u8 = 13;
pub const NFT_MSG_DELSETELEM: u8 = 14;
pub const NFT_MSG_NEWGEN: u8 = 15;
pub const NFT_MSG_GETGEN: u8 = 16;
/// NFTA_GEN_ID: the ruleset generation, bumped by every commit.
pub const NFTA_GEN_ID: u16 = 1;
/// A dump's objects changed while it ran (linux/netlink.h).
pub const NLM_F_DUMP_INTR: u16 = 0x10;
/// Linux >= 6.3: like DELTABLE, but no ENOENT when the table is absent.
pub const NFT_MSG_DESTROYTABLE: u8 = 26;
/// Linux >= 6.3: like DELSETELEM, but an element that is absent (expired meanwhile) is
/// skipped instead of failing the transaction with ENOENT.
pub const NFT_MSG_DESTROYSETELEM: u8 = 30;

// ---- generic list / expression / data attributes ----
pub const NFTA_LIST_ELEM: u16 = 1;
pub const NFTA_EXPR_NAME: u16 = 1;
pub const NFTA_EXPR_DATA: u16 = 2;
pub const NFTA_DATA_VALUE: u16 = 1;
pub const NFTA_DATA_VERDICT: u16 = 2;
pub const NFTA_VERDICT_CODE: u16 = 1;
pub const NFTA_VERDICT_CHAIN: u16 = 2;
/// NFT_DATA_VALUE_MAXLEN: longest constant the kernel accepts.
pub const NFT_DATA_VALUE_MAXLEN: usize = 64;

// ---- verdicts ----
pub const NF_DROP: i32 = 0;
pub const NF_ACCEPT: i32 = 1;
pub const NFT_CONTINUE: i32 = -1;
pub const NFT_JUMP: i32 = -3;
pub const NFT_GOTO: i32 = -4;
pub const NFT_RETURN: i32 = -5;

// ---- registers ----
pub const NFT_REG_VERDICT: u32 = 0;
pub const NFT_REG32_00: u32 = 8;
pub const NFT_REG32_COUNT: u32 = 16;

// ---- table ----
pub const NFTA_TABLE_NAME: u16 = 1;
pub const NFTA_TABLE_FLAGS: u16 = 2;
pub const NFTA_TABLE_USERDATA: u16 = 6;

// ---- chain ----
pub const NFTA_CHAIN_TABLE: u16 = 1;
pub const NFTA_CHAIN_NAME: u16 = 3;
pub const NFTA_CHAIN_HOOK: u16 = 4;
pub const NFTA_CHAIN_POLICY: u16 = 5;
pub const NFTA_CHAIN_TYPE: u16 = 7;
pub const NFTA_CHAIN_USERDATA: u16 = 12;
pub const NFTA_HOOK_HOOKNUM: u16 = 1;
pub const NFTA_HOOK_PRIORITY: u16 = 2;
// NF_INET_* hook numbers
pub const NF_INET_PRE_ROUTING: u32 = 0;
pub const NF_INET_LOCAL_IN: u32 = 1;
pub const NF_INET_FORWARD: u32 = 2;
pub const NF_INET_LOCAL_OUT: u32 = 3;
pub const NF_INET_POST_ROUTING: u32 = 4;

// ---- rule ----
pub const NFTA_RULE_TABLE: u16 = 1;
pub const NFTA_RULE_CHAIN: u16 = 2;
pub const NFTA_RULE_EXPRESSIONS: u16 = 4;
pub const NFTA_RULE_USERDATA: u16 = 7;

// ---- set ----
pub const NFTA_SET_TABLE: u16 = 1;
pub const NFTA_SET_NAME: u16 = 2;
pub const NFTA_SET_FLAGS: u16 = 3;
pub const NFTA_SET_KEY_TYPE: u16 = 4;
pub const NFTA_SET_KEY_LEN: u16 = 5;
pub const NFTA_SET_DATA_TYPE: u16 = 6;
pub const NFTA_SET_DATA_LEN: u16 = 7;
pub const NFTA_SET_DESC: u16 = 9;
pub const NFTA_SET_ID: u16 = 10;
pub const NFTA_SET_TIMEOUT: u16 = 11;
pub const NFTA_SET_USERDATA: u16 = 13;
pub const NFTA_SET_DESC_CONCAT: u16 = 2;
pub const NFTA_SET_FIELD_LEN: u16 = 1;
pub const NFT_SET_INTERVAL: u32 = 0x4;
pub const NFT_SET_MAP: u32 = 0x8;
pub const NFT_SET_TIMEOUT: u32 = 0x10;
pub const NFT_SET_EVAL: u32 = 0x20;
pub const NFT_SET_CONCAT: u32 = 0x80;
pub const NFT_DATA_VERDICT: u32 = 0xffff_ff00;
/// nft's TYPE_BITS: a concatenation's type id packs each field's type id in 6 bits.
pub const TYPE_BITS: u32 = 6;

// ---- set elements ----
pub const NFTA_SET_ELEM_LIST_TABLE: u16 = 1;
pub const NFTA_SET_ELEM_LIST_SET: u16 = 2;
pub const NFTA_SET_ELEM_LIST_ELEMENTS: u16 = 3;
pub const NFTA_SET_ELEM_KEY: u16 = 1;
pub const NFTA_SET_ELEM_DATA: u16 = 2;
pub const NFTA_SET_ELEM_FLAGS: u16 = 3;
pub const NFTA_SET_ELEM_TIMEOUT: u16 = 4;
pub const NFTA_SET_ELEM_USERDATA: u16 = 6;
pub const NFTA_SET_ELEM_KEY_END: u16 = 10;
pub const NFT_SET_ELEM_INTERVAL_END: u32 = 0x1;

// ---- expressions ----
pub const NFTA_IMMEDIATE_DREG: u16 = 1;
pub const NFTA_IMMEDIATE_DATA: u16 = 2;

pub const NFTA_BITWISE_SREG: u16 = 1;
pub const NFTA_BITWISE_DREG: u16 = 2;
pub const NFTA_BITWISE_LEN: u16 = 3;
pub const NFTA_BITWISE_MASK: u16 = 4;
pub const NFTA_BITWISE_XOR: u16 = 5;

pub const NFTA_CMP_SREG: u16 = 1;
pub const NFTA_CMP_OP: u16 = 2;
pub const NFTA_CMP_DATA: u16 = 3;

pub const NFTA_LOOKUP_SET: u16 = 1;
pub const NFTA_LOOKUP_SREG: u16 = 2;
pub const NFTA_LOOKUP_DREG: u16 = 3;
pub const NFTA_LOOKUP_FLAGS: u16 = 5;
pub const NFT_LOOKUP_F_INV: u32 = 1;

pub const NFTA_DYNSET_SET_NAME: u16 = 1;
pub const NFTA_DYNSET_OP: u16 = 3;
pub const NFTA_DYNSET_SREG_KEY: u16 = 4;
pub const NFTA_DYNSET_SREG_DATA: u16 = 5;
pub const NFTA_DYNSET_TIMEOUT: u16 = 6;

pub const NFTA_PAYLOAD_DREG: u16 = 1;
pub const NFTA_PAYLOAD_BASE: u16 = 2;
pub const NFTA_PAYLOAD_OFFSET: u16 = 3;
pub const NFTA_PAYLOAD_LEN: u16 = 4;
pub const NFT_PAYLOAD_LL_HEADER: u32 = 0;
pub const NFT_PAYLOAD_NETWORK_HEADER: u32 = 1;
pub const NFT_PAYLOAD_TRANSPORT_HEADER: u32 = 2;

pub const NFTA_META_DREG: u16 = 1;
pub const NFTA_META_KEY: u16 = 2;
pub const NFTA_META_SREG: u16 = 3;
pub const NFT_META_LEN: u32 = 0;
pub const NFT_META_PROTOCOL: u32 = 1;
pub const NFT_META_MARK: u32 = 3;
pub const NFT_META_IIF: u32 = 4;
pub const NFT_META_OIF: u32 = 5;
pub const NFT_META_IIFNAME: u32 = 6;
pub const NFT_META_OIFNAME: u32 = 7;
pub const NFT_META_NFPROTO: u32 = 15;
pub const NFT_META_L4PROTO: u32 = 16;
pub const NFT_META_PKTTYPE: u32 = 19;

pub const NFTA_CT_DREG: u16 = 1;
pub const NFTA_CT_KEY: u16 = 2;
/// NLA_U8: IP_CT_DIR_ORIGINAL (0) or IP_CT_DIR_REPLY (1).
pub const NFTA_CT_DIRECTION: u16 = 3;
pub const NFT_CT_STATE: u32 = 0;
pub const NFT_CT_STATUS: u32 = 2;
pub const NFT_CT_MARK: u32 = 3;
pub const NFT_CT_PROTOCOL: u32 = 10;
pub const NFT_CT_PROTO_SRC: u32 = 11;
pub const NFT_CT_PROTO_DST: u32 = 12;
pub const NFT_CT_SRC_IP: u32 = 19;
pub const NFT_CT_DST_IP: u32 = 20;
pub const NFT_CT_SRC_IP6: u32 = 21;
pub const NFT_CT_DST_IP6: u32 = 22;
pub const IP_CT_DIR_ORIGINAL: u8 = 0;
pub const IP_CT_DIR_REPLY: u8 = 1;

pub const NFTA_FIB_DREG: u16 = 1;
pub const NFTA_FIB_RESULT: u16 = 2;
pub const NFTA_FIB_FLAGS: u16 = 3;

pub const NFTA_NG_DREG: u16 = 1;
pub const NFTA_NG_MODULUS: u16 = 2;
pub const NFTA_NG_TYPE: u16 = 3;
pub const NFTA_NG_OFFSET: u16 = 4;

pub const NFTA_NAT_TYPE: u16 = 1;
pub const NFTA_NAT_FAMILY: u16 = 2;
pub const NFTA_NAT_REG_ADDR_MIN: u16 = 3;
pub const NFTA_NAT_REG_PROTO_MIN: u16 = 5;
pub const NFTA_NAT_FLAGS: u16 = 7;
pub const NFT_NAT_SNAT: u32 = 0;
pub const NFT_NAT_DNAT: u32 = 1;
pub const NF_NAT_RANGE_MAP_IPS: u32 = 1;
pub const NF_NAT_RANGE_PROTO_SPECIFIED: u32 = 2;

pub const NFTA_MASQ_FLAGS: u16 = 1;

pub const NFTA_REJECT_TYPE: u16 = 1;
pub const NFTA_REJECT_ICMP_CODE: u16 = 2;
pub const NFT_REJECT_ICMP_UNREACH: u32 = 0;
pub const NFT_REJECT_TCP_RST: u32 = 1;
pub const NFT_REJECT_ICMPX_UNREACH: u32 = 2;

// ---- libnftnl userdata (TLVs of u8 type, u8 length, value) ----
pub const NFTNL_UDATA_TABLE_COMMENT: u8 = 0;
pub const NFTNL_UDATA_CHAIN_COMMENT: u8 = 0;
pub const NFTNL_UDATA_RULE_COMMENT: u8 = 0;
pub const NFTNL_UDATA_SET_KEYBYTEORDER: u8 = 0;
pub const NFTNL_UDATA_SET_DATABYTEORDER: u8 = 1;
pub const NFTNL_UDATA_SET_COMMENT: u8 = 7;
pub const NFTNL_UDATA_SET_ELEM_COMMENT: u8 = 0;
/// splitproxy's own set userdata: what of the IR set the kernel does not keep (see
/// `set::IrRecord`). A type far above libnftnl's, which `nft` skips as unknown.
pub const SPLITPROXY_UDATA_SET_IR: u8 = 0xf0;
/// NFT_USERDATA_MAXLEN: the kernel refuses longer userdata.
pub const USERDATA_MAXLEN: usize = 256;
/// nft's `enum byteorder`.
pub const BYTEORDER_HOST_ENDIAN: u32 = 1;
pub const BYTEORDER_BIG_ENDIAN: u32 = 2;
/// NFTNL_UDATA_COMMENT_MAXLEN, counting the terminating NUL.
pub const COMMENT_MAXLEN: usize = 128;
/// NFT_NAME_MAXLEN, counting the terminating NUL.
pub const NAME_MAXLEN: usize = 256;
