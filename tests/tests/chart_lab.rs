//! The chart installed on the lab's nodes as a cluster runs it (tests/src/install.rs): its
//! rendered objects applied to the real API server (Node authorizer and NodeRestriction on),
//! brains and actuators started with exactly the rendered command lines, environment and
//! mounted files, ServiceAccount tokens from the TokenRequest API bound to Pods on their nodes,
//! the brains' own CA in the Secret and ConfigMap they write, and the brains found through the
//! EndpointSlices of their headless Service. No certificate is made by the test.
//!
//! 1. Every actuator becomes ready and a Service answers from a pod through its ClusterIP, with
//!    the chart's RBAC, identity and discovery only.
//! 2. Refusals on the real path: a node's token claiming another node, another account's token
//!    (with and without the operator ClusterRole), a node's own token expired, a node's token for
//!    another audience, and no credentials at all; each refused with its own message and counted
//!    by reason.
//! 3. `helm test` (the chart's test pod, run the same way) passes.
//! 4. The brain serving the client's node is killed (its Pod deleted, so its endpoint leaves the
//!    EndpointSlice): every node is back in sync through the other brain, found by listing the
//!    EndpointSlices, and a bounded connection loop through the ClusterIP loses nothing.
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use rustls::pki_types::pem::PemObject;
use splitproxy_proto::v1::{Hello, ListNodesRequest, SyncRequest, sync_request};
use splitproxy_tests::deploy::labelled;
use splitproxy_tests::install::{InstallOptions, RbacEdit};
use splitproxy_tests::lab::{Lab, LabOptions};
use splitproxy_tests::traffic::{ConnectionLoop, web_service_with_client};
use tokio_stream::wrappers::ReceiverStream;

const WEB: &str = "10.96.3.10";

/// How a Sync stream on `client` as `node` ends or continues: a status with code `Ok` when an
/// update arrived, the refusal otherwise.
async fn sync_outcome<T>(
    mut client: splitproxy_proto::v1::dataplane_client::DataplaneClient<T>,
    node: &str,
) -> tonic::Status
where
    T: tonic::client::GrpcService<tonic::body::Body>,
    T::Error: Into<tonic::codegen::StdError>,
    T::ResponseBody: tonic::codegen::Body<Data = tonic::codegen::Bytes> + Send + 'static,
    <T::ResponseBody as tonic::codegen::Body>::Error: Into<tonic::codegen::StdError> + Send,
{
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(SyncRequest {
        msg: Some(sync_request::Msg::Hello(Hello {
            node: node.into(),
            version: "chart_lab".into(),
            ..Default::default()
        })),
    })
    .await
    .unwrap();
    let mut updates = match client.sync(ReceiverStream::new(rx)).await {
        Ok(s) => s.into_inner(),
        Err(status) => return status,
    };
    match tokio::time::timeout(Duration::from_secs(10), updates.message()).await {
        Ok(Ok(Some(_))) => tonic::Status::ok("an update"),
        Ok(Ok(None)) => tonic::Status::cancelled("the stream ended without a status"),
        Ok(Err(status)) => status,
        Err(_) => tonic::Status::deadline_exceeded("no update in 10 s"),
    }
}

/// How a Sync stream opened with `token` as `node` ends or continues: `Ok` when an update
/// arrived, the refusal otherwise.
async fn open_sync(lab: &Lab, brain: &str, token: Option<&str>, node: &str) -> tonic::Status {
    let install = lab.install.as_ref().unwrap();
    let client = install.client_with_token(brain, token).await.unwrap();
    sync_outcome(client, node).await
}

/// Which nodes each brain pod serves (connected), by pod.
async fn served(lab: &Lab) -> Vec<(String, Vec<String>)> {
    let install = lab.install.as_ref().unwrap();
    let mut out = Vec::new();
    for (pod, _) in install.pods_of("brain") {
        let nodes = match install.operator_client(&pod).await {
            Ok(mut c) => match c.list_nodes(ListNodesRequest {}).await {
                Ok(r) => r
                    .into_inner()
                    .nodes
                    .into_iter()
                    .filter(|n| n.connected)
                    .map(|n| n.node)
                    .collect(),
                Err(_) => Vec::new(),
            },
            Err(_) => Vec::new(),
        };
        out.push((pod, nodes));
    }
    out
}

