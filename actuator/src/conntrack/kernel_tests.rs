//! The cleanup against the kernel, in a private network namespace: real UDP flows through a
//! real DNAT table applied by the [`Applier`], then a commit that removes endpoints, then the
//! cleanup; `conntrack -L` (conntrack-tools, run inside the namespace) says what is left.
//!
//! Topology, all in the test's namespace: a veth `ctv0` with the client address 10.0.0.1 and
//! two "endpoint" addresses 10.0.0.2 and 10.0.0.3 (local; nothing listens on UDP: the flows
//! are refused, which leaves their conntrack entries in place); Service addresses
//! 10.96.0.0/16 routed out of `ctv0`, where nothing answers. No packet leaves the namespace.

use splitproxy_proto::family::IpFamily;
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::time::Duration;

use splitproxy_proto::model::Model;
use splitproxy_proto::v1::{
    BaseChain, Chain, ChainType, CmpOp, Expr, Family, Hook, Immediate, Lookup, MetaKey, Nat,
    NatType, Rule, Ruleset, Table, Update, expr::Kind,
};

use super::tests::{TABLE, TCP, destination, endpoint, endpoints_map, no_endpoints_set};
use super::*;
use crate::apply::Applier;
use crate::nft::NftSocket;
use crate::nft::tests::fixture::{cmp, ip_daddr, lookup, meta, th_dport};
use crate::nft::tests::netns::{self, Netns};

fn e(kind: Kind) -> Expr {
    Expr { kind: Some(kind) }
}

/// `[ip daddr | 0.0.0.0] . meta l4proto . th dport . 0 map @service-endpoints` then DNAT to
/// the `addr . port` it yields (slot 0 only: each test flow's endpoint is known).
fn dnat_rule(any_address: bool) -> Rule {
    let mut exprs = vec![ip_daddr(0)];
    if any_address {
        // Node port: only to the node's address, looked up as 0.0.0.0.
        exprs.push(cmp(CmpOp::Eq, 0, &[10, 0, 0, 1]));
        exprs.push(e(Kind::Immediate(Immediate {
            dreg: 0,
            data: vec![0; 4],
        })));
    }
    exprs.extend([
        meta(MetaKey::L4proto, 1),
        th_dport(2),
        e(Kind::Immediate(Immediate {
            dreg: 3,
            data: vec![0; 4],
        })),
        e(Kind::Lookup(Lookup {
            has_dreg: true,
            dreg: 0,
            ..lookup("service-endpoints", 0)
        })),
        e(Kind::Nat(Nat {
            r#type: NatType::Dnat as i32,
            family: Family::Ip as i32,
            has_addr: true,
            reg_addr: 0,
            has_proto: true,
            reg_proto: 1,
            flags: 0,
        })),
    ]);
    Rule {
        exprs,
        comment: String::new(),
    }
}

fn ruleset(endpoints: Vec<Element>, idle: Vec<Element>) -> Ruleset {
    Ruleset {
        tables: vec![Table {
            family: Family::Ip as i32,
            name: TABLE.to_owned(),
            comment: String::new(),
            sets: vec![
                endpoints_map("service-endpoints", IpFamily::V4, endpoints),
                no_endpoints_set("no-endpoint-services", IpFamily::V4, idle),
            ],
            chains: vec![Chain {
                name: "nat-output".to_owned(),
                base: Some(BaseChain {
                    hook: Hook::Output as i32,
                    r#type: ChainType::Nat as i32,
                    priority: -100,
                    policy_drop: false,
                }),
                comment: String::new(),
                rules: vec![dnat_rule(false), dnat_rule(true)],
            }],
        }],
    }
}

/// One line of `conntrack -L`: protocol, original destination, reply source.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Listed {
    proto: String,
    orig_dst: String,
    reply_src: String,
}

