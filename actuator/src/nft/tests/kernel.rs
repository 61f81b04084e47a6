//! The encoder against the real kernel. Every test runs in its own network namespace
//! (netns.rs) and skips, saying why, where it cannot create one.
//!
//! What the kernel holds is checked twice: with a netlink dump decoded by our own decoders
//! (dump.rs), and with `nft -j list ruleset` over the whole table, as an operator would read
//! it: every object the brain produces must be one `nft` can list.

use std::time::Instant;

use serde_json::Value;
use splitproxy_proto::v1::{
    BaseChain, Chain, ChainType, DataType, Element, Expr, Family, Hook, Lookup, Nat, NatType,
    Numgen, NumgenType, PayloadBase, Rule, Set, Table, expr::Kind,
};

use super::fixture::{self, TABLE, TCP};
use super::{dump, netns};
use crate::nft::consts::{NFPROTO_IPV4, NFPROTO_IPV6};
use crate::nft::datum::tests::{int, ip4, port, proto};
use crate::nft::{Batch, CommitError, NftSocket};

const IP: Family = Family::Ip;

/// Opens a socket and loads the fixture table.
fn load_fixture() -> NftSocket {
    let mut sock = NftSocket::open().unwrap();
    let mut batch = Batch::new();
    fixture::add_table(&mut batch, &fixture::table()).unwrap();
    sock.commit(&mut batch).unwrap();
    sock
}

fn commit(sock: &mut NftSocket, f: impl FnOnce(&mut Batch)) -> Result<(), CommitError> {
    let mut batch = Batch::new();
    f(&mut batch);
    sock.commit(&mut batch)
}

/// Elements in a stable order, to compare sets whatever order the kernel lists them in.
fn sorted(mut elements: Vec<Element>) -> Vec<Element> {
    elements.sort_by_key(|e| format!("{e:?}"));
    elements
}

fn set_named(name: &str) -> Set {
    fixture::sets()
        .into_iter()
        .find(|s| s.name == name)
        .unwrap()
}

/// The objects of kind `kind` ("set", "map", "chain", "rule", ...) in `nft -j` output.
fn objects<'a>(ruleset: &'a Value, kind: &str) -> Vec<&'a Value> {
    ruleset["nftables"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|o| o.get(kind))
        .collect()
}

fn named<'a>(objs: &[&'a Value], name: &str) -> &'a Value {
    objs.iter()
        .find(|o| o["name"] == name)
        .unwrap_or_else(|| panic!("{name} not listed"))
}

fn rules_of<'a>(ruleset: &'a Value, chain: &str) -> Vec<&'a Value> {
    objects(ruleset, "rule")
        .into_iter()
        .filter(|r| r["chain"] == chain)
        .collect()
}

