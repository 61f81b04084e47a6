//! The answer against kube-proxy's, the set convention, and real servers on 127.0.0.1 that
//! follow models as the brain changes them.

use std::net::Ipv4Addr;
use std::sync::atomic::Ordering;

use http_body_util::BodyExt;
use splitproxy_proto::v1::{DataType, Datum, Ruleset, Set, Table};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::*;

const TABLE: &str = "splitproxy";

fn element(port: u32, endpoints: u32, comment: &str) -> Element {
    Element {
        key: vec![Datum {
            value: Some(Value::Port(port)),
        }],
        data: vec![Datum {
            value: Some(Value::U32(endpoints)),
        }],
        comment: comment.to_owned(),
        ..Element::default()
    }
}

fn model(elements: Vec<Element>) -> Model {
    Model::from_ruleset(&Ruleset {
        tables: vec![Table {
            family: Family::Ip as i32,
            name: TABLE.to_owned(),
            sets: vec![Set {
                name: SET.to_owned(),
                key: vec![DataType::InetService as i32],
                data: vec![DataType::Integer as i32],
                elements,
                ..Set::default()
            }],
            ..Table::default()
        }],
    })
}

fn svc(namespace: &str, name: &str, local_endpoints: u32) -> Service {
    Service {
        namespace: namespace.into(),
        name: name.into(),
        local_endpoints,
    }
}

#[tokio::test]
async fn answers_like_kube_proxy() {
    let r = response(&svc("default", "web", 3), true);
    assert_eq!(r.status(), 200);
    let h = r.headers();
    assert_eq!(h["content-type"], "application/json");
    assert_eq!(h["x-content-type-options"], "nosniff");
    assert_eq!(h["x-load-balancing-endpoint-weight"], "3");
    let body = r.into_body().collect().await.unwrap().to_bytes();
    // kube-proxy's template, dedented and trimmed: tabs, no trailing newline.
    assert_eq!(
        std::str::from_utf8(&body).unwrap(),
        "{\n\t\"service\": {\n\t\t\"namespace\": \"default\",\n\t\t\"name\": \"web\"\n\t},\n\t\"localEndpoints\": 3,\n\t\"serviceProxyHealthy\": true\n}"
    );
    // No local endpoints, or an unhealthy proxy: 503, with the same body shape.
    for (n, healthy) in [(0, true), (3, false), (0, false)] {
        let r = response(&svc("default", "web", n), healthy);
        assert_eq!(r.status(), 503, "{n} {healthy}");
        assert_eq!(
            r.headers()["x-load-balancing-endpoint-weight"],
            n.to_string().as_str()
        );
        let body = r.into_body().collect().await.unwrap().to_bytes();
        let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(json["localEndpoints"], n);
        assert_eq!(json["serviceProxyHealthy"], healthy);
    }
}

#[test]
fn reads_the_set_convention() {
    let mut wrong_key = element(1, 1, "a/b");
    wrong_key.key[0].value = Some(Value::U32(1));
    let m = model(vec![
        element(30000, 2, "default/web"),
        element(30001, 0, "no-namespace"),
        element(70000, 1, "too/big"),
        wrong_key,
    ]);
    let want: BTreeMap<u16, Service> = [
        (30000, svc("default", "web", 2)),
        (30001, svc("", "no-namespace", 0)),
    ]
    .into_iter()
    .collect();
    assert_eq!(desired(&m, TABLE), want);
    assert!(desired(&m, "other").is_empty());
    assert!(desired(&Model::default(), TABLE).is_empty());
}

/// Two distinct ports nothing listens on now (the kernel picks them, we let them go).
fn free_ports() -> (u16, u16) {
    let a = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let b = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = |l: &std::net::TcpListener| l.local_addr().unwrap().port();
    (port(&a), port(&b))
}

/// `GET path` over a fresh connection: status, headers (lower-case names), body.
async fn get(port: u16, path: &str) -> std::io::Result<(u16, BTreeMap<String, String>, String)> {
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    let req = format!("GET {path} HTTP/1.1\r\nHost: lb\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await?;
    let mut raw = String::new();
    s.read_to_string(&mut raw).await?;
    let (head, body) = raw.split_once("\r\n\r\n").ok_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "no HTTP response")
    })?;
    let mut lines = head.lines();
    let status = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers = lines
        .filter_map(|l| l.split_once(": "))
        .map(|(k, v)| (k.to_ascii_lowercase(), v.to_owned()))
        .collect();
    Ok((status, headers, body.to_owned()))
}

