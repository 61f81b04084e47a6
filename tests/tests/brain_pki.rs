//! The brain's own CA and serving certificate (`--tls-secret`, brain/src/pki) against a real API
//! server, with exactly the RBAC the brain is documented to need: two brains share one Secret,
//! one of them (the Lease holder) writes it and the CA ConfigMap, a client that knows only the
//! published bundle verifies both for the server name, the certificate and the CA rotate while
//! both keep serving without a restart and a client that rereads the bundle at each connection
//! never fails, and the other brain takes over when the holder is killed.
use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::{
    ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding, RoleRef, Subject,
};
use kube::Api;
use kube::api::{ListParams, ObjectMeta, PostParams};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use splitproxy_brain::pki::inspect::{self, parse_bundle};
use splitproxy_brain::pki::plan::Issuer;
use splitproxy_brain::pki::store::Material;
use splitproxy_tests::certs::{CertPair, Pki};
use splitproxy_tests::controlplane::{ControlPlane, ControlPlaneOptions};
use splitproxy_tests::deploy::{Brain, BrainOptions, ManagedTls, metric};
use splitproxy_tests::process::wait_until_async;

const NS: &str = "splitproxy";
const SECRET: &str = "brain-tls";
const CA_CONFIGMAP: &str = "brain-tls-ca";
const SERVER_NAME: &str = "splitproxy-brain";
const ACCOUNT: &str = "brain";

fn exe() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_splitproxy-lab"))
}

fn rule(group: &str, resource: &str, verbs: &[&str], names: &[&str]) -> PolicyRule {
    PolicyRule {
        api_groups: Some(vec![group.to_string()]),
        resources: Some(vec![resource.to_string()]),
        verbs: verbs.iter().map(|v| v.to_string()).collect(),
        resource_names: (!names.is_empty()).then(|| names.iter().map(|n| n.to_string()).collect()),
        ..Default::default()
    }
}

fn meta(name: &str, ns: Option<&str>) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.into()),
        namespace: ns.map(str::to_string),
        ..Default::default()
    }
}

/// The RBAC a brain with a managed certificate needs in its namespace (reported for the
/// chart): the Secret, the ConfigMap and the Lease by name, and `create` (which cannot be
/// limited to a name) for the first time.
fn pki_rules() -> Vec<PolicyRule> {
    vec![
        rule(
            "",
            "secrets",
            &["get", "list", "watch", "update"],
            &[SECRET],
        ),
        rule("", "secrets", &["create"], &[]),
        rule("", "configmaps", &["get", "update"], &[CA_CONFIGMAP]),
        rule("", "configmaps", &["create"], &[]),
        rule(
            "coordination.k8s.io",
            "leases",
            &["get", "update"],
            &[SECRET],
        ),
        rule("coordination.k8s.io", "leases", &["create"], &[]),
    ]
}