#[test]
fn kernel_loads_the_splitproxy_table() {
    netns::run("kernel_loads_the_splitproxy_table", |ns| {
        let _sock = load_fixture();

        // What the kernel holds is exactly what we sent, rule by rule.
        for chain in fixture::chains() {
            let got = dump::rules(NFPROTO_IPV4, TABLE, &chain.name);
            assert_eq!(got, chain.rules, "rules of chain {}", chain.name);
        }
        for set in fixture::sets() {
            let got = dump::elements(NFPROTO_IPV4, TABLE, &set);
            assert_eq!(got.len(), set.elements.len(), "set {}", set.name);
            for e in &set.elements {
                assert!(got.contains(e), "set {}: {e:?} missing", set.name);
            }
        }

        // nft's view of the whole table: it must list every object.
        let rs = ns.ruleset();
        let tables = objects(&rs, "table");
        assert_eq!(tables.len(), 1);
        assert_eq!(tables[0]["name"], TABLE);
        assert_eq!(tables[0]["family"], "ip");
        // nft 1.0.6 prints table comments only as text.
        let text = ns.nft(&["list", "table", "ip", TABLE]);
        assert!(text.contains("comment \"managed by splitproxy\""), "{text}");

        let chains = objects(&rs, "chain");
        assert_eq!(chains.len(), fixture::chains().len());
        for (name, ty, hook, prio) in [
            ("nat-prerouting", "nat", "prerouting", -100),
            ("nat-output", "nat", "output", -100),
            ("nat-postrouting", "nat", "postrouting", 100),
            ("filter-forward", "filter", "forward", -110),
            ("filter-input", "filter", "input", -110),
            ("filter-output", "filter", "output", -110),
            ("filter-output-post-dnat", "filter", "output", -90),
        ] {
            let c = named(&chains, name);
            assert_eq!(c["type"], ty, "{name}");
            assert_eq!(c["hook"], hook, "{name}");
            assert_eq!(c["prio"], prio, "{name}");
            assert_eq!(c["policy"], "accept", "{name}");
        }
        for name in [
            "services",
            "service-endpoints-check",
            "cluster-ips-check",
            "nodeports",
        ] {
            assert!(
                named(&chains, name).get("hook").is_none(),
                "{name} is a regular chain"
            );
        }

        let sets = objects(&rs, "set");
        let maps = objects(&rs, "map");
        let concat = serde_json::json!(["ipv4_addr", "inet_proto", "inet_service"]);
        let cluster = named(&sets, "cluster-ips");
        assert_eq!(cluster["type"], "ipv4_addr");
        let elems = cluster["elem"].to_string();
        assert!(
            elems.contains("10.96.0.1\"") && elems.contains("kube-system/kube-dns"),
            "{elems}"
        );
        let none = named(&sets, "no-endpoint-services");
        assert_eq!(none["type"], concat);
        assert_eq!(
            none["elem"][0]["elem"]["val"]["concat"],
            serde_json::json!(["10.96.0.99", "tcp", 80])
        );
        assert_eq!(none["elem"][0]["elem"]["comment"], "default/idle:http");
        // One set per endpoint count, holding the Service ports with that many endpoints.
        for (n, want) in [
            (
                1,
                vec![
                    serde_json::json!(["10.96.0.10", "tcp", 53]),
                    serde_json::json!(["10.96.0.10", "udp", 53]),
                ],
            ),
            (2, vec![serde_json::json!(["10.96.0.1", "tcp", 443])]),
        ] {
            let s = named(&sets, &format!("service-ports-{n}"));
            assert_eq!(s["type"], concat);
            let mut got: Vec<Value> = s["elem"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| e["elem"]["val"]["concat"].clone())
                .collect();
            got.sort_by_key(|v| v.to_string());
            assert_eq!(got, want, "service-ports-{n}");
        }
        let endpoints = named(&maps, "service-endpoints");
        // Integers in concatenations are announced as marks (see datum.rs).
        assert_eq!(
            endpoints["type"],
            serde_json::json!(["ipv4_addr", "inet_proto", "inet_service", "mark"])
        );
        assert_eq!(endpoints["map"], "ipv4_addr . inet_service");
        let endpoint_elems = endpoints["elem"].as_array().unwrap();
        assert_eq!(endpoint_elems.len(), 4);
        for want in [
            r#"[{"concat":["10.96.0.1","tcp",443,0]},{"concat":["10.244.1.5",6443]}]"#,
            r#"[{"concat":["10.96.0.1","tcp",443,1]},{"concat":["10.244.2.7",6443]}]"#,
            r#"[{"concat":["10.96.0.10","udp",53,0]},{"concat":["10.244.0.3",53]}]"#,
            r#"[{"concat":["10.96.0.10","tcp",53,0]},{"concat":["10.244.0.3",53]}]"#,
        ] {
            let want: Value = serde_json::from_str(want).unwrap();
            assert!(
                endpoint_elems.contains(&want),
                "{want} not in {}",
                endpoints["elem"]
            );
        }
        let dispatch = named(&maps, "nodeport-dispatch");
        assert_eq!(
            dispatch["type"],
            serde_json::json!(["inet_proto", "inet_service"])
        );
        assert_eq!(dispatch["map"], "verdict");
        let dispatch_elems = dispatch["elem"].to_string();
        for want in [
            r#"[{"concat":["tcp",30443]},{"goto":{"target":"services"}}]"#,
            r#"[{"concat":["udp",30053]},{"drop":null}]"#,
        ] {
            assert!(
                dispatch_elems.contains(want),
                "{want} not in {dispatch_elems}"
            );
        }
        let affinity = named(&sets, "affinity");
        assert_eq!(affinity["timeout"], 10800);

        let exprs = |chain| -> Vec<Value> {
            rules_of(&rs, chain)
                .iter()
                .map(|r| r["expr"].clone())
                .collect()
        };
        let text = |chain| -> Vec<String> { exprs(chain).iter().map(Value::to_string).collect() };

        // The services chain: per endpoint count, the set match, then DNAT through the map
        // keyed by the Service port and a random slot below the count.
        let services = exprs("services");
        assert_eq!(services.len(), 2);
        let key = serde_json::json!({"concat": [
            {"payload": {"protocol": "ip", "field": "daddr"}},
            {"meta": {"key": "l4proto"}},
            {"payload": {"protocol": "th", "field": "dport"}},
        ]});
        for (n, rule) in [1, 2].into_iter().zip(&services) {
            assert_eq!(
                rule[0]["match"],
                serde_json::json!({"op": "==", "left": key, "right": format!("@service-ports-{n}")}),
                "services rule {n}: {rule}"
            );
            let mut slot_key = key.clone();
            slot_key["concat"]
                .as_array_mut()
                .unwrap()
                .push(serde_json::json!({"numgen": {"mode": "random", "mod": n, "offset": 0}}));
            assert_eq!(
                rule[1]["dnat"],
                serde_json::json!({
                    "family": "ip",
                    "addr": {"map": {"key": slot_key, "data": "@service-endpoints"}},
                }),
                "services rule {n}: {rule}"
            );
            assert_eq!(rule.as_array().unwrap().len(), 2, "{rule}");
        }
        // nft reads the rules the way the brain's renderer prints them (the golden files).
        let fixture_table = fixture::table();
        let ctx = splitproxy_proto::render::Context::of(&fixture_table);
        let listed = ns.nft(&["list", "chain", "ip", TABLE, "services"]);
        for r in fixture::rules_of("services") {
            let line = splitproxy_proto::render::rule_in(&ctx, &r);
            assert!(
                listed.lines().any(|l| l.trim() == line),
                "`{line}` not listed by nft:\n{listed}"
            );
        }

        // Refused: TCP with a reset, the rest with ICMP port unreachable. (nft hides the
        // `meta l4proto tcp` match as the dependency of the reset; the dump above holds it.)
        for chain in ["service-endpoints-check", "cluster-ips-check"] {
            let rules = text(chain);
            let set = if chain == "cluster-ips-check" {
                "@cluster-ips"
            } else {
                "@no-endpoint-services"
            };
            for (i, reject) in [
                r#"{"reject":{"type":"tcp reset"}}"#,
                r#"{"reject":{"expr":"port-unreachable","type":"icmp"}}"#,
            ]
            .into_iter()
            .enumerate()
            {
                assert!(
                    rules[i].contains(set) && rules[i].contains(reject),
                    "{chain} rule {i} lacks {set} or {reject}: {}",
                    rules[i]
                );
            }
        }
        let drop = &text("cluster-ips-check")[2];
        for word in [
            r#"{"prefix":{"addr":"10.96.0.0","len":16}}"#,
            "\"counter\"",
            "\"drop\"",
        ] {
            assert!(drop.contains(word), "drop rule lacks {word}: {drop}");
        }

        let nodeports = text("nodeports");
        for word in ["@affinity", "\"update\"", "\"mark\"", "\"timeout\":10800"] {
            assert!(
                nodeports[0].contains(word),
                "affinity rule lacks {word}: {}",
                nodeports[0]
            );
        }
        assert!(
            nodeports[1].contains(r#""vmap":{"data":"@nodeport-dispatch""#),
            "{}",
            nodeports[1]
        );
        let pre = text("nat-prerouting");
        assert!(pre[0].contains(r#""jump":{"target":"services"}"#));
        assert!(pre[1].contains("\"fib\"") && pre[1].contains("local"));
        assert!(text("nat-output")[0].contains(r#""jump":{"target":"services"}"#));
        assert!(text("nat-postrouting")[0].contains("\"masquerade\""));
        let ct_new = r#"{"match":{"left":{"ct":{"key":"state"}},"op":"in","right":"new"}}"#;
        for (chain, targets) in [
            (
                "filter-forward",
                &["service-endpoints-check", "cluster-ips-check"][..],
            ),
            ("filter-input", &["service-endpoints-check"][..]),
            ("filter-output", &["service-endpoints-check"][..]),
            ("filter-output-post-dnat", &["cluster-ips-check"][..]),
        ] {
            let rules = text(chain);
            assert_eq!(rules.len(), targets.len(), "{chain}");
            for (r, target) in rules.iter().zip(targets) {
                let jump = format!(r#""jump":{{"target":"{target}"}}"#);
                assert!(r.contains(ct_new) && r.contains(&jump), "{chain}: {r}");
            }
        }
    });
}

#[test]
fn kernel_rejected_batch_is_atomic_and_names_the_message() {
    netns::run(
        "kernel_rejected_batch_is_atomic_and_names_the_message",
        |_| {
            let mut sock = load_fixture();
            let cluster = set_named("cluster-ips");
            let new_ip = Element {
                key: vec![ip4([10, 96, 0, 2])],
                ..Element::default()
            };

            // A valid element, then a rule jumping to a chain that does not exist.
            let err = commit(&mut sock, |b| {
                b.add_elements(IP, TABLE, &cluster, std::slice::from_ref(&new_ip))
                    .unwrap();
                b.add_rule(IP, TABLE, "services", &fixture::jump("missing-chain"))
                    .unwrap();
            })
            .unwrap_err();
            eprintln!("rejected as expected: {err}");
            let CommitError::Rejected { failures } = &err else {
                panic!("{err:?}")
            };
            assert_eq!(failures[0].errno, 2, "{err}");
            assert_eq!(failures[0].message, Some(1));
            assert!(
                failures[0]
                    .description
                    .starts_with("add rule #1 to chain services"),
                "{err}"
            );
            assert!(err.rolled_back());
            // Atomic: the valid element of the failed transaction is not there.
            assert!(!dump::elements(NFPROTO_IPV4, TABLE, &cluster).contains(&new_ip));
            assert_eq!(
                dump::rules(NFPROTO_IPV4, TABLE, "services"),
                fixture::rules_of("services")
            );

            // An element for a set that does not exist.
            let missing = Set {
                name: "missing-set".to_owned(),
                ..cluster.clone()
            };
            let err = commit(&mut sock, |b| {
                b.add_elements(IP, TABLE, &missing, std::slice::from_ref(&new_ip))
                    .unwrap()
            })
            .unwrap_err();
            eprintln!("rejected as expected: {err}");
            assert_eq!(err.errno(), Some(2));
            assert!(
                err.to_string().contains("add elements to set missing-set"),
                "{err}"
            );

            // The third element clashes with an existing one (same key, other data): the kernel
            // points at it, and the two new elements before it are not applied either.
            let ips = set_named("service-endpoints");
            let elems = vec![
                fixture::endpoint([10, 96, 1, 1], TCP, 80, 0, [10, 244, 9, 1], 80),
                fixture::endpoint([10, 96, 1, 2], TCP, 80, 0, [10, 244, 9, 2], 80),
                fixture::endpoint([10, 96, 0, 1], TCP, 443, 1, [10, 244, 9, 3], 6443),
            ];
            let err = commit(&mut sock, |b| {
                b.add_elements(IP, TABLE, &ips, &elems).unwrap()
            })
            .unwrap_err();
            eprintln!("rejected as expected: {err}");
            assert_eq!(err.errno(), Some(17), "{err}"); // EEXIST
            assert!(err.to_string().contains("(element 2 of the call)"), "{err}");
            let now = dump::elements(NFPROTO_IPV4, TABLE, &ips);
            assert_eq!(now.len(), ips.elements.len());
            assert!(!now.contains(&elems[0]));
        },
    );
}

#[test]
fn kernel_commits_100k_elements_in_one_transaction() {
    netns::run("kernel_commits_100k_elements_in_one_transaction", |_| {
        let mut sock = load_fixture();
        let set = set_named("service-endpoints");
        let elems: Vec<Element> = (0..100_000u32)
            .map(|i| {
                let [_, a, b, c] = i.to_be_bytes();
                fixture::endpoint([10, 100 + a, b, c], TCP, 80, i % 4, [10, 244, b, c], 8080)
            })
            .collect();
        let mut batch = Batch::new();
        let started = Instant::now();
        batch.add_elements(IP, TABLE, &set, &elems).unwrap();
        let encoded = started.elapsed();
        assert!(
            batch.len() > 1 && batch.len() < 200,
            "{} messages",
            batch.len()
        );
        let started = Instant::now();
        sock.commit(&mut batch).unwrap();
        let committed = started.elapsed();
        println!(
            "100,000 elements: {} messages, {} bytes, encoded in {:?}, committed in {:?}",
            batch.len(),
            batch.byte_len(),
            encoded,
            committed
        );
        let total = set.elements.len() + elems.len();
        assert_eq!(dump::elements(NFPROTO_IPV4, TABLE, &set).len(), total);

        // Delete half of them, also in one transaction.
        let mut batch = Batch::new();
        batch
            .del_elements(IP, TABLE, &set, &elems[..50_000])
            .unwrap();
        let started = Instant::now();
        sock.commit(&mut batch).unwrap();
        println!("deleted 50,000 elements in {:?}", started.elapsed());
        // A dump right after a big delete may run while the kernel shrinks the set's hash table
        // in the background, and see an element twice or miss one; the kernel's content is
        // what a later dump shows, so read until it is consistent (bounded).
        let mut left = Vec::new();
        for _ in 0..40 {
            left = dump::elements(NFPROTO_IPV4, TABLE, &set);
            if left.len() == total - 50_000
                && !left.contains(&elems[0])
                && left.contains(&elems[50_000])
            {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        assert_eq!(left.len(), total - 50_000);
        assert!(!left.contains(&elems[0]) && left.contains(&elems[50_000]));
    });
}

#[test]
fn kernel_commits_a_10_mb_batch() {
    netns::run("kernel_commits_a_10_mb_batch", |_| {
        let mut sock = load_fixture();
        let set = set_named("service-endpoints");
        let elems: Vec<Element> = (0..240_000u32)
            .map(|i| {
                let [_, a, b, c] = i.to_be_bytes();
                fixture::endpoint([10, 100 + a, b, c], TCP, 443, i % 8, [10, 244, b, c], 8443)
            })
            .collect();
        let mut batch = Batch::new();
        batch.add_elements(IP, TABLE, &set, &elems).unwrap();
        assert!(batch.byte_len() > 10_000_000, "{} bytes", batch.byte_len());
        let started = Instant::now();
        sock.commit(&mut batch).unwrap();
        println!(
            "{} elements, {} messages, {} bytes committed in {:?}",
            elems.len(),
            batch.len(),
            batch.byte_len(),
            started.elapsed()
        );
    });
}

#[test]
fn kernel_deletes_elements() {
    netns::run("kernel_deletes_elements", |ns| {
        let mut sock = load_fixture();
        let cluster = set_named("cluster-ips");
        let dispatch = set_named("nodeport-dispatch");
        let endpoints = set_named("service-endpoints");
        commit(&mut sock, |b| {
            b.del_elements(IP, TABLE, &cluster, &cluster.elements[..1])
                .unwrap();
            b.del_elements(IP, TABLE, &dispatch, &dispatch.elements[1..])
                .unwrap();
            b.del_elements(IP, TABLE, &endpoints, &endpoints.elements[2..])
                .unwrap();
        })
        .unwrap();
        // The kernel lists hashed elements in its own order.
        assert_eq!(
            sorted(dump::elements(NFPROTO_IPV4, TABLE, &cluster)),
            sorted(cluster.elements[1..].to_vec())
        );
        assert_eq!(
            sorted(dump::elements(NFPROTO_IPV4, TABLE, &dispatch)),
            sorted(dispatch.elements[..1].to_vec())
        );
        assert_eq!(
            sorted(dump::elements(NFPROTO_IPV4, TABLE, &endpoints)),
            sorted(endpoints.elements[..2].to_vec())
        );

        // Deleting an element that is not there fails, and names the set.
        let err = commit(&mut sock, |b| {
            b.del_elements(IP, TABLE, &cluster, &cluster.elements[..1])
                .unwrap()
        })
        .unwrap_err();
        assert_eq!(err.errno(), Some(2), "{err}");
        assert!(
            err.to_string()
                .contains("delete elements from set cluster-ips"),
            "{err}"
        );

        let rs = ns.ruleset();
        let cluster_json = named(&objects(&rs, "set"), "cluster-ips")["elem"].to_string();
        assert!(
            !cluster_json.contains("\"10.96.0.1\"") && cluster_json.contains("10.96.0.10"),
            "{cluster_json}"
        );
        let dispatch_json = named(&objects(&rs, "map"), "nodeport-dispatch")["elem"].to_string();
        assert!(
            dispatch_json.contains("30443") && !dispatch_json.contains("30053"),
            "{dispatch_json}"
        );
        let endpoints_json = named(&objects(&rs, "map"), "service-endpoints")["elem"].to_string();
        assert!(
            endpoints_json.contains("10.244.2.7") && !endpoints_json.contains("10.244.0.3"),
            "{endpoints_json}"
        );
    });
}

#[test]
fn kernel_flush_chain_and_readd_rules() {
    netns::run("kernel_flush_chain_and_readd_rules", |_| {
        let mut sock = load_fixture();
        commit(&mut sock, |b| {
            b.flush_chain(IP, TABLE, "service-endpoints-check");
            b.flush_chain(IP, TABLE, "services");
        })
        .unwrap();
        assert!(dump::rules(NFPROTO_IPV4, TABLE, "service-endpoints-check").is_empty());
        assert!(dump::rules(NFPROTO_IPV4, TABLE, "services").is_empty());
        assert_eq!(
            dump::rules(NFPROTO_IPV4, TABLE, "cluster-ips-check"),
            fixture::rules_of("cluster-ips-check")
        );

        // Replace a chain's rules in one transaction: flush, then the new rules, in order.
        let new_rules = vec![fixture::drop_rule(), fixture::no_endpoints_rule(false)];
        let services = vec![
            fixture::dnat_rule(1),
            fixture::dnat_rule(2),
            fixture::dnat_rule(3),
        ];
        commit(&mut sock, |b| {
            b.flush_chain(IP, TABLE, "service-endpoints-check");
            for r in &new_rules {
                b.add_rule(IP, TABLE, "service-endpoints-check", r).unwrap();
            }
            // A new endpoint count: its set and its rule, no jump.
            let mut ports3 = set_named("service-ports-2");
            ports3.name = "service-ports-3".to_owned();
            b.add_set(IP, TABLE, &ports3).unwrap();
            for r in &services {
                b.add_rule(IP, TABLE, "services", r).unwrap();
            }
        })
        .unwrap();
        assert_eq!(
            dump::rules(NFPROTO_IPV4, TABLE, "service-endpoints-check"),
            new_rules
        );
        assert_eq!(dump::rules(NFPROTO_IPV4, TABLE, "services"), services);

        // A chain can be deleted once empty and unreferenced.
        commit(&mut sock, |b| {
            b.flush_chain(IP, TABLE, "service-endpoints-check");
            for base in ["filter-forward", "filter-input", "filter-output"] {
                b.flush_chain(IP, TABLE, base);
            }
            b.del_chain(IP, TABLE, "service-endpoints-check");
        })
        .unwrap();
    });
}

#[test]
fn kernel_destroy_absent_table_succeeds() {
    netns::run("kernel_destroy_absent_table_succeeds", |ns| {
        let mut sock = NftSocket::open().unwrap();
        commit(&mut sock, |b| b.destroy_table(IP, TABLE)).unwrap();

        let err = commit(&mut sock, |b| b.del_table(IP, TABLE)).unwrap_err();
        assert_eq!(err.errno(), Some(2));
        assert!(
            err.to_string().contains("delete table ip splitproxy"),
            "{err}"
        );

        let mut sock = load_fixture();
        // Destroying and re-creating in one transaction is how a full resync can start over.
        commit(&mut sock, |b| {
            b.destroy_table(IP, TABLE);
            b.add_table(IP, TABLE, "fresh");
        })
        .unwrap();
        let rs = ns.ruleset();
        assert_eq!(objects(&rs, "table").len(), 1);
        // nft 1.0.6 prints table comments only as text.
        assert!(
            ns.nft(&["list", "table", "ip", TABLE])
                .contains("comment \"fresh\"")
        );
        assert!(objects(&rs, "chain").is_empty());

        commit(&mut sock, |b| b.destroy_table(IP, TABLE)).unwrap();
        assert!(objects(&ns.ruleset(), "table").is_empty());
    });
}

#[test]
fn kernel_interval_and_timeout_sets() {
    netns::run("kernel_interval_and_timeout_sets", |ns| {
        let mut sock = NftSocket::open().unwrap();
        let cidrs = Set {
            name: "node-cidrs".to_owned(),
            key: vec![DataType::Ipv4Addr as i32],
            interval: true,
            ..Set::default()
        };
        let ports = Set {
            name: "nodeport-ranges".to_owned(),
            key: vec![DataType::Ipv4Addr as i32, DataType::InetService as i32],
            interval: true,
            ..Set::default()
        };
        let seen = Set {
            name: "seen".to_owned(),
            key: vec![DataType::Ipv4Addr as i32],
            timeout: true,
            ..Set::default()
        };
        let range = |a: [u8; 4], b: [u8; 4]| Element {
            key: vec![ip4(a)],
            key_end: vec![ip4(b)],
            ..Element::default()
        };
        commit(&mut sock, |b| {
            b.add_table(IP, TABLE, "");
            for s in [&cidrs, &ports, &seen] {
                b.add_set(IP, TABLE, s).unwrap();
            }
            let single = Element {
                key: vec![ip4([192, 168, 1, 1])],
                ..Element::default()
            };
            let elems = [
                range([10, 0, 0, 0], [10, 255, 255, 255]),
                single,
                range([240, 0, 0, 0], [255, 255, 255, 255]),
            ];
            b.add_elements(IP, TABLE, &cidrs, &elems).unwrap();
            let port_range = Element {
                key: vec![ip4([10, 0, 0, 1]), port(30000)],
                key_end: vec![ip4([10, 0, 0, 1]), port(32767)],
                ..Element::default()
            };
            b.add_elements(IP, TABLE, &ports, &[port_range]).unwrap();
            let timed = Element {
                key: vec![ip4([1, 2, 3, 4])],
                timeout_ms: 60_000,
                ..Element::default()
            };
            b.add_elements(IP, TABLE, &seen, &[timed]).unwrap();
        })
        .unwrap();
        let rs = ns.ruleset();
        let sets = objects(&rs, "set");
        let c = named(&sets, "node-cidrs");
        assert_eq!(c["flags"], serde_json::json!(["interval"]));
        let elems = c["elem"].to_string();
        for want in [
            r#"{"prefix":{"addr":"10.0.0.0","len":8}}"#,
            r#""192.168.1.1""#,
            r#"{"prefix":{"addr":"240.0.0.0","len":4}}"#,
        ] {
            assert!(elems.contains(want), "{want} not in {elems}");
        }
        let p = named(&sets, "nodeport-ranges");
        assert!(
            p["elem"].to_string().contains(r#"{"range":[30000,32767]}"#),
            "{}",
            p["elem"]
        );
        let s = named(&sets, "seen");
        assert!(
            s["elem"].to_string().contains(r#""timeout":60"#),
            "{}",
            s["elem"]
        );

        // Deleting a range deletes both of its kernel entries.
        commit(&mut sock, |b| {
            let r = range([10, 0, 0, 0], [10, 255, 255, 255]);
            b.del_elements(IP, TABLE, &cidrs, &[r]).unwrap();
        })
        .unwrap();
        let rs = ns.ruleset();
        let elems = named(&objects(&rs, "set"), "node-cidrs")["elem"].to_string();
        assert!(
            !elems.contains("10.0.0.0") && elems.contains("192.168.1.1"),
            "{elems}"
        );
    });
}

#[test]
fn kernel_loads_an_ip6_table() {
    netns::run("kernel_loads_an_ip6_table", |ns| {
        use DataType::*;
        let six = |last: u8| {
            let mut a = [0u8; 16];
            a[..4].copy_from_slice(&[0xfd, 0, 0, 0x96]);
            a[15] = last;
            splitproxy_proto::v1::Datum {
                value: Some(splitproxy_proto::v1::datum::Value::Ipv6(a.to_vec())),
            }
        };
        let map = Set {
            name: "service-endpoints".to_owned(),
            key: vec![
                Ipv6Addr as i32,
                InetProto as i32,
                InetService as i32,
                Integer as i32,
            ],
            data: vec![Ipv6Addr as i32, InetService as i32],
            elements: vec![Element {
                key: vec![six(1), proto(TCP), port(443), int(0)],
                data: vec![six(0x55), port(6443)],
                ..Element::default()
            }],
            ..Set::default()
        };
        let e = |kind| Expr { kind: Some(kind) };
        let rule = Rule {
            exprs: vec![
                fixture::payload(PayloadBase::Network, 24, 16, 0),
                fixture::meta(splitproxy_proto::v1::MetaKey::L4proto, 4),
                fixture::th_dport(5),
                e(Kind::Lookup(fixture::lookup("service-ports-1", 0))),
                e(Kind::Numgen(Numgen {
                    r#type: NumgenType::Random as i32,
                    modulus: 1,
                    offset: 0,
                    dreg: 6,
                })),
                e(Kind::Lookup(Lookup {
                    has_dreg: true,
                    dreg: 0,
                    ..fixture::lookup("service-endpoints", 0)
                })),
                e(Kind::Nat(Nat {
                    r#type: NatType::Dnat as i32,
                    family: Family::Ip6 as i32,
                    has_addr: true,
                    reg_addr: 0,
                    has_proto: true,
                    reg_proto: 4,
                    flags: 0,
                })),
            ],
            comment: String::new(),
        };
        let ports = Set {
            name: "service-ports-1".to_owned(),
            key: vec![Ipv6Addr as i32, InetProto as i32, InetService as i32],
            elements: vec![Element {
                key: vec![six(1), proto(TCP), port(443)],
                ..Element::default()
            }],
            ..Set::default()
        };
        let table = Table {
            family: Family::Ip6 as i32,
            name: TABLE.to_owned(),
            comment: String::new(),
            sets: vec![map, ports],
            chains: vec![
                Chain {
                    name: "services".to_owned(),
                    rules: vec![rule.clone()],
                    ..Chain::default()
                },
                Chain {
                    name: "nat-prerouting".to_owned(),
                    base: Some(BaseChain {
                        hook: Hook::Prerouting as i32,
                        r#type: ChainType::Nat as i32,
                        priority: -100,
                        policy_drop: false,
                    }),
                    rules: vec![fixture::jump("services")],
                    ..Chain::default()
                },
            ],
        };
        let mut sock = NftSocket::open().unwrap();
        let mut batch = Batch::new();
        fixture::add_table(&mut batch, &table).unwrap();
        sock.commit(&mut batch).unwrap();
        assert_eq!(dump::rules(NFPROTO_IPV6, TABLE, "services"), vec![rule]);
        let rs = ns.ruleset();
        let m = named(&objects(&rs, "map"), "service-endpoints");
        assert_eq!(m["family"], "ip6");
        assert_eq!(m["map"], "ipv6_addr . inet_service");
        assert!(
            m["elem"].to_string().contains("fd00:96::55"),
            "{}",
            m["elem"]
        );
        let p = named(&objects(&rs, "set"), "service-ports-1");
        assert_eq!(
            p["elem"][0]["concat"],
            serde_json::json!(["fd00:96::1", "tcp", 443])
        );
        let r = rules_of(&rs, "services")[0]["expr"].to_string();
        for word in [
            "\"dnat\"",
            "\"ip6\"",
            "@service-ports-1",
            "@service-endpoints",
            "\"numgen\"",
        ] {
            assert!(r.contains(word), "services rule lacks {word}: {r}");
        }
    });
}

/// Thousands of messages mean thousands of acknowledgements queued at once: with the default
/// receive buffer most would be dropped (ENOBUFS) and the outcome unknown.
#[test]
fn kernel_commits_thousands_of_messages() {
    netns::run("kernel_commits_thousands_of_messages", |_| {
        let mut sock = NftSocket::open().unwrap();
        let mut batch = Batch::new();
        batch.add_table(IP, TABLE, "");
        for i in 0..5_000 {
            let chain = Chain {
                name: format!("chain-{i}"),
                ..Chain::default()
            };
            batch.add_chain(IP, TABLE, &chain);
            batch
                .add_rule(IP, TABLE, &chain.name, &fixture::drop_rule())
                .unwrap();
        }
        let started = Instant::now();
        sock.commit(&mut batch).unwrap();
        println!(
            "{} messages committed in {:?}",
            batch.len(),
            started.elapsed()
        );
        assert_eq!(
            dump::rules(NFPROTO_IPV4, TABLE, "chain-4999"),
            vec![fixture::drop_rule()]
        );
    });
}