fn list(ns: &Netns) -> Vec<Listed> {
    let out = ns.run("conntrack", &["-L"]);
    let mut all: Vec<Listed> = out
        .lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            let proto = words.next()?.to_owned();
            let pairs: Vec<(&str, &str)> = line
                .split_whitespace()
                .filter_map(|w| w.split_once('='))
                .collect();
            let nth = |key: &str, n: usize| {
                pairs
                    .iter()
                    .filter(|(k, _)| *k == key)
                    .nth(n)
                    .map(|(_, v)| *v)
            };
            Some(Listed {
                proto,
                orig_dst: format!("{}:{}", nth("dst", 0)?, nth("dport", 0)?),
                reply_src: format!("{}:{}", nth("src", 1)?, nth("sport", 1)?),
            })
        })
        .collect();
    all.sort();
    all
}

fn listed(proto: &str, orig_dst: &str, reply_src: &str) -> Listed {
    Listed {
        proto: proto.into(),
        orig_dst: orig_dst.into(),
        reply_src: reply_src.into(),
    }
}

/// The module doc's topology; false (after saying why) when the tools are missing.
fn topology(ns: &Netns) -> bool {
    if !netns::tool_works("conntrack", "--version") || !netns::tool_works("ip", "-V") {
        eprintln!("SKIP: `conntrack` (conntrack-tools) or `ip` is not installed");
        return false;
    }
    for cmd in [
        "link set lo up",
        "link add ctv0 type veth peer name ctv1",
        "link set ctv0 up",
        "link set ctv1 up",
        "addr add 10.0.0.1/24 dev ctv0",
        "addr add 10.0.0.2/32 dev ctv0",
        "addr add 10.0.0.3/32 dev ctv0",
        "route add 10.96.0.0/16 dev ctv0 src 10.0.0.1",
    ] {
        ns.run("ip", &cmd.split(' ').collect::<Vec<_>>());
    }
    true
}

