//! Which guard elements a commit removes ([`Plan::between`]) and which dumped entries that
//! selects, on models built here; `kernel_tests.rs` runs the same against a kernel map.

use splitproxy_proto::family::IpFamily;
use std::net::IpAddr;

use splitproxy_proto::model::Model;
use splitproxy_proto::v1::{
    DataType, Datum, Element, Family, Ruleset, RulesetDelta, Set, SetElements, Table, TableRemoval,
    datum::Value,
};

use super::*;

pub(crate) const TABLE: &str = "splitproxy";
pub(crate) const TCP: u32 = 6;
pub(crate) const UDP: u32 = 17;
pub(crate) const AFFINITY: &str = "affinity";
pub(crate) const MEMBERS: &str = "affinity-members";

fn addr(a: &str) -> Datum {
    let value = match a.parse::<IpAddr>().unwrap() {
        IpAddr::V4(a) => Value::Ipv4(a.octets().to_vec()),
        IpAddr::V6(a) => Value::Ipv6(a.octets().to_vec()),
    };
    Datum { value: Some(value) }
}

fn num(value: Value) -> Datum {
    Datum { value: Some(value) }
}

/// The guarded map: `client . destination . proto . port -> endpoint . port`.
pub(crate) fn affinity_map(family: IpFamily) -> Set {
    use DataType::*;
    let ip = match family {
        IpFamily::V4 => Ipv4Addr,
        IpFamily::V6 => Ipv6Addr,
    };
    Set {
        name: AFFINITY.to_owned(),
        key: vec![ip as i32, ip as i32, InetProto as i32, InetService as i32],
        data: vec![ip as i32, InetService as i32],
        timeout: true,
        default_timeout_ms: 10_800_000,
        dynamic: true,
        ..Set::default()
    }
}

/// The guard set: `destination . proto . port . endpoint . port`.
pub(crate) fn members_set(family: IpFamily, elements: Vec<Element>) -> Set {
    use DataType::*;
    let ip = match family {
        IpFamily::V4 => Ipv4Addr,
        IpFamily::V6 => Ipv6Addr,
    };
    Set {
        name: MEMBERS.to_owned(),
        key: vec![
            ip as i32,
            InetProto as i32,
            InetService as i32,
            ip as i32,
            InetService as i32,
        ],
        guards: AFFINITY.to_owned(),
        elements,
        ..Set::default()
    }
}

/// `dst . proto . port . ep . ep_port`
pub(crate) fn member(dst: &str, proto: u32, port: u32, ep: &str, ep_port: u32) -> Element {
    Element {
        key: vec![
            addr(dst),
            num(Value::Proto(proto)),
            num(Value::Port(port)),
            addr(ep),
            num(Value::Port(ep_port)),
        ],
        ..Element::default()
    }
}

/// The map entry `client . dst . proto . port : ep . ep_port` as the IR writes it.
pub(crate) fn entry(
    client: &str,
    dst: &str,
    proto: u32,
    port: u32,
    ep: &str,
    ep_port: u32,
) -> Element {
    Element {
        key: vec![
            addr(client),
            addr(dst),
            num(Value::Proto(proto)),
            num(Value::Port(port)),
        ],
        data: vec![addr(ep), num(Value::Port(ep_port))],
        ..Element::default()
    }
}