/// A ServiceAccount with what the watches need (as the chart grants, with `--service-cidr`
/// given) and [`pki_rules`] in [`NS`]; returns a kubeconfig with its token.
async fn brain_account(cp: &ControlPlane) -> PathBuf {
    let client = cp.client();
    let pp = PostParams::default();
    Api::<Namespace>::all(client.clone())
        .create(
            &pp,
            &Namespace {
                metadata: meta(NS, None),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), NS);
    sas.create(
        &pp,
        &ServiceAccount {
            metadata: meta(ACCOUNT, Some(NS)),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let subject = Subject {
        kind: "ServiceAccount".into(),
        name: ACCOUNT.into(),
        namespace: Some(NS.into()),
        ..Default::default()
    };
    let watch = ["watch"];
    Api::<ClusterRole>::all(client.clone())
        .create(
            &pp,
            &ClusterRole {
                metadata: meta("brain-pki-test", None),
                rules: Some(vec![
                    rule("", "services", &watch, &[]),
                    rule("discovery.k8s.io", "endpointslices", &watch, &[]),
                    rule("", "nodes", &watch, &[]),
                ]),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    Api::<ClusterRoleBinding>::all(client.clone())
        .create(
            &pp,
            &ClusterRoleBinding {
                metadata: meta("brain-pki-test", None),
                role_ref: RoleRef {
                    api_group: Some("rbac.authorization.k8s.io".into()),
                    kind: "ClusterRole".into(),
                    name: "brain-pki-test".into(),
                },
                subjects: Some(vec![subject.clone()]),
            },
        )
        .await
        .unwrap();
    Api::<Role>::namespaced(client.clone(), NS)
        .create(
            &pp,
            &Role {
                metadata: meta("brain-pki", Some(NS)),
                rules: Some(pki_rules()),
            },
        )
        .await
        .unwrap();
    Api::<RoleBinding>::namespaced(client.clone(), NS)
        .create(
            &pp,
            &RoleBinding {
                metadata: meta("brain-pki", Some(NS)),
                role_ref: RoleRef {
                    api_group: Some("rbac.authorization.k8s.io".into()),
                    kind: "Role".into(),
                    name: "brain-pki".into(),
                },
                subjects: Some(vec![subject]),
            },
        )
        .await
        .unwrap();
    let request = TokenRequest {
        spec: Some(TokenRequestSpec {
            expiration_seconds: Some(3600),
            ..Default::default()
        }),
        ..Default::default()
    };
    let token = sas
        .create_token_request(ACCOUNT, &pp, &request)
        .await
        .unwrap()
        .status
        .unwrap()
        .token
        .unwrap();
    cp.kubeconfig_for_token(&token).unwrap()
}

/// The Secret's entries, if it exists.
async fn material(client: &kube::Client) -> Option<Material> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), NS);
    secrets
        .get_opt(SECRET)
        .await
        .unwrap()
        .map(|s| Material::of(&s))
}

/// The published bundle, if the ConfigMap exists.
async fn published(client: &kube::Client) -> Option<String> {
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), NS);
    let cm = cms.get_opt(CA_CONFIGMAP).await.ok()??;
    cm.data?.get("ca.crt").cloned()
}

async fn lease_holder(client: &kube::Client) -> Option<String> {
    let leases: Api<Lease> = Api::namespaced(client.clone(), NS);
    leases.get_opt(SECRET).await.ok()??.spec?.holder_identity
}

/// The DER of the first certificate of a PEM text.
fn leaf_der(pem: &str) -> Option<Vec<u8>> {
    CertificateDer::pem_slice_iter(pem.as_bytes())
        .next()?
        .ok()
        .map(|c| c.to_vec())
}

/// A TLS handshake with the brain at `addr` that trusts only `bundle` and checks the server
/// name [`SERVER_NAME`], presenting `client` (the brain requires a client certificate). Returns
/// the leaf the brain presented.
async fn handshake(addr: SocketAddr, bundle: &str, client: &CertPair) -> Result<Vec<u8>, String> {
    handshake_for(addr, bundle, client, SERVER_NAME).await
}

/// [`handshake`] for server name `name`.
async fn handshake_for(
    addr: SocketAddr,
    bundle: &str,
    client: &CertPair,
    name: &str,
) -> Result<Vec<u8>, String> {
    let mut roots = rustls::RootCertStore::empty();
    for ca in CertificateDer::pem_slice_iter(bundle.as_bytes()) {
        roots
            .add(ca.map_err(|e| e.to_string())?)
            .map_err(|e| e.to_string())?;
    }
    let chain = vec![CertificateDer::from_pem_slice(client.cert_pem.as_bytes()).unwrap()];
    let key = PrivateKeyDer::from_pem_slice(client.key_pem.as_bytes()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .unwrap();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let work = async {
        let tcp = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| e.to_string())?;
        let tls = connector
            .connect(ServerName::try_from(name.to_string()).unwrap(), tcp)
            .await
            .map_err(|e| e.to_string())?;
        tls.get_ref()
            .1
            .peer_certificates()
            .and_then(|c| c.first())
            .map(|c| c.to_vec())
            .ok_or_else(|| "no certificate presented".to_string())
    };
    tokio::time::timeout(Duration::from_secs(5), work)
        .await
        .map_err(|_| "handshake timed out".to_string())?
}

