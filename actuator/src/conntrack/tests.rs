//! What a commit leaves stale ([`Plan::between`]) and which entries that selects, on models
//! built here; `kernel_tests.rs` runs the same against the kernel's conntrack table.

use splitproxy_proto::family::IpFamily;
use std::net::{IpAddr, SocketAddr};

use splitproxy_proto::model::Model;
use splitproxy_proto::v1::{
    ConntrackRole, DataType, Datum, Element, Family, Ruleset, Set, Table, datum::Value,
};

use super::*;

pub(crate) const TABLE: &str = "splitproxy";
pub(crate) const TCP: u32 = 6;

pub(crate) fn addr(a: &str) -> Datum {
    let value = match a.parse::<IpAddr>().unwrap() {
        IpAddr::V4(a) => Value::Ipv4(a.octets().to_vec()),
        IpAddr::V6(a) => Value::Ipv6(a.octets().to_vec()),
    };
    Datum { value: Some(value) }
}

fn num(value: Value) -> Datum {
    Datum { value: Some(value) }
}

/// `dst . proto . port . slot : to . to_port`
pub(crate) fn endpoint(
    dst: &str,
    proto: u32,
    port: u32,
    slot: u32,
    to: &str,
    to_port: u32,
) -> Element {
    Element {
        key: vec![
            addr(dst),
            num(Value::Proto(proto)),
            num(Value::Port(port)),
            num(Value::U32(slot)),
        ],
        data: vec![addr(to), num(Value::Port(to_port))],
        ..Element::default()
    }
}

/// `dst . proto . port`
pub(crate) fn destination(dst: &str, proto: u32, port: u32) -> Element {
    Element {
        key: vec![addr(dst), num(Value::Proto(proto)), num(Value::Port(port))],
        ..Element::default()
    }
}

pub(crate) fn endpoints_map(name: &str, family: IpFamily, elements: Vec<Element>) -> Set {
    use DataType::*;
    let ip = match family {
        IpFamily::V4 => Ipv4Addr,
        IpFamily::V6 => Ipv6Addr,
    };
    Set {
        name: name.to_owned(),
        key: vec![
            ip as i32,
            InetProto as i32,
            InetService as i32,
            Integer as i32,
        ],
        data: vec![ip as i32, InetService as i32],
        elements,
        conntrack: ConntrackRole::Endpoints as i32,
        ..Set::default()
    }
}

pub(crate) fn no_endpoints_set(name: &str, family: IpFamily, elements: Vec<Element>) -> Set {
    use DataType::*;
    let ip = match family {
        IpFamily::V4 => Ipv4Addr,
        IpFamily::V6 => Ipv6Addr,
    };
    Set {
        name: name.to_owned(),
        key: vec![ip as i32, InetProto as i32, InetService as i32],
        elements,
        conntrack: ConntrackRole::NoEndpoints as i32,
        ..Set::default()
    }
}

fn model(family: Family, sets: Vec<Set>) -> Model {
    Model::from_ruleset(&Ruleset {
        tables: vec![Table {
            family: family as i32,
            name: TABLE.to_owned(),
            sets,
            ..Table::default()
        }],
    })
}