#[test]
fn kernel_cleanup_deletes_exactly_the_stale_udp_entries() {
    netns::run(
        "kernel_cleanup_deletes_exactly_the_stale_udp_entries",
        |ns| {
            if !topology(ns) {
                return;
            }
            let before = ruleset(
                vec![
                    endpoint("10.96.0.10", UDP, 53, 0, "10.0.0.2", 5353),
                    endpoint("10.96.0.11", UDP, 53, 0, "10.0.0.3", 5353),
                    endpoint("10.96.0.12", UDP, 53, 0, "10.0.0.2", 5353),
                    endpoint("10.96.0.13", TCP, 80, 0, "10.0.0.2", 8080),
                    endpoint("0.0.0.0", UDP, 30053, 0, "10.0.0.3", 5353),
                ],
                vec![
                    destination("10.96.0.20", UDP, 53),
                    destination("10.96.0.21", UDP, 53),
                ],
            );
            let after = ruleset(
                vec![
                    // 10.96.0.10 lost its only endpoint; 10.96.0.11 is untouched; 10.96.0.12 got
                    // a second endpoint and 10.0.0.2 moved to slot 1; the TCP Service and the node
                    // port are gone; 10.96.0.20 got an endpoint.
                    endpoint("10.96.0.11", UDP, 53, 0, "10.0.0.3", 5353),
                    endpoint("10.96.0.12", UDP, 53, 0, "10.0.0.3", 5353),
                    endpoint("10.96.0.12", UDP, 53, 1, "10.0.0.2", 5353),
                    endpoint("10.96.0.20", UDP, 53, 0, "10.0.0.3", 5353),
                ],
                vec![destination("10.96.0.21", UDP, 53)],
            );
            let mut applier = Applier::new(NftSocket::open().unwrap(), TABLE.to_owned());
            let update = |generation| Update {
                brain_epoch: 1,
                generation,
                ..Update::default()
            };
            let first = applier
                .apply_snapshot(&update(1), Model::from_ruleset(&before))
                .unwrap()
                .conntrack;
            assert!(
                first.iter().next().is_none() && first.resyncs(),
                "the first commit resyncs, nothing else: {first:?}"
            );

            // One flow to each destination.
            for dst in [
                "10.96.0.10:53",
                "10.96.0.11:53",
                "10.96.0.12:53",
                "10.96.0.20:53",
                "10.96.0.21:53",
                "10.0.0.1:30053",
            ] {
                let udp = UdpSocket::bind("10.0.0.1:0").unwrap();
                udp.send_to(b"query", dst).unwrap();
            }
            // A TCP connection, kept open (a refused one's entry dies with the reset).
            let server = TcpListener::bind("10.0.0.2:8080").unwrap();
            let tcp: SocketAddr = "10.96.0.13:80".parse().unwrap();
            let _client = TcpStream::connect_timeout(&tcp, Duration::from_secs(2)).unwrap();
            let _accepted = server.accept().unwrap();

            let udp = |d: &str, r: &str| listed("udp", d, r);
            let mut want = vec![
                udp("10.96.0.10:53", "10.0.0.2:5353"),
                udp("10.96.0.11:53", "10.0.0.3:5353"),
                udp("10.96.0.12:53", "10.0.0.2:5353"),
                udp("10.96.0.20:53", "10.96.0.20:53"),
                udp("10.96.0.21:53", "10.96.0.21:53"),
                udp("10.0.0.1:30053", "10.0.0.3:5353"),
                listed("tcp", "10.96.0.13:80", "10.0.0.2:8080"),
            ];
            want.sort();
            assert_eq!(list(ns), want, "the flows went through the DNAT table");
            // The kernel filters the dump to UDP.
            let dumped = CtSocket::open()
                .unwrap()
                .dump_udp(netlink::AF_INET)
                .unwrap();
            assert_eq!(dumped.len(), 6, "{dumped:?}");

            let plan = applier
                .apply_snapshot(&update(2), Model::from_ruleset(&after))
                .unwrap()
                .conntrack;
            let sa = |s: &str| s.parse::<SocketAddr>().unwrap();
            assert_eq!(
                plan.iter().copied().collect::<Vec<_>>(),
                vec![
                    Stale {
                        dst: sa("0.0.0.0:30053"),
                        via: Via::Endpoint(sa("10.0.0.3:5353")),
                    },
                    Stale {
                        dst: sa("10.96.0.10:53"),
                        via: Via::Endpoint(sa("10.0.0.2:5353")),
                    },
                    Stale {
                        dst: sa("10.96.0.20:53"),
                        via: Via::NotNat,
                    },
                ]
            );
            let metrics = crate::metrics::Metrics::default();
            let mut cleaner = Cleaner::new();
            assert_eq!(cleaner.clean(&plan, &metrics), 3);

            let mut kept = vec![
                udp("10.96.0.11:53", "10.0.0.3:5353"),
                udp("10.96.0.12:53", "10.0.0.2:5353"),
                udp("10.96.0.21:53", "10.96.0.21:53"),
                listed("tcp", "10.96.0.13:80", "10.0.0.2:8080"),
            ];
            kept.sort();
            assert_eq!(list(ns), kept);
            let text = metrics.render();
            assert!(
                text.contains("splitproxy_actuator_conntrack_entries_deleted_total 3\n"),
                "{text}"
            );
            assert!(text.contains("splitproxy_actuator_conntrack_cleanup_errors_total 0\n"));

            // Cleaning again finds nothing more (the entries are gone, nothing else matches).
            assert_eq!(cleaner.clean(&plan, &metrics), 0);
            assert_eq!(list(ns), kept);
        },
    );
}