/// `ListNodes` over gRPC, verifying the brain with `bundle` for [`SERVER_NAME`].
async fn list_nodes(addr: SocketAddr, bundle: &str, operator: &CertPair) -> Result<(), String> {
    use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};
    let cfg = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(bundle))
        .identity(Identity::from_pem(&operator.cert_pem, &operator.key_pem))
        .domain_name(SERVER_NAME);
    let channel = Channel::from_shared(format!("https://{addr}"))
        .unwrap()
        .tls_config(cfg)
        .map_err(|e| e.to_string())?
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .map_err(|e| format!("{e:?}"))?;
    splitproxy_proto::v1::dataplane_client::DataplaneClient::new(channel)
        .list_nodes(splitproxy_proto::v1::ListNodesRequest {})
        .await
        .map_err(|e| e.to_string())?;
    Ok(())
}

/// Both (or all) `brains` present `leaf`, verified with the published bundle.
async fn all_serve(
    client: &kube::Client,
    brains: &[SocketAddr],
    op: &CertPair,
    leaf: &[u8],
) -> bool {
    let Some(bundle) = published(client).await else {
        return false;
    };
    for b in brains {
        match handshake(*b, &bundle, op).await {
            Ok(presented) if presented == leaf => {}
            _ => return false,
        }
    }
    true
}

/// Waits (bounded) for the Secret to hold a serving certificate other than `leaf`; returns it.
async fn next_leaf(client: &kube::Client, leaf: &[u8], timeout: Duration) -> Vec<u8> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(next) = material(client).await.and_then(|m| leaf_der(&m.tls_crt))
            && next != leaf
        {
            return next;
        }
        assert!(
            Instant::now() < deadline,
            "no new certificate within {timeout:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn log_of(brain: &Brain) -> String {
    std::fs::read_to_string(brain.child.log_path().unwrap()).unwrap_or_default()
}

const WRITES: [&str; 3] = [
    "made a new CA",
    "published the CA bundle",
    "issued a serving certificate",
];

