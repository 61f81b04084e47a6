//! The cleanup against the kernel, in a private network namespace: a table with a dynamic map
//! and its guard set applied by the [`Applier`], entries added by a real packet through a
//! dynset rule and by userspace, then a delta that removes guard elements, then the cleanup;
//! `nft -j list map` (run inside the namespace) and our own dump say what is left.
//!
//! Addresses, all on the namespace's loopback: the client 10.0.0.1 and the destination
//! 10.96.0.10, so the packet stays in the namespace.

use splitproxy_proto::family::IpFamily;
use std::net::UdpSocket;

use serde_json::Value as Json;
use splitproxy_proto::model::Model;
use splitproxy_proto::v1::{
    BaseChain, Chain, ChainType, CmpOp, Dynset, DynsetOp, Expr, Family, Hook, Immediate, MetaKey,
    PayloadBase, Rule, RulesetDelta, SetElements, TableRemoval, Update, expr::Kind, update::Body,
};

use super::tests::{AFFINITY, MEMBERS, TABLE, TCP, UDP, affinity_map, entry, member, ruleset};
use super::*;
use crate::apply::Applier;
use crate::nft::tests::fixture::{cmp, ip_daddr, meta, payload, th_dport};
use crate::nft::tests::netns::{self, Netns};

fn e(kind: Kind) -> Expr {
    Expr { kind: Some(kind) }
}

/// `meta l4proto udp update @affinity { ip saddr . ip daddr . meta l4proto . th dport :
/// 10.0.0.2 . 5353 }`: what a real affinity rule records, with a fixed endpoint.
fn record_rule() -> Rule {
    Rule {
        exprs: vec![
            meta(MetaKey::L4proto, 2),
            cmp(CmpOp::Eq, 2, &[UDP as u8]),
            payload(PayloadBase::Network, 12, 4, 0),
            ip_daddr(1),
            th_dport(3),
            e(Kind::Immediate(Immediate {
                dreg: 4,
                data: vec![10, 0, 0, 2],
            })),
            e(Kind::Immediate(Immediate {
                dreg: 5,
                data: [5353u16.to_be_bytes(), [0, 0]].concat(),
            })),
            e(Kind::Dynset(Dynset {
                set: AFFINITY.to_owned(),
                op: DynsetOp::Update as i32,
                sreg_key: 0,
                has_data: true,
                sreg_data: 4,
                timeout_ms: 3_600_000,
            })),
        ],
        comment: "remember the client's endpoint".to_owned(),
    }
}

