//! `ExplainPacket`'s brain side: what the brain knows of a node beyond its ruleset's rules.
//! The evaluation itself is `splitproxy_proto::explain`, a pure function of the node's model
//! and the packet, which knows no set by name; the brain tells it which addresses are the
//! node's, from the set that lists them.
use std::net::IpAddr;

use splitproxy_proto::model::Model;
use splitproxy_proto::v1::datum::Value;

use crate::rules::sets::NODEPORT_IPS;

/// The node's addresses as its ruleset names them: the elements of `nodeport-ips` in every
/// table (its NodePort addresses: by default the Node's primary addresses, or those the
/// `--nodeport-addresses` CIDRs select). They decide local delivery and `fib saddr type local`
/// in the evaluation; a request adds others with `node_addresses`.
pub fn node_addresses(model: &Model) -> Vec<IpAddr> {
    let mut out = Vec::new();
    for table in model.tables.values() {
        let Some(set) = table.sets.get(NODEPORT_IPS) else {
            continue;
        };
        for e in set.decoded() {
            let ip = match e.key.first().and_then(|d| d.value.as_ref()) {
                Some(Value::Ipv4(b)) => <[u8; 4]>::try_from(&b[..]).ok().map(IpAddr::from),
                Some(Value::Ipv6(b)) => <[u8; 16]>::try_from(&b[..]).ok().map(IpAddr::from),
                _ => None,
            };
            out.extend(ip);
        }
    }
    out
}