/// A client that rereads the published bundle before every connection, as an actuator rereads
/// its CA file, and connects to every brain in `targets` every 200 ms; counts what it saw.
struct RereadingClient {
    targets: Arc<Mutex<Vec<SocketAddr>>>,
    /// Rounds completed: a round that started after `targets` changed knows the new targets.
    rounds: Arc<AtomicU64>,
    ok: Arc<AtomicU64>,
    failures: Arc<Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl RereadingClient {
    fn start(client: kube::Client, targets: Vec<SocketAddr>, op: CertPair) -> RereadingClient {
        let targets = Arc::new(Mutex::new(targets));
        let rounds = Arc::new(AtomicU64::new(0));
        let ok = Arc::new(AtomicU64::new(0));
        let failures = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn({
            let (targets, rounds, ok, failures, stop) = (
                targets.clone(),
                rounds.clone(),
                ok.clone(),
                failures.clone(),
                stop.clone(),
            );
            async move {
                // Bounded: stopped by the test, and at most 10 minutes in any case.
                let deadline = Instant::now() + Duration::from_secs(600);
                while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                    let addrs = targets.lock().unwrap().clone();
                    for addr in addrs {
                        let Some(bundle) = published(&client).await else {
                            failures.lock().unwrap().push("no published bundle".into());
                            continue;
                        };
                        match handshake(addr, &bundle, &op).await {
                            Ok(_) => {
                                ok.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(e) => failures.lock().unwrap().push(format!("{addr}: {e}")),
                        }
                    }
                    rounds.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        });
        RereadingClient {
            targets,
            rounds,
            ok,
            failures,
            stop,
            task,
        }
    }

    /// Stops connecting to `addr`, and returns once no connection to it can be in flight: the
    /// round under way when it was removed may still have held it, so two rounds must end.
    async fn forget(&self, addr: SocketAddr) {
        self.targets.lock().unwrap().retain(|a| *a != addr);
        let start = self.rounds.load(Ordering::Relaxed);
        wait_until_async(
            Duration::from_secs(10),
            Duration::from_millis(20),
            || async { self.rounds.load(Ordering::Relaxed) >= start + 2 },
        )
        .await
        .expect("the rereading client goes on");
    }

    /// Stops it; returns the connections that succeeded and the failures.
    async fn finish(self) -> (u64, Vec<String>) {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.unwrap();
        (
            self.ok.load(Ordering::Relaxed),
            self.failures.lock().unwrap().clone(),
        )
    }
}

fn start_brain(
    cp_kubeconfig: &Path,
    pki: &Pki,
    dir: &Path,
    name: &str,
    opts: &BrainOptions,
) -> Brain {
    Brain::start(
        &exe(),
        cp_kubeconfig,
        pki,
        &dir.join(name),
        name,
        None,
        opts,
    )
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_brains_share_one_managed_certificate_through_rotations_and_a_takeover() {
    let cp = ControlPlane::start(ControlPlaneOptions::default())
        .await
        .unwrap();
    let client = cp.client();
    let kubeconfig = brain_account(&cp).await;
    // A holder that died before these brains started: its Lease is taken over once they have
    // seen it unchanged for its duration, and until then nothing is written.
    Api::<Lease>::namespaced(client.clone(), NS)
        .create(
            &PostParams::default(),
            &Lease {
                metadata: meta(SECRET, Some(NS)),
                spec: Some(LeaseSpec {
                    holder_identity: Some("gone".into()),
                    lease_duration_seconds: Some(6),
                    ..Default::default()
                }),
            },
        )
        .await
        .unwrap();

    let dir = tempfile::tempdir().unwrap();
    let clients = Pki::new("clients").unwrap();
    let op = clients.operator_cert("operator").unwrap();
    let mut opts = BrainOptions::with_service_cidrs(&["10.96.0.0/16".parse().unwrap()]);
    let mut managed = ManagedTls::with_defaults(format!("{NS}/{SECRET}").parse().unwrap());
    // Short lives, so that the test sees renewals: the serving certificate is renewed every
    // ~17 s (two thirds of 24 s and its 1.2 s backdating), the CA after ~42 s, and the new CA
    // signs ~10 s after it is published (a sixth of its life).
    managed.ca_validity = Duration::from_secs(60);
    managed.cert_validity = Duration::from_secs(24);
    assert_eq!(managed.ca_configmap.name, CA_CONFIGMAP);
    assert_eq!(managed.server_names, [SERVER_NAME]);
    opts.managed_tls = Some(managed);
    let mut brains = vec![
        start_brain(&kubeconfig, &clients, dir.path(), "brain-a", &opts),
        start_brain(&kubeconfig, &clients, dir.path(), "brain-b", &opts),
    ];
    let addrs: Vec<SocketAddr> = brains.iter().map(|b| b.grpc).collect();

    // Not ready without a certificate, and nothing written while the Lease is another's.
    for b in &brains {
        let (code, body) = b.http_get("/readyz").unwrap();
        assert_eq!(code, 503, "{body}");
        assert!(body.contains("no serving certificate"), "{body}");
    }
    assert!(
        material(&client).await.is_none(),
        "written before the Lease expired"
    );

    // Both become ready, serving the one certificate the Lease holder wrote.
    wait_until_async(
        Duration::from_secs(40),
        Duration::from_millis(200),
        || async {
            brains
                .iter()
                .all(|b| b.http_get("/readyz").is_ok_and(|(code, _)| code == 200))
        },
    )
    .await
    .unwrap_or_else(|e| {
        panic!(
            "{e:#}\n{}\n{}",
            brains[0].child.log_tail(20),
            brains[1].child.log_tail(20)
        )
    });
    let holder = lease_holder(&client).await.unwrap();
    let holder_i = brains
        .iter()
        .position(|b| b.child.name() == holder)
        .unwrap_or_else(|| panic!("Lease held by {holder}"));
    let other_i = 1 - holder_i;
    // The metrics say who writes and when the served certificate expires.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    for (i, b) in brains.iter().enumerate() {
        let text = b.http_get("/metrics").unwrap().1;
        let holds = metric(&text, "splitproxy_brain_tls_lease_holder");
        assert_eq!(
            holds,
            Some(if i == holder_i { 1.0 } else { 0.0 }),
            "{}",
            b.child.name()
        );
        let expiry = metric(
            &text,
            "splitproxy_brain_tls_certificate_expiry_timestamp_seconds",
        );
        assert!(
            expiry.is_some_and(|e| e > now && e <= now + 25.0),
            "{expiry:?}"
        );
    }
    let secrets: Api<Secret> = Api::namespaced(client.clone(), NS);
    let names = |list: Vec<String>| list.into_iter().collect::<BTreeSet<_>>();
    let secret_names = names(
        secrets
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .filter_map(|s| s.metadata.name)
            .collect(),
    );
    assert_eq!(secret_names, BTreeSet::from([SECRET.to_string()]));
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), NS);
    let cm_names = names(
        cms.list(&ListParams::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .filter_map(|s| s.metadata.name)
            .collect(),
    );
    assert_eq!(cm_names, BTreeSet::from([CA_CONFIGMAP.to_string()]));
    let secret = secrets.get(SECRET).await.unwrap();
    assert_eq!(secret.type_.as_deref(), Some("kubernetes.io/tls"));
    let m = Material::of(&secret);
    let bundle = published(&client).await.unwrap();
    assert_eq!(bundle, m.ca_crt);
    assert_eq!(parse_bundle(&bundle).len(), 1);

    // A client that knows only the published bundle verifies both brains for the server name;
    // gRPC works too.
    let leaf0 = leaf_der(&m.tls_crt).unwrap();
    for addr in &addrs {
        assert_eq!(handshake(*addr, &bundle, &op).await.unwrap(), leaf0);
        list_nodes(*addr, &bundle, &op).await.unwrap();
    }
    // Not with another CA, nor for another name.
    let err = handshake(addrs[0], clients.ca_pem(), &op)
        .await
        .unwrap_err();
    assert!(err.contains("UnknownIssuer"), "{err}");
    let err = handshake_for(addrs[0], &bundle, &op, "other-name")
        .await
        .unwrap_err();
    assert!(err.contains("not valid for name"), "{err}");

    let pids: Vec<_> = brains.iter().map(|b| b.child.id()).collect();
    let watcher = RereadingClient::start(cp.new_client().unwrap(), addrs.clone(), op.clone());

    // The serving certificate is renewed, and both brains serve the new one without restarting.
    let leaf1 = next_leaf(&client, &leaf0, Duration::from_secs(30)).await;
    wait_until_async(Duration::from_secs(10), Duration::from_millis(100), || {
        all_serve(&client, &addrs, &op, &leaf1)
    })
    .await
    .expect("both brains serve the renewed certificate");

    // The CA is rotated: the bundle holds both CAs, and then a certificate from the new CA is
    // served by both; later the old CA, expired, leaves the bundle.
    wait_until_async(
        Duration::from_secs(60),
        Duration::from_millis(250),
        || async {
            material(&client)
                .await
                .is_some_and(|m| parse_bundle(&m.ca_crt).len() == 2)
        },
    )
    .await
    .expect("a second CA");
    wait_until_async(
        Duration::from_secs(40),
        Duration::from_millis(250),
        || async {
            let Some(m) = material(&client).await else {
                return false;
            };
            let facts = inspect::facts(
                &m,
                published(&client).await.as_deref(),
                &[SERVER_NAME.into()],
            );
            let from_new_ca = facts.leaf.is_some_and(|l| l.issuer == Issuer::Current)
                && facts.bundle.len() == 2
                && facts.published;
            from_new_ca && all_serve(&client, &addrs, &op, &leaf_der(&m.tls_crt).unwrap()).await
        },
    )
    .await
    .expect("both brains serve a certificate from the new CA");
    wait_until_async(
        Duration::from_secs(40),
        Duration::from_millis(250),
        || async {
            let Some(m) = material(&client).await else {
                return false;
            };
            parse_bundle(&m.ca_crt).len() == 1 && published(&client).await == Some(m.ca_crt)
        },
    )
    .await
    .expect("the expired CA leaves the bundle");
    for (b, pid) in brains.iter_mut().zip(&pids) {
        assert!(b.child.is_running(), "{} exited", b.child.name());
        assert_eq!(b.child.id(), *pid);
    }
    // One writer: the other brain wrote nothing.
    let other_log = log_of(&brains[other_i]);
    for w in WRITES {
        assert!(!other_log.contains(w), "the brain without the Lease: {w}");
        assert!(log_of(&brains[holder_i]).contains(w), "the holder: {w}");
    }
    assert!(
        !log_of(&brains[0]).contains("PRIVATE KEY") && !log_of(&brains[1]).contains("PRIVATE KEY"),
        "key material in a log"
    );

    // Killing the holder right after a renewal: the other takes the Lease over (after 15 s
    // without renewals) and renews the certificate, which it serves, before it runs out.
    let before = material(&client)
        .await
        .and_then(|m| leaf_der(&m.tls_crt))
        .unwrap();
    wait_until_async(
        Duration::from_secs(30),
        Duration::from_millis(100),
        || async {
            material(&client)
                .await
                .and_then(|m| leaf_der(&m.tls_crt))
                .is_some_and(|l| l != before)
        },
    )
    .await
    .expect("a renewal");
    watcher.forget(addrs[holder_i]).await;
    brains[holder_i]
        .child
        .signal(nix::sys::signal::Signal::SIGKILL)
        .unwrap();
    let killed_at = Instant::now();
    let survivor = brains[other_i].child.name().to_string();
    wait_until_async(
        Duration::from_secs(30),
        Duration::from_millis(250),
        || async { lease_holder(&client).await.as_deref() == Some(survivor.as_str()) },
    )
    .await
    .expect("the survivor takes the Lease over");
    let took_over = killed_at.elapsed();
    eprintln!("the survivor took the Lease over {took_over:?} after the kill");
    assert!(
        took_over >= Duration::from_secs(14),
        "taken over after {took_over:?}"
    );
    let at_takeover = material(&client)
        .await
        .and_then(|m| leaf_der(&m.tls_crt))
        .unwrap();
    let survivor_addr = [addrs[other_i]];
    wait_until_async(
        Duration::from_secs(30),
        Duration::from_millis(200),
        || async {
            let Some(leaf) = material(&client).await.and_then(|m| leaf_der(&m.tls_crt)) else {
                return false;
            };
            leaf != at_takeover && all_serve(&client, &survivor_addr, &op, &leaf).await
        },
    )
    .await
    .expect("the survivor renews the certificate and serves it");
    assert!(log_of(&brains[other_i]).contains("issued a serving certificate"));

    // Across all of it, a client rereading the published bundle never failed to verify.
    let (ok, failures) = watcher.finish().await;
    eprintln!("{ok} connections verified with the bundle read just before");
    assert!(
        failures.is_empty(),
        "{} failures: {failures:?}",
        failures.len()
    );
    assert!(ok > 100, "only {ok} connections");

    // A brain stopped with SIGTERM gives the Lease up, so that a successor need not wait.
    brains[other_i].child.stop().unwrap();
    assert_eq!(lease_holder(&client).await, None);
}