/// Map elements as `nft -j` lists them: `client . dst . proto . port -> ep . port`.
fn listed(ns: &Netns) -> Vec<String> {
    let out = ns.nft(&["-j", "list", "map", "ip", TABLE, AFFINITY]);
    let json: Json = serde_json::from_str(&out).expect("nft JSON");
    let map = json["nftables"]
        .as_array()
        .expect("nftables array")
        .iter()
        .find_map(|o| o.get("map"))
        .expect("the map is listed");
    let text = |v: &Json| match v {
        Json::String(s) => s.clone(),
        other => other.to_string(),
    };
    let concat = |v: &Json| {
        v["concat"]
            .as_array()
            .unwrap_or_else(|| panic!("not a concatenation: {v}"))
            .iter()
            .map(text)
            .collect::<Vec<_>>()
            .join(" . ")
    };
    let mut all: Vec<String> = map["elem"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .map(|pair| {
            // [key, data]; a key with a timeout is wrapped in {"elem": {"val": key, ...}}.
            let key = &pair[0];
            let key = key.get("elem").map(|e| &e["val"]).unwrap_or(key);
            format!("{} -> {}", concat(key), concat(&pair[1]))
        })
        .collect();
    all.sort();
    all
}

fn sorted(v: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = v.iter().map(|s| s.to_string()).collect();
    v.sort();
    v
}

#[test]
fn kernel_cleanup_deletes_exactly_the_guarded_entries() {
    netns::run("kernel_cleanup_deletes_exactly_the_guarded_entries", |ns| {
        if !netns::tool_works("ip", "-V") {
            eprintln!("SKIP: `ip` is not installed");
            return;
        }
        for cmd in [
            "link set lo up",
            "addr add 10.0.0.1/32 dev lo",
            "addr add 10.96.0.10/32 dev lo",
        ] {
            ns.run("ip", &cmd.split(' ').collect::<Vec<_>>());
        }
        let members = vec![
            member("10.96.0.10", UDP, 53, "10.0.0.2", 5353),
            member("10.96.0.10", UDP, 53, "10.0.0.3", 5353),
            member("10.96.0.11", TCP, 80, "10.0.0.2", 8080),
            member("10.96.0.12", TCP, 80, "10.0.0.2", 8080),
        ];
        let mut rs = ruleset(members.clone());
        rs.tables[0].chains.push(Chain {
            name: "filter-output".to_owned(),
            base: Some(BaseChain {
                hook: Hook::Output as i32,
                r#type: ChainType::Filter as i32,
                priority: 0,
                policy_drop: false,
            }),
            comment: String::new(),
            rules: vec![record_rule()],
        });
        let mut applier = Applier::new(NftSocket::open().unwrap(), TABLE.to_owned());
        let first = applier
            .apply_snapshot(
                &Update {
                    brain_epoch: 1,
                    generation: 1,
                    ..Update::default()
                },
                Model::from_ruleset(&rs),
            )
            .unwrap();
        assert!(first.guards.is_empty(), "first commit");

        // One entry from the packet path...
        let udp = UdpSocket::bind("10.0.0.1:0").unwrap();
        udp.send_to(b"query", "10.96.0.10:53").unwrap();
        // ...and more from userspace (a dynamic map with timeouts takes them too).
        let added = vec![
            entry("10.0.0.5", "10.96.0.10", UDP, 53, "10.0.0.2", 5353),
            entry("10.0.0.6", "10.96.0.10", UDP, 53, "10.0.0.3", 5353),
            entry("10.0.0.7", "10.96.0.10", TCP, 53, "10.0.0.2", 5353),
            entry("10.0.0.9", "10.96.0.10", UDP, 54, "10.0.0.2", 5353),
            entry("10.0.0.5", "10.96.0.11", TCP, 80, "10.0.0.2", 8080),
            entry("10.0.0.8", "10.96.0.12", TCP, 80, "10.0.0.2", 8080),
        ]
        .into_iter()
        .map(|e| Element {
            timeout_ms: 3_600_000,
            ..e
        })
        .collect::<Vec<_>>();
        let mut sock = NftSocket::open().unwrap();
        let mut batch = Batch::new();
        batch
            .add_elements(Family::Ip, TABLE, &affinity_map(IpFamily::V4), &added)
            .unwrap();
        sock.commit(&mut batch).unwrap();
        let stays = [
            "10.0.0.6 . 10.96.0.10 . udp . 53 -> 10.0.0.3 . 5353",
            "10.0.0.7 . 10.96.0.10 . tcp . 53 -> 10.0.0.2 . 5353",
            "10.0.0.9 . 10.96.0.10 . udp . 54 -> 10.0.0.2 . 5353",
            "10.0.0.5 . 10.96.0.11 . tcp . 80 -> 10.0.0.2 . 8080",
        ];
        let goes = [
            "10.0.0.1 . 10.96.0.10 . udp . 53 -> 10.0.0.2 . 5353",
            "10.0.0.5 . 10.96.0.10 . udp . 53 -> 10.0.0.2 . 5353",
            "10.0.0.8 . 10.96.0.12 . tcp . 80 -> 10.0.0.2 . 8080",
        ];
        let everything = sorted(&[&stays[..], &goes[..]].concat());
        assert_eq!(listed(ns), everything, "the packet and userspace entries");
        let tkey = (Family::Ip, TABLE.to_owned());
        assert_eq!(
            sock.dump_elements(Family::Ip, TABLE, AFFINITY)
                .unwrap()
                .len(),
            7
        );

        // Two endpoints leave their Service ports.
        let delta = Update {
            brain_epoch: 1,
            generation: 2,
            base_generation: 1,
            body: Some(Body::Delta(RulesetDelta {
                upsert: vec![],
                remove: vec![TableRemoval {
                    family: Family::Ip as i32,
                    name: TABLE.to_owned(),
                    elements: vec![SetElements {
                        set: MEMBERS.to_owned(),
                        elements: vec![members[0].clone(), members[3].clone()],
                    }],
                    ..TableRemoval::default()
                }],
            })),
            ..Update::default()
        };
        let plan = applier.apply(&delta).unwrap().guards;
        assert_eq!(listed(ns), everything, "the commit leaves the map alone");
        assert_eq!(plan.len(), 2);
        let dumped = sock.dump_elements(Family::Ip, TABLE, AFFINITY).unwrap();
        assert_eq!(plan.select(&tkey, AFFINITY, &dumped).len(), 3);

        let metrics = crate::metrics::Metrics::default();
        let mut cleaner = Cleaner::new();
        assert_eq!(cleaner.clean(&plan, &metrics), 3);
        assert_eq!(listed(ns), sorted(&stays));
        assert_eq!(
            sock.dump_elements(Family::Ip, TABLE, AFFINITY)
                .unwrap()
                .len(),
            4
        );
        let text = metrics.render();
        assert!(
            text.contains("splitproxy_actuator_affinity_entries_deleted_total 3\n"),
            "{text}"
        );
        assert!(text.contains("splitproxy_actuator_affinity_cleanup_errors_total 0\n"));

        // Again: nothing matches any more, and nothing is sent.
        assert_eq!(cleaner.clean(&plan, &metrics), 0);
        assert_eq!(listed(ns), sorted(&stays));

        // Destroying an entry that is gone already (expired between dump and delete) is
        // not an error: the rest of the transaction stands.
        let gone = plan.select(&tkey, AFFINITY, &dumped);
        let mut batch = Batch::new();
        batch
            .destroy_element_keys(Family::Ip, TABLE, AFFINITY, gone.iter().map(|e| &e.key[..]))
            .unwrap();
        sock.commit(&mut batch).unwrap();
        assert_eq!(listed(ns), sorted(&stays));

        // A map the kernel no longer has: logged and counted, not returned.
        ns.nft(&["delete", "table", "ip", TABLE]);
        assert_eq!(cleaner.clean(&plan, &metrics), 0);
        let text = metrics.render();
        assert!(
            text.contains("splitproxy_actuator_affinity_cleanup_errors_total 1\n"),
            "{text}"
        );
        let err = sock.dump_elements(Family::Ip, TABLE, AFFINITY).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(2), "{err}");
    });
}
