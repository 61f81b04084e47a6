//! The reader (nft/read.rs) against the real kernel, in private network namespaces: what the
//! applier committed reads back as exactly the same model (digest included), what the packet
//! path adds is left out, and tampering with `nft` reads back as a different model.

use std::time::Instant;

use splitproxy_proto::model::Model;
use splitproxy_proto::v1::{
    Chain, ConntrackRole, DataType, Element, Family, Ruleset, Set, Table, Update, update::Body,
};

use super::fixture::{self, TABLE, TCP, UDP};
use super::netns;
use crate::apply::Applier;
use crate::nft::datum::tests::{int, ip4, port, proto};
use crate::nft::read::insert_elements;
use crate::nft::{NftSocket, comparable};

fn set(name: &str, key: &[DataType], data: &[DataType], elements: Vec<Element>) -> Set {
    Set {
        name: name.to_owned(),
        key: key.iter().map(|t| *t as i32).collect(),
        data: data.iter().map(|t| *t as i32).collect(),
        elements,
        ..Set::default()
    }
}

fn ip6(last: u8) -> splitproxy_proto::v1::Datum {
    let mut a = [0u8; 16];
    a[0] = 0xfd;
    a[15] = last;
    splitproxy_proto::v1::Datum {
        value: Some(splitproxy_proto::v1::datum::Value::Ipv6(a.to_vec())),
    }
}

/// The fixture table plus what it lacks and the brain sends: single-field and concatenated
/// ranges (pod CIDRs, load-balancer source ranges), userspace roles (conntrack, guards), an
/// integer-keyed map (health check ports), and an `ip6` table.
pub(crate) fn ruleset() -> Ruleset {
    use DataType::*;
    let mut ip = fixture::table();
    for s in &mut ip.sets {
        if s.name == "service-endpoints" {
            s.conntrack = ConntrackRole::Endpoints as i32;
        }
        if s.name == "no-endpoint-services" {
            s.conntrack = ConntrackRole::NoEndpoints as i32;
        }
    }
    let range = |a: [u8; 4], b: [u8; 4]| Element {
        key: vec![ip4(a)],
        key_end: vec![ip4(b)],
        ..Element::default()
    };
    ip.sets.extend([
        Set {
            interval: true,
            comment: "This node's pod CIDRs".to_owned(),
            ..set(
                "local-pod-cidrs",
                &[Ipv4Addr],
                &[],
                vec![
                    range([10, 244, 0, 0], [10, 244, 0, 255]),
                    // Adjacent to the first: an end and a start on the same value.
                    range([10, 244, 1, 0], [10, 244, 1, 255]),
                    range([192, 168, 7, 7], [192, 168, 7, 7]),
                    // Runs to the largest address: no end entry in the kernel.
                    range([240, 0, 0, 0], [255, 255, 255, 255]),
                ],
            )
        },
        Set {
            interval: true,
            ..set(
                "firewall-allow",
                &[Ipv4Addr, InetProto, InetService, Ipv4Addr],
                &[],
                vec![Element {
                    key: vec![
                        ip4([203, 0, 113, 1]),
                        proto(TCP),
                        port(443),
                        ip4([1, 2, 0, 0]),
                    ],
                    key_end: vec![
                        ip4([203, 0, 113, 1]),
                        proto(TCP),
                        port(443),
                        ip4([1, 2, 255, 255]),
                    ],
                    ..Element::default()
                }],
            )
        },
        Set {
            guards: "affinity".to_owned(),
            ..set(
                "affinity-members",
                &[Ipv4Addr, InetProto, InetService, Ipv4Addr, InetService],
                &[],
                vec![Element {
                    key: vec![
                        ip4([10, 96, 0, 10]),
                        proto(UDP),
                        port(53),
                        ip4([10, 244, 0, 3]),
                        port(53),
                    ],
                    ..Element::default()
                }],
            )
        },
        set(
            "health-check-nodeports",
            &[InetService],
            &[Integer],
            vec![Element {
                key: vec![port(30500)],
                data: vec![int(2)],
                ..Element::default()
            }],
        ),
    ]);
    let ip6 = Table {
        family: Family::Ip6 as i32,
        name: TABLE.to_owned(),
        comment: "managed by splitproxy".to_owned(),
        chains: vec![Chain {
            name: "services".to_owned(),
            ..Chain::default()
        }],
        sets: vec![set(
            "cluster-ips",
            &[Ipv6Addr],
            &[],
            vec![
                Element {
                    key: vec![ip6(1)],
                    ..Element::default()
                },
                Element {
                    key: vec![ip6(10)],
                    ..Element::default()
                },
            ],
        )],
    };
    Ruleset {
        tables: vec![ip, ip6],
    }
}