fn octets(a: &str) -> Vec<u8> {
    match a.parse::<IpAddr>().unwrap() {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

/// The same entry as a dump returns it, laid out by hand: 4-byte slots, addresses and ports
/// in network order, the protocol's byte then 3 bytes of padding.
fn raw(client: &str, dst: &str, proto: u8, port: u16, ep: &str, ep_port: u16) -> RawElement {
    let mut key = octets(client);
    key.extend(octets(dst));
    key.extend([proto, 0, 0, 0]);
    key.extend(port.to_be_bytes());
    key.extend([0, 0]);
    let mut data = octets(ep);
    data.extend(ep_port.to_be_bytes());
    data.extend([0, 0]);
    RawElement { key, data }
}

fn table(family: Family, sets: Vec<Set>) -> Table {
    Table {
        family: family as i32,
        name: TABLE.to_owned(),
        sets,
        ..Table::default()
    }
}

pub(crate) fn ruleset(members: Vec<Element>) -> Ruleset {
    Ruleset {
        tables: vec![table(
            Family::Ip,
            vec![
                affinity_map(IpFamily::V4),
                members_set(IpFamily::V4, members),
            ],
        )],
    }
}

fn removal(family: Family) -> TableRemoval {
    TableRemoval {
        family: family as i32,
        name: TABLE.to_owned(),
        ..TableRemoval::default()
    }
}

/// `old` with `elements` of the guard set removed, as a delta does it (structure shared).
fn without(old: &Model, family: Family, elements: Vec<Element>) -> Model {
    let mut new = old.clone();
    new.apply(&RulesetDelta {
        upsert: vec![],
        remove: vec![TableRemoval {
            elements: vec![SetElements {
                set: MEMBERS.to_owned(),
                elements,
            }],
            ..removal(family)
        }],
    });
    new
}

fn members() -> Vec<Element> {
    vec![
        member("10.96.0.10", UDP, 53, "10.0.0.2", 5353),
        member("10.96.0.10", UDP, 53, "10.0.0.3", 5353),
        member("10.96.0.11", TCP, 80, "10.0.0.2", 8080),
        member("10.96.0.12", TCP, 80, "10.0.0.2", 8080),
    ]
}

fn table_key(family: Family) -> TableKey {
    (family, TABLE.to_owned())
}

#[test]
fn a_removed_guard_selects_exactly_the_entries_it_vouched_for() {
    let old = Model::from_ruleset(&ruleset(members()));
    let new = without(
        &old,
        Family::Ip,
        vec![
            member("10.96.0.10", UDP, 53, "10.0.0.2", 5353),
            member("10.96.0.12", TCP, 80, "10.0.0.2", 8080),
        ],
    );
    let plan = Plan::between(&old, &new);
    assert_eq!(plan.len(), 2);
    let dumped = vec![
        raw("10.0.0.1", "10.96.0.10", 17, 53, "10.0.0.2", 5353), // goes
        raw("10.0.0.5", "10.96.0.10", 17, 53, "10.0.0.2", 5353), // goes: any client
        raw("10.0.0.6", "10.96.0.10", 17, 53, "10.0.0.3", 5353), // other endpoint
        raw("10.0.0.7", "10.96.0.10", 6, 53, "10.0.0.2", 5353),  // other protocol
        raw("10.0.0.9", "10.96.0.10", 17, 54, "10.0.0.2", 5353), // other port
        raw("10.0.0.1", "10.96.0.10", 17, 53, "10.0.0.2", 5354), // other endpoint port
        raw("10.0.0.5", "10.96.0.11", 6, 80, "10.0.0.2", 8080),  // guard kept
        raw("10.0.0.8", "10.96.0.12", 6, 80, "10.0.0.2", 8080),  // goes
        RawElement {
            key: vec![0; 12],
            data: vec![0; 8],
        }, // not this map's layout
    ];
    let picked = plan.select(&table_key(Family::Ip), AFFINITY, &dumped);
    assert_eq!(picked, vec![&dumped[0], &dumped[1], &dumped[7]]);
    // Only that map of that table.
    assert!(
        plan.select(&table_key(Family::Ip6), AFFINITY, &dumped)
            .is_empty()
    );
    assert!(
        plan.select(&table_key(Family::Ip), MEMBERS, &dumped)
            .is_empty()
    );
}

#[test]
fn the_ir_entry_and_the_dumped_bytes_agree() {
    // The hand layout of `raw` is what the encoder sends for the same IR entry.
    let map = affinity_map(IpFamily::V4);
    let layout = DataMapLayout::new(&map).unwrap();
    let e = entry("10.0.0.1", "10.96.0.10", UDP, 53, "10.0.0.2", 5353);
    let mut from_ir = Vec::new();
    layout
        .encode_tail(0, &[e.key, e.data].concat(), &mut from_ir)
        .unwrap();
    let r = raw("10.0.0.1", "10.96.0.10", 17, 53, "10.0.0.2", 5353);
    assert_eq!(from_ir, [r.key, r.data].concat());
}

#[test]
fn ipv6_entries_use_16_byte_addresses() {
    let guard = member("fd00::10", TCP, 80, "fd00:1::2", 8080);
    let old = Model::from_ruleset(&Ruleset {
        tables: vec![table(
            Family::Ip6,
            vec![
                affinity_map(IpFamily::V6),
                members_set(IpFamily::V6, vec![guard.clone()]),
            ],
        )],
    });
    let new = without(&old, Family::Ip6, vec![guard]);
    let plan = Plan::between(&old, &new);
    assert_eq!(plan.len(), 1);
    let dumped = vec![
        raw("fd00::1", "fd00::10", 6, 80, "fd00:1::2", 8080),
        raw("fd00::1", "fd00::10", 6, 80, "fd00:1::3", 8080),
    ];
    assert_eq!(dumped[0].key.len(), 40);
    assert_eq!(
        plan.select(&table_key(Family::Ip6), AFFINITY, &dumped),
        vec![&dumped[0]]
    );
}

#[test]
fn nothing_to_do_unless_a_guard_element_goes() {
    let old = Model::from_ruleset(&ruleset(members()));
    let nothing = |new: &Model| assert!(Plan::between(&old, new).is_empty());

    // Unchanged (shared), rebuilt equal, an element added, an element changed in place.
    nothing(&old.clone());
    nothing(&Model::from_ruleset(&ruleset(members())));
    let mut more = members();
    more.push(member("10.96.0.13", TCP, 80, "10.0.0.4", 8080));
    nothing(&Model::from_ruleset(&ruleset(more)));
    let mut commented = members();
    commented[0].comment = "ns/svc:dns".to_owned();
    nothing(&Model::from_ruleset(&ruleset(commented)));

    // The guard set, the map or the table removed whole.
    let remove = |r: TableRemoval| {
        let mut new = old.clone();
        new.apply(&RulesetDelta {
            upsert: vec![],
            remove: vec![r],
        });
        new
    };
    for set in [MEMBERS, AFFINITY] {
        nothing(&remove(TableRemoval {
            sets: vec![set.to_owned()],
            ..removal(Family::Ip)
        }));
    }
    nothing(&remove(TableRemoval {
        whole: true,
        ..removal(Family::Ip)
    }));

    // The map re-created (its definition changed): the kernel's is new and empty.
    let mut rs = ruleset(members()[1..].to_vec());
    rs.tables[0].sets[0].default_timeout_ms = 60_000;
    nothing(&Model::from_ruleset(&rs));

    // A set that guards nothing.
    let mut rs = ruleset(members());
    rs.tables[0].sets[1].guards.clear();
    let plain = Model::from_ruleset(&rs);
    assert!(Plan::between(&plain, &without(&plain, Family::Ip, members())).is_empty());

    // A guard set re-created with another definition still counts what it lost.
    let mut rs = ruleset(members()[1..].to_vec());
    rs.tables[0].sets[1].comment = "redefined".to_owned();
    assert_eq!(Plan::between(&old, &Model::from_ruleset(&rs)).len(), 1);
}

#[test]
fn guard_elements_that_do_not_fit_the_map_are_ignored() {
    let mut bad = member("10.96.0.10", UDP, 53, "10.0.0.2", 5353);
    bad.key.pop();
    let good = member("10.96.0.11", TCP, 80, "10.0.0.2", 8080);
    // The model holds what it is given; only the encoder checks elements against their set.
    let old = Model::from_ruleset(&ruleset(vec![good.clone(), bad.clone()]));
    let new = without(&old, Family::Ip, vec![bad, good]);
    let plan = Plan::between(&old, &new);
    assert_eq!(plan.len(), 1);
    let dumped = vec![raw("10.0.0.1", "10.96.0.11", 6, 80, "10.0.0.2", 8080)];
    assert_eq!(
        plan.select(&table_key(Family::Ip), AFFINITY, &dumped).len(),
        1
    );

    // A guard naming a set that is not a data map: nothing.
    let mut rs = ruleset(members());
    rs.tables[0].sets[1].guards = MEMBERS.to_owned();
    let old = Model::from_ruleset(&rs);
    assert!(Plan::between(&old, &without(&old, Family::Ip, members())).is_empty());
}

#[test]
fn plans_of_successive_commits_add_up() {
    let m0 = Model::from_ruleset(&ruleset(members()));
    let m1 = without(&m0, Family::Ip, vec![members()[0].clone()]);
    let m2 = without(&m1, Family::Ip, vec![members()[3].clone()]);
    let mut plan = Plan::between(&m0, &m1);
    plan.extend(Plan::between(&m1, &m2));
    assert_eq!(plan, Plan::between(&m0, &m2));
    assert_eq!(plan.len(), 2);
    plan.extend(Plan::default());
    assert_eq!(plan.len(), 2);
}

#[test]
fn an_empty_plan_costs_no_socket() {
    let metrics = Metrics::default();
    let mut cleaner = Cleaner::new();
    assert_eq!(cleaner.clean(&Plan::default(), &metrics), 0);
    assert!(cleaner.socket.is_none());
    let text = metrics.render();
    assert!(text.contains("splitproxy_actuator_affinity_entries_deleted_total 0\n"));
    assert!(text.contains("splitproxy_actuator_affinity_cleanup_errors_total 0\n"));
}