async fn json(port: u16) -> (u16, serde_json::Value) {
    let (status, _, body) = get(port, "/").await.unwrap();
    (status, serde_json::from_str(&body).unwrap())
}

/// Runs in a private network namespace when it can: its loopback has no other users, so a
/// port the test frees stays free (on a shared host another process may take it between the
/// test's close and connect). Elsewhere (not root) on the host's loopback.
#[test]
fn servers_follow_the_model() {
    let run = || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(follow_the_model())
    };
    let isolated = crate::nft::tests::netns::run("servers_follow_the_model", move |ns| {
        ns.run("ip", &["link", "set", "lo", "up"]);
        run()
    });
    if isolated.is_none() {
        run();
    }
}

async fn follow_the_model() {
    let health = Arc::new(Health::default());
    health.ready.store(true, Ordering::Relaxed);
    let mut servers = HealthCheckServers::new(vec![Ipv4Addr::LOCALHOST.into()], health.clone());
    let (web, lb) = free_ports();
    servers
        .reconcile_model(
            &model(vec![
                element(web.into(), 2, "default/web"),
                element(lb.into(), 0, "kube-system/lb"),
            ]),
            TABLE,
        )
        .await;
    let mut both = vec![web, lb];
    both.sort();
    assert_eq!(servers.ports(), both);

    // Any path: `/`, `/healthz`, anything.
    for path in ["/", "/healthz", "/whatever?x=1"] {
        let (status, headers, body) = get(web, path).await.unwrap();
        assert_eq!(status, 200, "{path}");
        assert_eq!(headers["content-type"], "application/json");
        assert_eq!(headers["x-content-type-options"], "nosniff");
        assert_eq!(headers["x-load-balancing-endpoint-weight"], "2");
        let json: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "service": {"namespace": "default", "name": "web"},
                "localEndpoints": 2,
                "serviceProxyHealthy": true,
            })
        );
    }
    let (status, body) = json(lb).await;
    assert_eq!(status, 503);
    assert_eq!(body["service"]["name"], "lb");
    assert_eq!(body["localEndpoints"], 0);

    // The actuator's health shows through.
    health.apply_failing.store(true, Ordering::Relaxed);
    let (status, body) = json(web).await;
    assert_eq!((status, &body["serviceProxyHealthy"]), (503, &false.into()));
    health.apply_failing.store(false, Ordering::Relaxed);

    // An update: web loses its endpoints (in place), lb goes, and a port held by someone else
    // comes (it fails now and is retried at the next reconcile, even with the same model).
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let busy = taken.local_addr().unwrap().port();
    let next = model(vec![
        element(web.into(), 0, "default/web"),
        element(busy.into(), 1, "default/busy"),
    ]);
    servers.reconcile_model(&next, TABLE).await;
    assert_eq!(servers.ports(), vec![web]);
    let (status, body) = json(web).await;
    assert_eq!((status, &body["localEndpoints"]), (503, &0.into()));
    assert_closed(lb).await;
    drop(taken);
    // Retried until it binds: a child process another test forks at this moment holds a copy
    // of `taken` until it execs.
    let mut both = vec![web, busy];
    both.sort();
    for _ in 0..100 {
        servers.reconcile_model(&next, TABLE).await;
        if servers.ports() == both {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(servers.ports(), both);
    assert_eq!(json(busy).await.0, 200);

    // Everything gone.
    servers.reconcile_model(&Model::default(), TABLE).await;
    assert!(servers.ports().is_empty());
    assert_closed(web).await;
    assert_closed(busy).await;
}

/// Nothing answers on `port` any more: connections are refused. A reset also means nothing
/// answered, and happens when a child process another test forks (with a copy of every file
/// descriptor, until it execs) keeps the closed listener alive for a moment: then try again.
async fn assert_closed(port: u16) {
    for _ in 0..100 {
        match get(port, "/").await {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => return,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::UnexpectedEof
                ) =>
            {
                tokio::time::sleep(Duration::from_millis(20)).await
            }
            other => panic!("port {port} still answers: {other:?}"),
        }
    }
    panic!("port {port}: connections reset, never refused");
}