#[tokio::test(flavor = "multi_thread")]
async fn the_installed_chart_serves_refuses_and_fails_over() {
    let began = Instant::now();
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_splitproxy-lab"));
    let mut opts = LabOptions::new(exe);
    opts.nodes = 3;
    opts.install = Some(InstallOptions::default());
    let mut lab = Lab::start(opts)
        .await
        .expect("the chart installs and every actuator is ready");
    eprintln!(
        "[chart_lab] installed, every actuator ready: {:.1?}",
        began.elapsed()
    );
    let install = lab.install.as_ref().unwrap();

    // No certificate anywhere in the command lines: tokens and the brains' own CA.
    let brains = install.pods_of("brain");
    let actuators = install.pods_of("actuator");
    assert_eq!(brains.len(), 2, "{brains:?}");
    assert_eq!(actuators.len(), 3, "{actuators:?}");
    assert!(install.brain_arg("--tls-secret").is_some());
    assert!(install.brain_arg("--client-ca").is_none());
    // What the lab's `status` shows of it (`tools/lab.sh up --chart`): the release's pods and
    // the brains' rendered flags.
    let status = lab.status();
    let pods = status["chart"]["pods"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    for (component, n) in [("brain", 2), ("actuator", 3)] {
        let running = pods
            .iter()
            .filter(|p| p["component"] == component && p["running"] == true)
            .count();
        assert_eq!(running, n, "{component}: {status:#}");
    }
    assert!(
        status["brain_flags"].as_array().is_some_and(|a| a
            .iter()
            .any(|f| f.as_str().is_some_and(|f| f.starts_with("--tls-secret=")))),
        "{status:#}"
    );

    // 1. A Service through its ClusterIP.
    let client = web_service_with_client(&lab, "cl", WEB).await;
    lab.wait_synced(Duration::from_secs(30)).await.unwrap();

    // 2. Refusals on the real path.
    let install = lab.install.as_ref().unwrap();
    let brain = &brains[0].0;
    let node1_pod = &actuators.iter().find(|(_, n)| *n == 1).unwrap().0;
    let node1_token = install.token_of(node1_pod, "brain-token").unwrap();
    assert_eq!(
        open_sync(&lab, brain, Some(&node1_token), "node-1")
            .await
            .code(),
        tonic::Code::Ok,
        "node-1's own token opens node-1's stream"
    );
    let other = install.operator_token("lab-somebody", false).await.unwrap();
    let operator = install.operator_token("lab-operator", true).await.unwrap();
    // node-1's own token, expired an hour ago (signed again with the API server's key), and a
    // token of node-1's pod for another audience: each claims node-1, so the expiry or the
    // audience is the only thing wrong with it.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let expired = lab.cp.token_expiring_at(&node1_token, now - 3600).unwrap();
    let audience = install.audience();
    let elsewhere = install.pod_token(node1_pod, "somebody-else").await.unwrap();
    let not_ours = format!(r#"the token is for audience ["somebody-else"], not "{audience}""#);
    type Case<'a> = (
        &'a str,
        Option<&'a str>,
        &'a str,
        tonic::Code,
        &'a str,
        &'a str,
    );
    let cases: [Case; 6] = [
        (
            "node-1's token claiming node-0",
            Some(&node1_token),
            "node-0",
            tonic::Code::PermissionDenied,
            "other_node",
            r#"identifies node(s) ["node-1"] only"#,
        ),
        (
            "another account's token",
            Some(&other),
            "node-0",
            tonic::Code::PermissionDenied,
            "no_role",
            "has no role",
        ),
        (
            "an operator's token",
            Some(&operator),
            "node-0",
            tonic::Code::PermissionDenied,
            "not_a_node",
            "only node identities may open Sync",
        ),
        (
            "node-1's own token, expired",
            Some(&expired),
            "node-1",
            tonic::Code::Unauthenticated,
            "bad_token",
            "the bearer token was not accepted: the token expired ",
        ),
        (
            "a token of node-1's pod for another audience",
            Some(&elsewhere),
            "node-1",
            tonic::Code::Unauthenticated,
            "bad_token",
            &not_ours,
        ),
        (
            "no credentials",
            None,
            "node-0",
            tonic::Code::Unauthenticated,
            "no_identity",
            "no client certificate and no bearer token",
        ),
    ];
    for (what, token, node, code, reason, message) in cases {
        let before = refused(&lab, brain, reason);
        let got = open_sync(&lab, brain, token, node).await;
        assert_eq!(got.code(), code, "{what}: {got:?}");
        assert!(got.message().contains(message), "{what}: {got:?}");
        let after = refused(&lab, brain, reason);
        assert_eq!(
            after,
            before + 1.0,
            "{what}: refused_total{{reason={reason}}} {before} -> {after}"
        );
    }
    eprintln!("[chart_lab] refusals checked: {:.1?}", began.elapsed());

    // The dashboard's and the alerts' metrics are all exposed, under those names.
    let mut exposed = install.brain_http(brain, "/metrics").unwrap().1;
    for i in 0..3 {
        exposed.push_str(&lab.actuator_metrics(i).unwrap());
    }
    let chart = splitproxy_tests::tools::workspace_root().join("charts/splitproxy");
    let mut referenced = std::collections::BTreeSet::new();
    for file in ["dashboards/splitproxy.json", "templates/monitoring.yaml"] {
        let text = std::fs::read_to_string(chart.join(file)).unwrap();
        referenced.extend(metric_names(&text));
    }
    assert!(referenced.len() >= 15, "{referenced:?}");
    let missing: Vec<_> = referenced
        .iter()
        .filter(|name| {
            // A series, or a declared family with no series yet (a counter by label; OpenMetrics
            // declares a counter without its `_total`).
            let family = name.strip_suffix("_bucket").unwrap_or(name);
            let counter = name
                .strip_suffix("_total")
                .map(|f| format!("# TYPE {f} counter"));
            !exposed.lines().any(|l| {
                l.strip_prefix(name.as_str())
                    .is_some_and(|r| r.starts_with(['{', ' ']))
                    || l.starts_with(&format!("# TYPE {family} "))
                    || counter.as_deref() == Some(l)
            })
        })
        .collect();
    assert!(missing.is_empty(), "not exposed: {missing:?}");

    // 3. helm test.
    let (passed, log) = install.helm_test(2).await.unwrap();
    assert!(passed, "helm test failed:\n{log}");
    eprintln!("[chart_lab] helm test passed: {:.1?}", began.elapsed());

    // 4. Kill the brain serving the client's node (node-0), under traffic.
    let serving = served(&lab).await;
    let victim = serving
        .iter()
        .find(|(_, nodes)| nodes.iter().any(|n| n == "node-0"))
        .map(|(pod, _)| pod.clone())
        .unwrap_or_else(|| panic!("no brain serves node-0: {serving:?}"));
    let dst = SocketAddr::new(WEB.parse().unwrap(), 80);
    let traffic = ConnectionLoop::start(
        vec![client.clone()],
        dst,
        400,
        Duration::from_secs(40),
        Duration::from_secs(2),
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    let killed = Instant::now();
    install.kill_pod(&victim).await.unwrap();
    let survivor = brains
        .iter()
        .map(|(p, _)| p.clone())
        .find(|p| *p != victim)
        .unwrap();
    let all = ["node-0", "node-1", "node-2"];
    let moved = loop {
        let serving = served(&lab).await;
        let on_survivor = serving
            .iter()
            .find(|(p, _)| *p == survivor)
            .map(|(_, n)| n.clone())
            .unwrap_or_default();
        if all.iter().all(|n| on_survivor.iter().any(|m| m == n)) {
            break killed.elapsed();
        }
        assert!(
            killed.elapsed() < Duration::from_secs(30),
            "the nodes did not move to {survivor}: {serving:?}\n{}",
            install.log_tail(&actuators[0].0, 30)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    lab.wait_synced(Duration::from_secs(20)).await.unwrap();
    let (failures, made) = traffic.stop().await;
    eprintln!(
        "[chart_lab] brain {victim} killed: every node on {survivor} after {moved:.1?}; \
         {made} connections, {} failed",
        failures.len()
    );
    assert!(made > 10, "the loop made only {made} connections");
    assert!(
        failures.is_empty(),
        "{} of {made} connections failed: {:?}",
        failures.len(),
        failures.iter().map(|f| &f.result).collect::<Vec<_>>()
    );
    lab.install = None;
    eprintln!("[chart_lab] total {:.1?}", began.elapsed());
}

/// `splitproxy_brain_refused_total{reason}` on brain pod `brain`.
fn refused(lab: &Lab, brain: &str, reason: &str) -> f64 {
    let install = lab.install.as_ref().unwrap();
    let (_, text) = install.brain_http(brain, "/metrics").unwrap();
    labelled(&text, "splitproxy_brain_refused_total", "reason", reason)
}

/// `identity.mode=podCertificate`: every actuator's kubelet asks for a certificate with the
/// node's own credentials (a PodCertificateRequest), the brains issue one naming the node with
/// their own CA, and the actuators connect with it (no token, no certificate made by the test).
/// Traffic flows through a ClusterIP; a node's certificate claiming another node is refused.
#[tokio::test(flavor = "multi_thread")]
async fn pod_certificates_from_the_brains_identify_the_nodes() {
    let began = Instant::now();
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_splitproxy-lab"));
    let mut opts = LabOptions::new(exe);
    opts.nodes = 2;
    opts.install = Some(InstallOptions {
        set: vec!["identity.mode=podCertificate".into()],
        brains: 1,
        ..Default::default()
    });
    let mut lab = Lab::start(opts)
        .await
        .expect("the chart installs with pod certificates and every actuator is ready");
    eprintln!(
        "[chart_lab] pod certificates: installed, every actuator ready: {:.1?}",
        began.elapsed()
    );
    let install = lab.install.as_ref().unwrap();
    assert_eq!(
        install.brain_arg("--pod-certificate-signer").as_deref(),
        Some("splitproxy.io/node")
    );
    let brain = install.pods_of("brain")[0].0.clone();
    let actuators = install.pods_of("actuator");
    for (pod, node) in &actuators {
        let cert = install
            .volume_file(pod, "node-certificate", "tls.crt")
            .unwrap();
        let der = rustls::pki_types::CertificateDer::from_pem_slice(cert.as_bytes()).unwrap();
        let identity = splitproxy_brain::tls::identity_of(der.as_ref());
        assert!(
            identity.names.contains(&format!("node-{node}")),
            "{pod}: {identity:?}"
        );
        assert_eq!(identity.groups, vec!["splitproxy:nodes".to_string()]);
    }
    let (_, metrics) = install.brain_http(&brain, "/metrics").unwrap();
    let issued = labelled(
        &metrics,
        "splitproxy_brain_pod_certificates_total",
        "outcome",
        "issued",
    );
    assert!(
        issued >= actuators.len() as f64,
        "issued {issued}:\n{metrics}"
    );

    let _client = web_service_with_client(&lab, "pc", WEB).await;
    lab.wait_synced(Duration::from_secs(30)).await.unwrap();

    // node-1's certificate opens node-1's stream, not node-0's.
    let install = lab.install.as_ref().unwrap();
    let node1 = &actuators.iter().find(|(_, n)| *n == 1).unwrap().0;
    let own = install
        .client_with_certificate_of(&brain, node1, "node-certificate")
        .await
        .unwrap();
    assert_eq!(sync_outcome(own, "node-1").await.code(), tonic::Code::Ok);
    let before = refused(&lab, &brain, "other_node");
    let other = install
        .client_with_certificate_of(&brain, node1, "node-certificate")
        .await
        .unwrap();
    assert_eq!(
        sync_outcome(other, "node-0").await.code(),
        tonic::Code::PermissionDenied
    );
    assert!(refused(&lab, &brain, "other_node") > before);
    lab.install = None;
    eprintln!(
        "[chart_lab] pod certificates: total {:.1?}",
        began.elapsed()
    );
}

/// One install of the chart with `edit` applied to its RBAC: whether it served (every actuator
/// ready, an operator's ListNodes answered), and the first line of the brain's log in which the
/// API server refused it something, if any. It stops as soon as such a line shows.
async fn install_with(
    set: &[&str],
    edit: Option<RbacEdit>,
    existing: Vec<serde_json::Value>,
) -> (bool, Option<String>, PathBuf) {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_splitproxy-lab"));
    let dir = tempfile::tempdir().unwrap();
    let mut opts = LabOptions::new(exe);
    opts.nodes = 1;
    opts.external_clients.clear();
    opts.dir = Some(dir.path().to_path_buf());
    opts.ready_timeout = Duration::from_secs(30);
    opts.install = Some(InstallOptions {
        set: set.iter().map(|s| s.to_string()).collect(),
        brains: 1,
        rbac_edit: edit,
        volume_timeout: Duration::from_secs(30),
        existing,
    });
    let log = dir.path().join("install/splitproxy-brain-0.log");
    let refusal = move || {
        std::fs::read_to_string(&log).ok().and_then(|text| {
            text.lines()
                .find(|l| l.to_ascii_lowercase().contains("forbidden") || l.contains(" 403"))
                .map(|l| l.chars().take(300).collect::<String>())
        })
    };
    let mut run = tokio::spawn(async move {
        let mut lab = match Lab::start(opts).await {
            Ok(lab) => lab,
            Err(e) => {
                eprintln!("[chart_lab] the install did not serve: {e:#}");
                return false;
            }
        };
        let install = lab.install.as_ref().unwrap();
        let brain = install.pods_of("brain")[0].0.clone();
        let answered = match install.operator_client(&brain).await {
            Ok(mut c) => c.list_nodes(ListNodesRequest {}).await.is_ok(),
            Err(_) => false,
        };
        lab.install = None;
        answered
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    let served = loop {
        tokio::select! {
            done = &mut run => break done.unwrap_or(false),
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
        }
        if refusal().is_some() || Instant::now() > deadline {
            run.abort();
            let _ = (&mut run).await;
            break false;
        }
    };
    let refused = refusal();
    // Kept for a look when the variant proves nothing.
    let kept = if refused.is_none() {
        dir.keep()
    } else {
        dir.path().to_path_buf()
    };
    (served, refused, kept)
}

/// What an earlier installation left behind, which the brain must update rather than create:
/// its Lease, held by a brain that stopped renewing it long ago; its CA ConfigMap, with a CA no
/// longer in use; its Secret, with a certificate that expired.
fn leftovers() -> Vec<serde_json::Value> {
    use base64::Engine as _;
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(vec!["splitproxy-brain".to_string()]).unwrap();
    params.not_before = rcgen::date_time_ymd(2020, 1, 1);
    params.not_after = rcgen::date_time_ymd(2021, 1, 1);
    let old = params.self_signed(&key).unwrap().pem();
    vec![
        serde_json::json!({
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": "splitproxy-brain-tls", "namespace": "kube-system"},
            "spec": {"holderIdentity": "a-brain-long-gone", "leaseDurationSeconds": 15,
                     "acquireTime": "2020-01-01T00:00:00.000000Z",
                     "renewTime": "2020-01-01T00:00:00.000000Z"},
        }),
        serde_json::json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "splitproxy-brain-ca", "namespace": "kube-system"},
            "data": {"ca.crt": old},
        }),
        serde_json::json!({
            "apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
            "metadata": {"name": "splitproxy-brain-tls", "namespace": "kube-system"},
            "data": {"tls.crt": b64(&old), "tls.key": b64(&key.serialize_pem())},
        }),
    ]
}

/// Every rule of the chart's identity and TLS RBAC, and every verb of a rule with several, is
/// needed: with the chart's roles the brain serves and the API server refuses it nothing; without
/// any one of them the API server refuses the brain something (its log shows it; most variants
/// also stop serving: without `watch` on PodCertificateRequests the brain still answers them,
/// from its relists). (The watch
/// rules are tests/tests/chart.rs's.) Token identity and the brains' own TLS (the defaults), and
/// pod certificates.
#[tokio::test(flavor = "multi_thread")]
async fn the_charts_identity_rbac_is_all_needed() {
    let began = Instant::now();
    let pcr = "identity.mode=podCertificate";
    let mut failures = Vec::new();
    for set in [&[][..], &[pcr][..]] {
        for existing in [Vec::new(), leftovers()] {
            let upgrade = !existing.is_empty();
            let (served, refused, _) = install_with(set, None, existing).await;
            assert!(
                served && refused.is_none(),
                "{set:?} (over an earlier install: {upgrade}): with the chart's RBAC: served={served}, refused: {refused:?}"
            );
        }
        // The identity rules: the brain's ClusterRole's rules other than the watches, and every
        // rule of its namespaced Role.
        let mut all: Vec<String> = set.iter().map(|s| s.to_string()).collect();
        all.extend([
            "kubeProxy.mode=replace".to_string(),
            "k8sServiceHost=127.0.0.1".to_string(),
        ]);
        let objects = splitproxy_tests::install::render(
            &all,
            &["certificates.k8s.io/v1/PodCertificateRequest".to_string()],
        )
        .unwrap();
        let mut variants = Vec::new();
        for o in &objects {
            let kind = o.types.as_ref().map(|t| t.kind.clone()).unwrap_or_default();
            let name = o.metadata.name.clone().unwrap_or_default();
            if !(kind == "ClusterRole" || kind == "Role") || !name.contains("brain") {
                continue;
            }
            for (i, rule) in o.data["rules"].as_array().unwrap().iter().enumerate() {
                let verbs: Vec<String> = rule["verbs"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_str().unwrap().to_string())
                    .collect();
                if verbs.iter().any(|v| v == "watch") && kind == "ClusterRole" {
                    continue;
                }
                // In pod certificate mode, only the rules that mode adds.
                let resource = rule["resources"][0].as_str().unwrap().to_string();
                let pcr_rule = resource.contains("podcertificaterequests") || resource == "signers";
                if set.is_empty() == pcr_rule {
                    continue;
                }
                let edit = |verb: Option<String>| RbacEdit {
                    kind: kind.clone(),
                    name: name.clone(),
                    rule: i,
                    verb,
                };
                // Updating the named objects matters over an earlier install (a fresh one
                // creates them): those variants run over its leftovers.
                let updates = verbs.iter().any(|v| v == "update");
                variants.push((
                    format!("{kind} {name}: rule {resource}"),
                    edit(None),
                    updates,
                ));
                if verbs.len() > 1 {
                    for v in &verbs {
                        variants.push((
                            format!("{kind} {name}: {v} on {resource}"),
                            edit(Some(v.clone())),
                            v == "update",
                        ));
                    }
                }
            }
        }
        assert!(variants.len() >= 3, "{variants:?}");
        // A few at a time; each ends as soon as the API server's refusal shows.
        for batch in variants.chunks(6) {
            let runs: Vec<_> = batch
                .iter()
                .map(|(what, edit, upgrade)| {
                    let set = set.to_vec();
                    let edit = edit.clone();
                    let existing = if *upgrade { leftovers() } else { Vec::new() };
                    let what = format!(
                        "{what}{}",
                        if *upgrade {
                            " (over an earlier install)"
                        } else {
                            ""
                        }
                    );
                    tokio::spawn(async move {
                        let (served, refused, dir) = install_with(&set, Some(edit), existing).await;
                        (what, served, refused, dir)
                    })
                })
                .collect();
            for run in runs {
                let (what, served, refused, dir) = run.await.unwrap();
                eprintln!(
                    "[chart_lab] without {what}: served={served} refused={}",
                    refused.is_some()
                );
                // The refusal must show: a variant that merely timed out proves nothing.
                if refused.is_none() {
                    failures.push(format!(
                        "{set:?} without {what}: served={served}, and the API server refused nothing (logs: {})",
                        dir.display()
                    ));
                }
            }
        }
    }
    eprintln!("[chart_lab] identity RBAC: {:.1?}", began.elapsed());
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The metric names (`splitproxy_...`, `kubeproxy_...`) a dashboard or alert text refers to.
fn metric_names(text: &str) -> Vec<String> {
    let mut names = Vec::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    // Byte by byte: the texts are UTF-8 (a legend may say "→"), the names ASCII.
    while i < bytes.len() {
        let rest = &bytes[i..];
        let starts = (rest.starts_with(b"splitproxy_") || rest.starts_with(b"kubeproxy_"))
            && (i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_'));
        if starts {
            let len = rest
                .iter()
                .position(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'_'))
                .unwrap_or(rest.len());
            names.push(String::from_utf8_lossy(&rest[..len]).into_owned());
            i += len;
        } else {
            i += 1;
        }
    }
    // Histograms are referred to by their series.
    names
        .into_iter()
        .map(|n| {
            if n.ends_with("_seconds") && text.contains(&format!("{n}_bucket")) {
                format!("{n}_bucket")
            } else {
                n
            }
        })
        .collect()
}