fn snapshot(model: &Model) -> Update {
    Update {
        brain_epoch: 1,
        generation: 1,
        digest: model.digest(),
        body: Some(Body::Snapshot(model.to_ruleset())),
        ..Update::default()
    }
}

/// Applies `rs` through the applier, as a brain's snapshot would.
fn applied(rs: &Ruleset) -> Applier<NftSocket> {
    let mut applier = Applier::new(NftSocket::open().unwrap(), TABLE.to_owned());
    applier.apply(&snapshot(&Model::from_ruleset(rs))).unwrap();
    applier
}

#[test]
fn kernel_reads_back_exactly_what_was_committed() {
    netns::run("kernel_reads_back_exactly_what_was_committed", |ns| {
        let mut applier = applied(&ruleset());
        let want = comparable(applier.model());
        let read = applier.kernel_mut().read_tables(TABLE).unwrap();
        assert_eq!(read.model.to_ruleset(), want.to_ruleset());
        assert_eq!(read.model.digest(), want.digest());
        assert_eq!(read.model.digest(), applier.model().digest());

        // Nothing committed, nothing changed: the same generation.
        assert_eq!(applier.kernel_mut().generation().unwrap(), read.generation);
        // What the packet path adds is not compared; the generation still moves.
        ns.nft(&["add", "element", "ip", TABLE, "affinity", "{ 10.1.2.3 }"]);
        let again = applier.kernel_mut().read_tables(TABLE).unwrap();
        assert_ne!(again.generation, read.generation);
        assert_eq!(again.model.digest(), want.digest());

        // Tampering reads back as a different model.
        ns.nft(&[
            "delete",
            "element",
            "ip",
            TABLE,
            "cluster-ips",
            "{ 10.96.0.99 }",
        ]);
        let tampered = applier.kernel_mut().read_tables(TABLE).unwrap();
        assert_ne!(tampered.model.digest(), want.digest());
        let delta = want.diff(&tampered.model);
        assert_eq!(delta.remove.len(), 1, "{delta:?}");
        assert_eq!(delta.remove[0].elements[0].set, "cluster-ips");

        // `nft` still lists every set, splitproxy's userdata record notwithstanding.
        let text = ns.nft(&["list", "table", "ip", TABLE]);
        assert!(text.contains("map health-check-nodeports"), "{text}");

        // Gone tables read as absent.
        ns.nft(&["delete", "table", "ip6", TABLE]);
        ns.nft(&["delete", "table", "ip", TABLE]);
        let gone = applier.kernel_mut().read_tables(TABLE).unwrap();
        assert!(gone.model.tables.is_empty());
    });
}

/// A set `nft` made (no splitproxy userdata) is not one the reader takes for its own.
#[test]
fn kernel_read_refuses_a_set_it_did_not_make() {
    netns::run("kernel_read_refuses_a_set_it_did_not_make", |ns| {
        let mut applier = applied(&ruleset());
        ns.nft(&["add", "set", "ip", TABLE, "rogue", "{ type ipv4_addr; }"]);
        let err = applier.kernel_mut().read_tables(TABLE).unwrap_err();
        assert!(matches!(err, crate::nft::ReadError::Decode(_)), "{err:?}");
    });
}