/// The convention's set is an ordinary map the kernel takes (no rule uses it), and `nft`
/// lists it, port by port, with its comment. (nft 1.0.6 has no name for a map whose data is a
/// plain integer: it lists the type as `inet_service : 0`, and refuses `integer` as a data
/// type on input; the elements list right.)
#[test]
fn kernel_takes_the_health_check_set() {
    use crate::nft::tests::{fixture, netns};
    netns::run("kernel_takes_the_health_check_set", |ns| {
        let m = model(vec![
            element(30000, 2, "default/web"),
            element(30001, 0, "kube-system/lb"),
        ]);
        let mut batch = crate::nft::Batch::new();
        for table in m.to_ruleset().tables {
            fixture::add_table(&mut batch, &table).unwrap();
        }
        crate::nft::NftSocket::open()
            .unwrap()
            .commit(&mut batch)
            .unwrap();
        let listed = ns.nft(&["list", "map", "ip", TABLE, SET]);
        for want in [
            "map health-check-nodeports {",
            "30000 comment \"default/web\" : 2",
            "30001 comment \"kube-system/lb\" : 0",
        ] {
            assert!(listed.contains(want), "{want} not in\n{listed}");
        }
        let json: serde_json::Value = serde_json::from_str(&ns.nft(&["-j", "list", "ruleset"]))
            .expect("nft -j lists the set");
        let map = json["nftables"]
            .as_array()
            .unwrap()
            .iter()
            .find_map(|o| o.get("map"))
            .unwrap();
        assert_eq!(map["name"], SET);
        assert_eq!(map["type"], "inet_service");
        assert_eq!(map["elem"].as_array().unwrap().len(), 2, "{map}");
    });
}

/// The count comes from this node's map; a port without an entry there has none.
#[test]
fn local_counts_come_from_the_nodes_map() {
    let mut rs = model(vec![
        element(30000, 0, "default/web"),
        element(30001, 0, "default/api"),
    ])
    .to_ruleset();
    rs.tables[0].sets.push(Set {
        name: LOCAL_SET.to_owned(),
        key: vec![DataType::InetService as i32],
        data: vec![DataType::Integer as i32],
        elements: vec![element(30000, 2, ""), element(30002, 5, "")],
        ..Set::default()
    });
    let want: BTreeMap<u16, Service> = [
        (30000, svc("default", "web", 2)),
        (30001, svc("default", "api", 0)),
    ]
    .into_iter()
    .collect();
    assert_eq!(desired(&Model::from_ruleset(&rs), TABLE), want);
}

#[test]
fn listens_on_the_nodeport_addresses_of_both_families() {
    let ips = |family: Family, ty: DataType, addrs: Vec<Value>| Table {
        family: family as i32,
        name: TABLE.to_owned(),
        sets: vec![Set {
            name: NODEPORT_IPS.to_owned(),
            key: vec![ty as i32],
            elements: addrs
                .into_iter()
                .map(|v| Element {
                    key: vec![Datum { value: Some(v) }],
                    ..Element::default()
                })
                .collect(),
            ..Set::default()
        }],
        ..Table::default()
    };
    let m = Model::from_ruleset(&Ruleset {
        tables: vec![
            ips(
                Family::Ip6,
                DataType::Ipv6Addr,
                vec![Value::Ipv6(
                    "fd00::10"
                        .parse::<std::net::Ipv6Addr>()
                        .unwrap()
                        .octets()
                        .to_vec(),
                )],
            ),
            ips(
                Family::Ip,
                DataType::Ipv4Addr,
                vec![Value::Ipv4(vec![192, 168, 77, 10])],
            ),
        ],
    });
    assert_eq!(
        nodeport_addresses(&m, TABLE),
        vec![
            IpAddr::from([192, 168, 77, 10]),
            "fd00::10".parse::<IpAddr>().unwrap()
        ]
    );
    assert!(nodeport_addresses(&model(vec![]), TABLE).is_empty());
}
