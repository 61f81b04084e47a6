//! Objects the API server accepts but a dataplane cannot use are logged with their names,
//! counted and skipped, and every other Service keeps forwarding. A ClusterIP outside the
//! brain's service CIDRs is not one of them: kube-proxy serves it, and so does the brain.
use std::time::{Duration, Instant};

use splitproxy_tests::deploy::metric;
use splitproxy_tests::fixtures::{Ep, docs, namespace, service, slice};
use splitproxy_tests::lab::{Lab, LabOptions};
use splitproxy_tests::{ProbeResult, Proto, probe_async};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unusable_objects_are_skipped_and_the_rest_keeps_forwarding() {
    let mut opts = LabOptions::new(env!("CARGO_BIN_EXE_splitproxy-lab"));
    // The API server allocates from a /16; the brain is told the Service range is a /20, so a
    // Service with a ClusterIP in the upper part is outside the configured service CIDR (as a
    // Service of a ServiceCIDR added after the brain started with --service-cidr).
    opts.service_cidrs = vec!["10.96.0.0/16".parse().unwrap()];
    opts.brain.rules.service_cidrs = vec!["10.96.0.0/20".parse().unwrap()];
    let lab = Lab::start(opts).await.expect("lab starts");
    let ns = "bad";
    let good_ep = Ep::new("10.244.1.30", "node-1", "good-a");
    lab.apply_yaml(&docs(&[
        namespace(ns),
        service(ns, "good", "10.96.3.10", &[("http", "TCP", 80, 8080)]),
        slice(
            ns,
            "good-1",
            "good",
            &[("http", "TCP", 8080)],
            std::slice::from_ref(&good_ep),
        ),
    ]))
    .await
    .unwrap();
    let client = lab
        .ensure_pod(
            0,
            "client",
            "10.244.0.100".parse().unwrap(),
            &Default::default(),
            &Default::default(),
        )
        .unwrap();
    let good = "10.96.3.10:80".parse().unwrap();
    let start = Instant::now();
    while !probe_async(
        client.netns(),
        Proto::Tcp,
        good,
        None,
        Duration::from_millis(500),
    )
    .await
    .is_answered()
    {
        assert!(start.elapsed() < Duration::from_secs(10));
    }

    // 1. An endpoint address that is not a unicast address (the API server accepts multicast),
    //    next to a good one in the same slice.
    // 2. A Service port whose slice has no port of that name.
    // 3. A ClusterIP outside the configured service CIDR: served, not skipped.
    lab.apply_yaml(&docs(&[
        service(ns, "mcast", "10.96.3.20", &[("http", "TCP", 80, 8080)]),
        slice(
            ns,
            "mcast-1",
            "mcast",
            &[("http", "TCP", 8080)],
            &[
                Ep::new("239.1.2.3", "node-1", "mcast-x"),
                Ep::new("10.244.1.31", "node-1", "mcast-ok"),
            ],
        ),
        service(ns, "portless", "10.96.3.30", &[("http", "TCP", 80, 8080)]),
        slice(
            ns,
            "portless-1",
            "portless",
            &[("grpc", "TCP", 9000)],
            &[Ep::new("10.244.1.32", "node-1", "portless-a")],
        ),
        service(ns, "outside", "10.96.200.5", &[("http", "TCP", 80, 8080)]),
        slice(
            ns,
            "outside-1",
            "outside",
            &[("http", "TCP", 8080)],
            &[Ep::new("10.244.1.33", "node-1", "outside-a")],
        ),
    ]))
    .await
    .expect("the API server accepts every one of these objects");

    // Counted, by reason.
    let deadline = Instant::now() + Duration::from_secs(10);
    let m = loop {
        let m = lab.brain(0).http_get("/metrics").unwrap().1;
        let counted = |reason: &str| {
            m.lines()
                .any(|l| l.contains(reason) && !l.ends_with(" 0") && !l.starts_with('#'))
        };
        if counted("endpoint_address_unusable") && counted("no_matching_service_port") {
            break m;
        }
        assert!(Instant::now() < deadline, "not all counted:\n{m}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(m.contains("splitproxy_brain_invalid_objects_total{kind=\"EndpointSlice\",reason=\"endpoint_address_unusable\"}"), "{m}");

    // Logged with their names.
    let log = std::fs::read_to_string(lab.brain(0).child.log_path().unwrap()).unwrap();
    for needle in ["bad/mcast-1", "239.1.2.3", "bad/portless"] {
        assert!(
            log.contains(needle),
            "brain log does not name {needle}:\n{log}"
        );
    }

    // Skipped: the good endpoint of the multicast slice still serves; the portless Service
    // port has no usable endpoint and is refused. The outside Service is served.
    let mcast = "10.96.3.20:80".parse().unwrap();
    let start = Instant::now();
    loop {
        let r = probe_async(
            client.netns(),
            Proto::Tcp,
            mcast,
            None,
            Duration::from_millis(500),
        )
        .await;
        if r.pod() == Some("mcast-ok") {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(5), "{r:?}");
    }
    for _ in 0..10 {
        let r = probe_async(
            client.netns(),
            Proto::Tcp,
            mcast,
            None,
            Duration::from_millis(500),
        )
        .await;
        assert_eq!(r.pod(), Some("mcast-ok"));
    }
    let portless = probe_async(
        client.netns(),
        Proto::Tcp,
        "10.96.3.30:80".parse().unwrap(),
        None,
        Duration::from_millis(500),
    )
    .await;
    assert_eq!(portless, ProbeResult::Refused);
    let outside = "10.96.200.5:80".parse().unwrap();
    let start = Instant::now();
    loop {
        let r = probe_async(
            client.netns(),
            Proto::Tcp,
            outside,
            None,
            Duration::from_millis(500),
        )
        .await;
        if r.pod() == Some("outside-a") {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "a Service outside the service CIDR is served: {r:?}"
        );
    }
    assert!(
        !m.contains("cluster_ip_outside_service_cidr"),
        "nothing counts ClusterIPs outside the ranges any more:\n{m}"
    );
    let table = lab
        .cluster
        .node(0)
        .netns()
        .exec_ok(&["nft", "list", "table", "ip", "splitproxy"])
        .unwrap();
    assert!(
        !table.contains("239.1.2.3"),
        "an unusable endpoint got rules:\n{table}"
    );

    // And every other Service kept forwarding throughout, on both nodes.
    for _ in 0..10 {
        let r = probe_async(
            client.netns(),
            Proto::Tcp,
            good,
            None,
            Duration::from_millis(500),
        )
        .await;
        assert_eq!(r.pod(), Some("good-a"), "{r:?}");
    }
    for i in 0..2 {
        assert_eq!(
            metric(
                &lab.actuator_metrics(i).unwrap(),
                "splitproxy_actuator_apply_errors_total"
            ),
            Some(0.0)
        );
    }
}