fn sa(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

fn to(dst: &str, ep: &str) -> Stale {
    Stale {
        dst: sa(dst),
        via: Via::Endpoint(sa(ep)),
    }
}

fn not_nat(dst: &str) -> Stale {
    Stale {
        dst: sa(dst),
        via: Via::NotNat,
    }
}

fn plan(old: &Model, new: &Model) -> Vec<Stale> {
    Plan::between(old, new).iter().copied().collect()
}

#[test]
fn removed_or_replaced_udp_endpoints_are_stale() {
    let old = model(
        Family::Ip,
        vec![endpoints_map(
            "eps",
            IpFamily::V4,
            vec![
                endpoint("10.96.0.10", UDP, 53, 0, "10.244.1.5", 5353),
                endpoint("10.96.0.10", UDP, 53, 1, "10.244.2.6", 5353),
                endpoint("10.96.0.10", TCP, 53, 0, "10.244.1.5", 5353),
                endpoint("10.96.0.11", UDP, 53, 0, "10.244.3.7", 53),
                endpoint("0.0.0.0", UDP, 30053, 0, "10.244.1.5", 5353),
            ],
        )],
    );
    let new = model(
        Family::Ip,
        vec![endpoints_map(
            "eps",
            IpFamily::V4,
            vec![
                // Slot 1 gone, slot 0 now goes to a new endpoint: 10.244.1.5 lost the Service,
                // 10.244.2.6 too.
                endpoint("10.96.0.10", UDP, 53, 0, "10.244.9.9", 5353),
                // TCP cleans itself up.
                endpoint("0.0.0.0", UDP, 30053, 0, "10.244.1.5", 5353),
                endpoint("10.96.0.11", UDP, 53, 0, "10.244.3.7", 53),
            ],
        )],
    );
    assert_eq!(
        plan(&old, &new),
        vec![
            to("10.96.0.10:53", "10.244.1.5:5353"),
            to("10.96.0.10:53", "10.244.2.6:5353"),
        ]
    );
    // Removing the node port: any local address, by port.
    let gone = model(
        Family::Ip,
        vec![endpoints_map(
            "eps",
            IpFamily::V4,
            vec![endpoint("10.96.0.11", UDP, 53, 0, "10.244.3.7", 53)],
        )],
    );
    assert!(plan(&new, &gone).contains(&to("0.0.0.0:30053", "10.244.1.5:5353")));
    // Nothing changed, nothing to do; the whole table gone, everything UDP.
    assert!(plan(&old, &old.clone()).is_empty());
    assert_eq!(plan(&gone, &Model::default()).len(), 1);
}

#[test]
fn an_endpoint_still_serving_under_another_slot_is_not_stale() {
    let old = model(
        Family::Ip,
        vec![endpoints_map(
            "eps",
            IpFamily::V4,
            vec![
                endpoint("10.96.0.10", UDP, 53, 0, "10.244.1.5", 5353),
                endpoint("10.96.0.10", UDP, 53, 1, "10.244.2.6", 5353),
            ],
        )],
    );
    // Endpoint count 2 -> 3: the slots are dealt again.
    let new = model(
        Family::Ip,
        vec![endpoints_map(
            "eps",
            IpFamily::V4,
            vec![
                endpoint("10.96.0.10", UDP, 53, 0, "10.244.2.6", 5353),
                endpoint("10.96.0.10", UDP, 53, 1, "10.244.3.3", 5353),
                endpoint("10.96.0.10", UDP, 53, 2, "10.244.1.5", 5353),
                // Same endpoint address and port, other destination: irrelevant.
                endpoint("10.96.0.11", UDP, 53, 0, "10.244.1.5", 5353),
            ],
        )],
    );
    assert!(plan(&old, &new).is_empty());
    // An endpoint that stays under the same port number of another destination does not
    // count, nor does the same address on another port.
    let new = model(
        Family::Ip,
        vec![endpoints_map(
            "eps",
            IpFamily::V4,
            vec![
                endpoint("10.96.0.10", UDP, 53, 0, "10.244.2.6", 5353),
                endpoint("10.96.0.10", UDP, 53, 1, "10.244.1.5", 5354),
            ],
        )],
    );
    assert_eq!(
        plan(&old, &new),
        vec![to("10.96.0.10:53", "10.244.1.5:5353")]
    );
    // A change to another map of the same table (a map re-created under a new name) still
    // serves the endpoint.
    let moved = model(
        Family::Ip,
        vec![endpoints_map(
            "eps-2",
            IpFamily::V4,
            vec![
                endpoint("10.96.0.10", UDP, 53, 0, "10.244.1.5", 5353),
                endpoint("10.96.0.10", UDP, 53, 1, "10.244.2.6", 5353),
            ],
        )],
    );
    assert!(plan(&old, &moved).is_empty());
}

#[test]
fn destinations_that_got_endpoints_lose_their_unnatted_entries() {
    let idle = |elements| {
        model(
            Family::Ip6,
            vec![no_endpoints_set("none", IpFamily::V6, elements)],
        )
    };
    let old = idle(vec![
        destination("fd00:96::10", UDP, 53),
        destination("fd00:96::10", TCP, 80),
        destination("::", UDP, 30053),
    ]);
    let mut renamed = destination("fd00:96::10", UDP, 53);
    renamed.comment = "default/dns:udp".into();
    let new = idle(vec![renamed]);
    assert_eq!(plan(&old, &new), vec![not_nat("[::]:30053")]);
}

#[test]
fn sets_without_a_role_are_ignored() {
    let plain = |elements| {
        let mut s = endpoints_map("eps", IpFamily::V4, elements);
        s.conntrack = ConntrackRole::None as i32;
        model(Family::Ip, vec![s])
    };
    let old = plain(vec![endpoint("10.96.0.10", UDP, 53, 0, "10.244.1.5", 5353)]);
    assert!(plan(&old, &plain(vec![])).is_empty());
}

fn entry(orig: (&str, &str), reply: (&str, &str), proto: u8) -> Entry {
    let (os, od) = (sa(orig.0), sa(orig.1));
    let (rs, rd) = (sa(reply.0), sa(reply.1));
    Entry {
        family: if od.is_ipv4() { 2 } else { 10 },
        orig: Tuple {
            src: os.ip(),
            dst: od.ip(),
            proto,
            sport: os.port(),
            dport: od.port(),
        },
        reply: Tuple {
            src: rs.ip(),
            dst: rd.ip(),
            proto,
            sport: rs.port(),
            dport: rd.port(),
        },
        id: None,
        zone: None,
    }
}

#[test]
fn selects_entries_like_kube_proxy_filters() {
    let client = "10.0.0.1:40000";
    let p: Plan = [
        to("10.96.0.10:53", "10.244.1.5:5353"),
        to("0.0.0.0:30053", "10.244.1.5:5353"),
        not_nat("10.96.0.20:53"),
    ]
    .into_iter()
    .collect();
    let entries = [
        // 0: DNATed to the stale endpoint: stale.
        entry((client, "10.96.0.10:53"), ("10.244.1.5:5353", client), 17),
        // 1: same destination, another endpoint: kept.
        entry((client, "10.96.0.10:53"), ("10.244.2.6:5353", client), 17),
        // 2: TCP: kept.
        entry((client, "10.96.0.10:53"), ("10.244.1.5:5353", client), 6),
        // 3: node port on any local address: stale.
        entry(
            (client, "192.168.1.7:30053"),
            ("10.244.1.5:5353", client),
            17,
        ),
        // 4: never DNATed, to a destination that got endpoints: stale.
        entry((client, "10.96.0.20:53"), ("10.96.0.20:53", client), 17),
        // 5: to the same destination but DNATed already: kept.
        entry((client, "10.96.0.20:53"), ("10.244.1.5:5353", client), 17),
        // 6: another port of the stale destination: kept.
        entry((client, "10.96.0.10:54"), ("10.244.1.5:5353", client), 17),
    ];
    let picked: Vec<usize> = p
        .select(&entries, None)
        .into_iter()
        .map(|e| entries.iter().position(|x| std::ptr::eq(x, e)).unwrap())
        .collect();
    assert_eq!(picked, vec![0, 3, 4]);
    assert_eq!(p.families(), [netlink::AF_INET].into_iter().collect());
}

#[test]
fn an_empty_plan_touches_no_socket() {
    let mut c = Cleaner::new();
    let m = crate::metrics::Metrics::default();
    assert_eq!(c.clean(&Plan::default(), &m), 0);
    assert!(c.socket.is_none());
}

/// NodePort maps are keyed `proto . port . slot` (no address): a port on every local address.
#[test]
fn nodeport_keys_without_an_address_mean_every_local_address() {
    use DataType::*;
    let np = |port: u32, slot: u32, ep: &str| Element {
        key: vec![
            num(Value::Proto(UDP)),
            num(Value::Port(port)),
            num(Value::U32(slot)),
        ],
        data: vec![addr(ep), num(Value::Port(5353))],
        ..Element::default()
    };
    let map = |elements| Set {
        name: "nodeport-endpoints".to_owned(),
        key: vec![InetProto as i32, InetService as i32, Integer as i32],
        data: vec![Ipv4Addr as i32, InetService as i32],
        elements,
        conntrack: ConntrackRole::Endpoints as i32,
        ..Set::default()
    };
    let old = model(
        Family::Ip,
        vec![map(vec![
            np(30053, 0, "10.244.1.5"),
            np(30053, 1, "10.244.2.6"),
        ])],
    );
    let new = model(Family::Ip, vec![map(vec![np(30053, 0, "10.244.2.6")])]);
    assert_eq!(
        plan(&old, &new),
        vec![to("0.0.0.0:30053", "10.244.1.5:5353")]
    );
}