/// A restarted actuator's first commit: no previous model, the kernel's entries from before.
/// Entries whose reply comes from none of their destination's endpoints now go; destinations
/// the new model does not list, and entries to a destination still without endpoints that
/// were not DNATed, stay.
#[test]
fn kernel_first_commit_resyncs_udp_entries_from_before_a_restart() {
    netns::run(
        "kernel_first_commit_resyncs_udp_entries_from_before_a_restart",
        |ns| {
            if !topology(ns) {
                return;
            }
            let before = ruleset(
                vec![
                    endpoint("10.96.0.10", UDP, 53, 0, "10.0.0.2", 5353),
                    endpoint("10.96.0.11", UDP, 53, 0, "10.0.0.3", 5353),
                    endpoint("10.96.0.12", UDP, 53, 0, "10.0.0.2", 5353),
                    endpoint("10.96.0.14", UDP, 53, 0, "10.0.0.2", 5353),
                    endpoint("0.0.0.0", UDP, 30053, 0, "10.0.0.3", 5353),
                ],
                vec![
                    destination("10.96.0.20", UDP, 53),
                    destination("10.96.0.21", UDP, 53),
                ],
            );
            let update = |generation| Update {
                brain_epoch: 1,
                generation,
                ..Update::default()
            };
            let mut first_run = Applier::new(NftSocket::open().unwrap(), TABLE.to_owned());
            first_run
                .apply_snapshot(&update(1), Model::from_ruleset(&before))
                .unwrap();
            for dst in [
                "10.96.0.10:53",
                "10.96.0.11:53",
                "10.96.0.12:53",
                "10.96.0.14:53",
                "10.96.0.20:53",
                "10.96.0.21:53",
                "10.0.0.1:30053",
            ] {
                let udp = UdpSocket::bind("10.0.0.1:0").unwrap();
                udp.send_to(b"query", dst).unwrap();
            }
            assert_eq!(list(ns).len(), 7, "{:?}", list(ns));
            drop(first_run);

            // While no actuator ran: 10.96.0.11 and the node port moved to the other address,
            // 10.96.0.12 lost 10.0.0.2, 10.96.0.20 got an endpoint, 10.96.0.14 went (unknown
            // now), 10.96.0.10 and 10.96.0.21 stayed as they were.
            let mut restart = ruleset(
                vec![
                    endpoint("10.96.0.10", UDP, 53, 0, "10.0.0.2", 5353),
                    endpoint("10.96.0.11", UDP, 53, 0, "10.0.0.2", 5353),
                    endpoint("10.96.0.12", UDP, 53, 0, "10.0.0.3", 5353),
                    endpoint("10.96.0.20", UDP, 53, 0, "10.0.0.3", 5353),
                    endpoint("0.0.0.0", UDP, 30053, 0, "10.0.0.2", 5353),
                ],
                vec![destination("10.96.0.21", UDP, 53)],
            );
            restart.tables[0].sets.push(splitproxy_proto::v1::Set {
                name: crate::healthcheck::NODEPORT_IPS.to_owned(),
                key: vec![splitproxy_proto::v1::DataType::Ipv4Addr as i32],
                elements: vec![Element {
                    key: vec![Datum {
                        value: Some(Value::Ipv4(vec![10, 0, 0, 1])),
                    }],
                    ..Element::default()
                }],
                ..splitproxy_proto::v1::Set::default()
            });
            let mut second_run = Applier::new(NftSocket::open().unwrap(), TABLE.to_owned());
            let plan = second_run
                .apply_snapshot(&update(1), Model::from_ruleset(&restart))
                .unwrap()
                .conntrack;
            let metrics = crate::metrics::Metrics::default();
            assert_eq!(Cleaner::new().clean(&plan, &metrics), 4, "{:?}", list(ns));
            let udp = |d: &str, r: &str| listed("udp", d, r);
            let mut kept = vec![
                udp("10.96.0.10:53", "10.0.0.2:5353"),
                udp("10.96.0.14:53", "10.0.0.2:5353"),
                udp("10.96.0.21:53", "10.96.0.21:53"),
            ];
            kept.sort();
            assert_eq!(list(ns), kept);
        },
    );
}