/// 10,000 Services x 10 endpoints in the fixture's shape: 10,000 ClusterIPs, Service ports
/// and 100,000 endpoint slots. Read back whole and compared; prints the time the read took.
#[test]
fn kernel_reads_10k_services_back() {
    netns::run("kernel_reads_10k_services_back", |_| {
        let (services, endpoints) = (10_000u32, 10u32);
        let mut rs = ruleset();
        let ip = &mut rs.tables[0];
        let addr = |i: u32| {
            [
                10,
                96 + (i / 65536) as u8,
                (i / 256 % 256) as u8,
                (i % 256) as u8,
            ]
        };
        for s in &mut ip.sets {
            match s.name.as_str() {
                "cluster-ips" => {
                    s.elements = (0..services)
                        .map(|i| Element {
                            key: vec![ip4(addr(i))],
                            ..Element::default()
                        })
                        .collect()
                }
                "service-endpoints" => {
                    s.elements = (0..services)
                        .flat_map(|i| {
                            (0..endpoints).map(move |k| {
                                let n = i * endpoints + k;
                                fixture::endpoint(
                                    addr(i),
                                    TCP,
                                    80,
                                    k,
                                    [
                                        10,
                                        128 + (n / 65536 % 64) as u8,
                                        (n / 256 % 256) as u8,
                                        (n % 256) as u8,
                                    ],
                                    8080,
                                )
                            })
                        })
                        .collect()
                }
                _ => {}
            }
        }
        if let Some(s) = ip
            .sets
            .iter_mut()
            .find(|s| s.name == "no-endpoint-services")
        {
            s.elements = (0..services)
                .map(|i| fixture::service_port(addr(i), TCP, 81, ""))
                .collect();
        }
        let mut applier = applied(&rs);
        let elements = applier.model().element_count();
        let t = Instant::now();
        let read = applier.kernel_mut().read_tables(TABLE).unwrap();
        let took = t.elapsed();
        let t = Instant::now();
        let equal = read.model.digest() == applier.model().digest();
        let compare = t.elapsed();
        let t = Instant::now();
        let generation = applier.kernel_mut().generation().unwrap();
        let gen_took = t.elapsed();
        eprintln!(
            "read {elements} elements of {services} Services x {endpoints} back in {took:?} \
             (digest compare {compare:?}); generation check {gen_took:?}"
        );
        assert!(equal);
        assert_eq!(generation, read.generation);
    });
}

/// A set's dump that sends an element twice was torn by a resize of the kernel's hash table
/// (as many other elements are missing): the reader refuses it as interrupted, to read again,
/// and takes a dump that sends each element once.
#[test]
fn a_dump_that_repeats_an_element_is_torn() {
    let key = (Family::Ip, TABLE.to_owned());
    let elem = |last| Element {
        key: vec![ip4([10, 96, 0, last])],
        ..Element::default()
    };
    let empty = || {
        let mut model = Model::default();
        model.upsert_table(&key, "");
        model.upsert_set(
            &key,
            &set("cluster-ips", &[DataType::Ipv4Addr], &[], vec![]),
        );
        model
    };

    let mut whole = empty();
    insert_elements(
        &mut whole,
        &key,
        "cluster-ips",
        vec![elem(1), elem(2), elem(3)],
    )
    .unwrap();
    assert_eq!(whole.element_count(), 3);

    let mut torn = empty();
    let err = insert_elements(
        &mut torn,
        &key,
        "cluster-ips",
        vec![elem(1), elem(2), elem(1)],
    )
    .unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::Interrupted, "{err}");
    assert!(err.to_string().contains("cluster-ips"), "{err}");
}

/// A set grown from 3,000 to 100,000 elements in one transaction. The kernel resizes the
/// set's hash table in the background after the commit, and a dump that races the resize
/// repeats thousands of elements and skips as many (nft/read.rs): before the reader checked
/// for repeats, every read right after such a commit came back short. Read at once, the model
/// is exactly what was committed.
#[test]
fn kernel_reads_a_set_back_while_the_kernel_resizes_it() {
    netns::run(
        "kernel_reads_a_set_back_while_the_kernel_resizes_it",
        |_| {
            let endpoints = |count: u32| {
                let mut rs = ruleset();
                for s in &mut rs.tables[0].sets {
                    if s.name == "service-endpoints" {
                        s.elements = (0..count)
                            .map(|n| {
                                let pod = [10, 128 + (n / 65536) as u8, (n / 256) as u8, n as u8];
                                fixture::endpoint([10, 96, 0, 1], TCP, 80, n, pod, 8080)
                            })
                            .collect();
                    }
                }
                Model::from_ruleset(&rs)
            };
            let mut applier = applied(&endpoints(3_000).to_ruleset());
            let mut grown = snapshot(&endpoints(100_000));
            grown.generation = 2;
            applier.apply(&grown).unwrap();
            let read = applier.kernel_mut().read_tables(TABLE).unwrap();
            let want = comparable(applier.model());
            assert_eq!(
                read.model.element_count(),
                want.element_count(),
                "{:?}",
                want.diff(&read.model).remove.len()
            );
            assert_eq!(read.model.digest(), want.digest());
        },
    );
}
