//! The Helm chart (`charts/splitproxy`) and the images (`tools/image.sh`) against real tools:
//! `helm lint`; `helm template` output applied server-side to the real kube-apiserver v1.37.2,
//! with the default values and with a values file that sets every option
//! (`charts/splitproxy/ci/everything-values.yaml`); the values schema refusing unknown and
//! unsupported values; the brain running with exactly the chart's RBAC and failing to sync
//! without any one of its rules or verbs; and the images built twice with the same digests.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use k8s_openapi::api::core::v1::ServiceAccount;
use kube::api::{Api, PostParams};
use serde_json::{Value, json};
use splitproxy_tests::certs::Pki;
use splitproxy_tests::controlplane::{ControlPlane, ControlPlaneOptions};
use splitproxy_tests::deploy::{Brain, BrainOptions};
use splitproxy_tests::tools;
use splitproxy_tests::{images, manifests};

/// The Kubernetes version the chart is rendered for: the API server the tests run.
const KUBE_VERSION: &str = "1.37.2";
/// The kinds the "everything" values need besides the built-in ones.
const EXTRA_APIS: &[&str] = &[
    "monitoring.coreos.com/v1/ServiceMonitor",
    "monitoring.coreos.com/v1/PrometheusRule",
    "cert-manager.io/v1/Certificate",
];

fn chart() -> PathBuf {
    tools::workspace_root().join("charts/splitproxy")
}

fn everything_values() -> PathBuf {
    chart().join("ci/everything-values.yaml")
}

/// Runs helm; returns whether it succeeded, and its stdout and stderr.
fn helm(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(tools::binary("helm").unwrap())
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `helm template splitproxy CHART -n NAMESPACE --kube-version 1.37.2 EXTRA...`: the manifests,
/// or helm's error.
fn template(namespace: &str, extra: &[&str]) -> Result<String, String> {
    let chart = chart();
    let mut args = vec![
        "template",
        "splitproxy",
        chart.to_str().unwrap(),
        "--namespace",
        namespace,
        "--kube-version",
        KUBE_VERSION,
    ];
    args.extend_from_slice(extra);
    match helm(&args) {
        (true, out, _) => Ok(out),
        (false, out, err) => Err(format!("{err}{out}")),
    }
}

fn everything_args(values: &Path) -> Vec<String> {
    let mut args = vec!["-f".to_string(), values.to_str().unwrap().to_string()];
    for api in EXTRA_APIS {
        args.push("--api-versions".into());
        args.push((*api).into());
    }
    args
}

fn timed<T>(what: &str, f: impl FnOnce() -> T) -> T {
    let start = Instant::now();
    let v = f();
    eprintln!("[chart] {what}: {:.1?}", start.elapsed());
    v
}

#[test]
fn helm_lint_is_clean() {
    let chart = chart();
    let values = everything_values();
    let chart = chart.to_str().unwrap();
    let values = values.to_str().unwrap();
    // The everything values without the kinds that need CRDs (helm lint knows no cluster).
    let cases: Vec<Vec<&str>> = vec![
        vec!["lint", "--strict", chart, "--kube-version", KUBE_VERSION],
        vec![
            "lint",
            "--strict",
            chart,
            "--kube-version",
            KUBE_VERSION,
            "-f",
            values,
            "--set",
            "monitoring.serviceMonitor.enabled=false",
            "--set",
            "monitoring.prometheusRule.enabled=false",
            "--set",
            "tls.source=existingSecret",
        ],
    ];
    for args in cases {
        let (ok, out, err) = timed("helm lint", || helm(&args));
        assert!(ok, "helm {args:?} failed:\n{out}{err}");
        assert!(out.contains("0 chart(s) failed"), "{out}");
        assert!(
            !out.contains("[WARNING]") && !out.contains("[ERROR]"),
            "helm lint is not clean:\n{out}"
        );
    }
}

#[test]
fn the_schema_and_the_checks_refuse_what_cannot_work() {
    let values = everything_values();
    let everything = everything_args(&values);
    let everything: Vec<&str> = everything.iter().map(String::as_str).collect();
    let cases: &[(&str, Vec<&str>, &str)] = &[
        (
            "an unknown value",
            vec!["--set", "brain.replicass=3"],
            "replicass",
        ),
        (
            "an unknown top-level value",
            vec!["--set", "kubeProxyReplacement=true"],
            "kubeProxyReplacement",
        ),
        (
            "an identity mode that does not exist",
            vec!["--set", "identity.mode=spiffe"],
            "/identity/mode",
        ),
        (
            "pod certificates where the API does not serve them",
            vec!["--set", "identity.mode=podCertificate"],
            "PodCertificateRequest",
        ),
        (
            "pod certificates signed by a CA the brains do not hold",
            vec![
                "--set",
                "identity.mode=podCertificate",
                "--set",
                "tls.source=existingSecret",
                "--api-versions",
                "certificates.k8s.io/v1/PodCertificateRequest",
            ],
            "needs tls.source=brain",
        ),
        (
            "a signer name of Kubernetes' own",
            vec![
                "--set",
                "identity.podCertificate.signerName=kubernetes.io/x",
            ],
            "signerName",
        ),
        (
            "client certificates with the brains' own CA",
            vec!["--set", "identity.mode=files"],
            "identity.mode=files needs tls.source",
        ),
        (
            "tokens with a user's certificate but no CA ConfigMap",
            vec!["--set", "tls.source=existingSecret"],
            "caConfigMapName",
        ),
        (
            "a token lifetime the kubelet refuses",
            vec!["--set", "identity.serviceAccountToken.expirationSeconds=60"],
            "expirationSeconds",
        ),
        (
            "a wrong type",
            vec!["--set", "brain.grpcPort=http"],
            "grpcPort",
        ),
        (
            "a share of the nodes above one",
            vec!["--set", "brain.publishWhenUnsettled=1.5"],
            "publishWhenUnsettled",
        ),
        (
            "an unknown mode",
            vec!["--set", "kubeProxy.mode=instead"],
            "/kubeProxy/mode",
        ),
        (
            "beside kube-proxy without a proxy name",
            vec!["--set", "kubeProxy.serviceProxyName="],
            "serviceProxyName",
        ),
        (
            "replacing kube-proxy without an API server address",
            vec!["--set", "kubeProxy.mode=replace"],
            "k8sServiceHost",
        ),
        (
            "one port for health and metrics",
            vec![
                "--set",
                "actuator.healthzPort=10266",
                "--set",
                "actuator.metricsPort=10266",
            ],
            "must differ",
        ),
        (
            "a ServiceMonitor without its CRD",
            vec!["--set", "monitoring.serviceMonitor.enabled=true"],
            "ServiceMonitor",
        ),
        (
            "cert-manager without its CRD",
            vec![
                "--set",
                "tls.source=certManager",
                "--set",
                "tls.caConfigMapName=brain-ca",
            ],
            "cert-manager",
        ),
    ];
    for (what, args, mention) in cases {
        let err = template("kube-system", args).expect_err(what);
        assert!(err.contains(mention), "{what}: {err}");
        let reason = err
            .lines()
            .find(|l| l.contains(" at '") || l.contains("execution error"))
            .unwrap_or("");
        eprintln!("[chart] refused {what}: {reason}");
    }
    // A Kubernetes version older than the chart supports: Chart.yaml's kubeVersion.
    let chart = chart();
    let (ok, out, err) = helm(&[
        "template",
        "splitproxy",
        chart.to_str().unwrap(),
        "--kube-version",
        "1.32.0",
    ]);
    assert!(
        !ok && format!("{out}{err}").contains("kubeVersion"),
        "{out}{err}"
    );
    // The everything values render (they are applied to the API server below).
    template("kube-system", &everything).unwrap();
}

/// The container args of the first `kind` object in `yaml`.
fn container_args(yaml: &str, kind: &str) -> Vec<String> {
    let obj = manifests::documents(yaml)
        .unwrap()
        .into_iter()
        .find(|o| o.types.as_ref().is_some_and(|t| t.kind == kind))
        .unwrap();
    obj.data["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().replace("$(NODE_NAME)", "node-0"))
        .collect()
}

/// The environment of the first container of the first `kind` object in `yaml`, by name
/// (plain values only).
fn container_env(yaml: &str, kind: &str) -> BTreeMap<String, String> {
    let obj = manifests::documents(yaml)
        .unwrap()
        .into_iter()
        .find(|o| o.types.as_ref().is_some_and(|t| t.kind == kind))
        .unwrap();
    obj.data["spec"]["template"]["spec"]["containers"][0]["env"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| Some((e["name"].as_str()?.into(), e["value"].as_str()?.into())))
        .collect()
}

/// `tracing.endpoint` turns OpenTelemetry on in both programs through the standard variables
/// (docs/observability.md); without it neither gets any OTEL_* variable, so both stay off.
#[test]
fn tracing_values_set_the_standard_otel_variables_on_both() {
    let off = template("kube-system", &[]).unwrap();
    for kind in ["Deployment", "DaemonSet"] {
        let env = container_env(&off, kind);
        assert!(
            !env.keys().any(|k| k.starts_with("OTEL_")),
            "{kind}: {env:?}"
        );
    }
    let on = template(
        "kube-system",
        &[
            "--set",
            "tracing.endpoint=http://$(HOST_IP):4317",
            "--set",
            "tracing.sampleRatio=0.25",
        ],
    )
    .unwrap();
    for (kind, resource) in [
        ("Deployment", "k8s.pod.name=$(POD_NAME)"),
        ("DaemonSet", "k8s.node.name=$(NODE_NAME)"),
    ] {
        let env = container_env(&on, kind);
        let get = |k: &str| env.get(k).map(String::as_str);
        assert_eq!(
            get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
            Some("http://$(HOST_IP):4317"),
            "{kind}"
        );
        assert_eq!(get("OTEL_TRACES_SAMPLER"), Some("parentbased_traceidratio"));
        assert_eq!(get("OTEL_TRACES_SAMPLER_ARG"), Some("0.25"));
        assert_eq!(get("OTEL_RESOURCE_ATTRIBUTES"), Some(resource));
    }
    // `--set` makes 0.25 a string; a number works as well.
    template("kube-system", &["--set-json", "tracing.sampleRatio=0.5"]).unwrap();
    let refused = template("kube-system", &["--set", "tracing.sampleRatio=2"]);
    assert!(refused.is_err(), "a ratio above 1 is refused");
    let refused = template("kube-system", &["--set", "tracing.endpoint=collector:4317"]);
    assert!(
        refused.is_err(),
        "an endpoint without its scheme is refused"
    );
}

#[test]
fn rendered_command_lines_are_the_binaries_flags() {
    use clap::Parser;
    let values = everything_values();
    let everything = everything_args(&values);
    let everything: Vec<&str> = everything.iter().map(String::as_str).collect();
    let pod_certificates = template(
        "kube-system",
        &[
            "--set",
            "identity.mode=podCertificate",
            "--api-versions",
            "certificates.k8s.io/v1/PodCertificateRequest",
        ],
    )
    .unwrap();
    for (what, yaml) in [
        ("default", template("kube-system", &[]).unwrap()),
        ("everything", template("kube-system", &everything).unwrap()),
        ("podCertificate", pod_certificates),
    ] {
        let brain = std::iter::once("splitproxy-brain".to_string())
            .chain(container_args(&yaml, "Deployment"));
        let args = splitproxy_brain::config::Args::try_parse_from(brain)
            .unwrap_or_else(|e| panic!("{what}: the brain refuses the chart's flags: {e}"));
        let brain = splitproxy_brain::config::BrainConfig::try_from(args).unwrap();
        let actuator = std::iter::once("splitproxy-actuator".to_string())
            .chain(container_args(&yaml, "DaemonSet"));
        let args = splitproxy_actuator::config::Args::try_parse_from(actuator)
            .unwrap_or_else(|e| panic!("{what}: the actuator refuses the chart's flags: {e}"));
        let actuator = splitproxy_actuator::config::Config::try_from(args).unwrap();
        if what == "podCertificate" {
            assert_eq!(
                brain.tls.pod_certificate_signer.as_deref(),
                Some("splitproxy.io/node")
            );
            assert!(brain.tls.client_ca.is_none());
            continue;
        }
        if what == "default" {
            // Beside kube-proxy: only the labelled Services, off kube-proxy's ports.
            assert_eq!(brain.rules.service_proxy_name, "splitproxy");
            assert_eq!(actuator.healthz_bind_address.port(), 10266);
            assert_eq!(actuator.metrics_bind_address.port(), 10267);
            assert!(brain.rules.service_cidrs.is_empty());
        } else {
            assert_eq!(brain.listen.to_string(), "[::]:19443");
            assert_eq!(brain.rules.service_cidrs.len(), 2);
            assert!(brain.rules.masquerade_all);
            assert!(!brain.tuning.streaming_lists);
            assert_eq!(actuator.brains.len(), 2);
            assert_eq!(actuator.node, "node-0");
            assert_eq!(actuator.table, "splitproxy_test");
        }
    }
}

/// Minimal CRDs for the kinds the chart creates optionally, so the API server accepts them
/// (their own schemas are the Prometheus Operator's and cert-manager's business).
fn crds() -> String {
    let crd = |group: &str, kind: &str, plural: &str| {
        format!(
            "apiVersion: apiextensions.k8s.io/v1\nkind: CustomResourceDefinition\nmetadata:\n  \
             name: {plural}.{group}\nspec:\n  group: {group}\n  scope: Namespaced\n  names:\n    \
             kind: {kind}\n    plural: {plural}\n    singular: {}\n    listKind: {kind}List\n  \
             versions:\n  - name: v1\n    served: true\n    storage: true\n    schema:\n      \
             openAPIV3Schema:\n        type: object\n        x-kubernetes-preserve-unknown-fields: \
             true\n",
            kind.to_lowercase()
        )
    };
    [
        crd("monitoring.coreos.com", "ServiceMonitor", "servicemonitors"),
        crd("monitoring.coreos.com", "PrometheusRule", "prometheusrules"),
        crd("cert-manager.io", "Certificate", "certificates"),
    ]
    .join("---\n")
}

fn kinds(applied: &[manifests::Applied]) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for a in applied {
        *m.entry(a.kind.clone()).or_insert(0) += 1;
    }
    m
}

#[tokio::test(flavor = "multi_thread")]
async fn rendered_chart_applies_to_the_api_server() {
    let start = Instant::now();
    let cp = ControlPlane::start(ControlPlaneOptions::default())
        .await
        .unwrap();
    eprintln!("[chart] control plane: {:.1?}", start.elapsed());
    let client = cp.client();

    // Default values, into kube-system (where a Service proxy lives).
    let default = template("kube-system", &[]).unwrap();
    let applied = manifests::apply(&client, &default, "kube-system", false)
        .await
        .unwrap();
    let by_kind = kinds(&applied);
    eprintln!("[chart] default values applied: {by_kind:?}");
    for kind in [
        "ClusterRole",
        "ClusterRoleBinding",
        "DaemonSet",
        "Deployment",
        "Pod",
        "PodDisruptionBudget",
        "Service",
        "ServiceAccount",
    ] {
        assert!(by_kind.contains_key(kind), "{kind} missing: {by_kind:?}");
    }

    // Every option set, into a namespace of its own, with the optional kinds' CRDs installed.
    manifests::apply(&client, &crds(), "default", false)
        .await
        .unwrap();
    manifests::apply(
        &client,
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: splitproxy-everything\n---\n\
         apiVersion: v1\nkind: Namespace\nmetadata:\n  name: monitoring-dashboards\n",
        "default",
        false,
    )
    .await
    .unwrap();
    let values = everything_values();
    let args = everything_args(&values);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let everything = template("splitproxy-everything", &args).unwrap();
    let applied = manifests::apply(&client, &everything, "splitproxy-everything", false)
        .await
        .unwrap();
    let by_kind = kinds(&applied);
    eprintln!("[chart] everything values applied: {by_kind:?}");
    for kind in ["ServiceMonitor", "PrometheusRule", "Certificate"] {
        assert!(by_kind.contains_key(kind), "{kind} missing: {by_kind:?}");
    }
    // What the API server stored is what the values asked for.
    let ds: k8s_openapi::api::apps::v1::DaemonSet =
        Api::namespaced(client.clone(), "splitproxy-everything")
            .get("sp-everything-actuator")
            .await
            .unwrap();
    let spec = ds.spec;
    let rolling = spec.update_strategy.unwrap().rolling_update.unwrap();
    assert_eq!(
        rolling.max_unavailable,
        Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String("25%".into()))
    );
    let pod = spec.template.spec.unwrap();
    assert_eq!(pod.host_network, Some(true));
    assert_eq!(pod.automount_service_account_token, Some(false));
    let caps = pod.containers[0]
        .security_context
        .as_ref()
        .unwrap()
        .capabilities
        .clone()
        .unwrap();
    assert_eq!(caps.add, Some(vec!["NET_ADMIN".to_string()]));
    assert_eq!(caps.drop, Some(vec!["ALL".to_string()]));
    eprintln!("[chart] test total: {:.1?}", start.elapsed());
}

/// The chart's brain ServiceAccount and RBAC objects, as rendered with default values but
/// `brain.streamingLists`, and the ClusterRole's rules that the watches need (the identity
/// rules, TokenReview and SubjectAccessReview, and the TLS Role are what tests/tests/chart_lab.rs
/// runs on: a brain without them refuses every token, or never serves).
fn chart_rbac(streaming: bool) -> (String, Vec<Value>) {
    let streaming = format!("brain.streamingLists={streaming}");
    let yaml = template(
        "kube-system",
        &[
            "--set",
            &streaming,
            "--show-only",
            "templates/serviceaccounts.yaml",
            "--show-only",
            "templates/brain-rbac.yaml",
        ],
    )
    .unwrap();
    let role = manifests::documents(&yaml)
        .unwrap()
        .into_iter()
        .find(|o| o.types.as_ref().is_some_and(|t| t.kind == "ClusterRole"))
        .unwrap();
    let rules: Vec<Value> = role.data["rules"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["verbs"].as_array().unwrap().iter().any(|v| v == "watch"))
        .cloned()
        .collect();
    assert!(rules.len() >= 3, "{rules:?}");
    (yaml, rules)
}

/// A ServiceAccount bound to a ClusterRole with `rules`, all named `name`, in kube-system.
fn account_with_rules(name: &str, rules: &[Value]) -> String {
    let objects = [
        json!({"apiVersion": "v1", "kind": "ServiceAccount",
               "metadata": {"name": name, "namespace": "kube-system"}}),
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
               "metadata": {"name": name}, "rules": rules}),
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
               "metadata": {"name": name},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
               "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": "kube-system"}]}),
    ];
    objects
        .iter()
        .map(|o| serde_yaml::to_string(o).unwrap())
        .collect::<Vec<_>>()
        .join("---\n")
}

/// A kubeconfig with a TokenRequest token of ServiceAccount `name` in kube-system.
async fn kubeconfig_for_account(cp: &ControlPlane, name: &str) -> PathBuf {
    let sas: Api<ServiceAccount> = Api::namespaced(cp.client(), "kube-system");
    let request = TokenRequest {
        spec: Some(TokenRequestSpec {
            expiration_seconds: Some(3600),
            ..Default::default()
        }),
        ..Default::default()
    };
    let token = sas
        .create_token_request(name, &PostParams::default(), &request)
        .await
        .unwrap()
        .status
        .unwrap()
        .token
        .unwrap();
    cp.kubeconfig_for_token(&token).unwrap()
}

/// Whether the API server's authorizer lets ServiceAccount `name` do `verb` on a rule's
/// resource (RBAC is applied asynchronously: a test waits until it has taken effect).
async fn allowed(cp: &ControlPlane, name: &str, rule: &Value, verb: &str) -> bool {
    let reviews: Api<SubjectAccessReview> = Api::all(cp.client());
    let review = SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some(format!("system:serviceaccount:kube-system:{name}")),
            groups: Some(vec![
                "system:serviceaccounts".into(),
                "system:serviceaccounts:kube-system".into(),
                "system:authenticated".into(),
            ]),
            resource_attributes: Some(ResourceAttributes {
                group: rule["apiGroups"][0].as_str().map(String::from),
                resource: rule["resources"][0].as_str().map(String::from),
                verb: Some(verb.into()),
                ..Default::default()
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    reviews
        .create(&PostParams::default(), &review)
        .await
        .unwrap()
        .status
        .unwrap()
        .allowed
}

/// Whether `brain` reports ready (every initial list complete) within `within`.
async fn syncs_within(brain: &Brain, within: Duration) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < within {
        if let Ok((200, _)) = brain.http_get("/readyz") {
            return Some(start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}

#[tokio::test(flavor = "multi_thread")]
async fn brain_syncs_with_exactly_the_charts_rbac_and_not_with_less() {
    let start = Instant::now();
    let cp = ControlPlane::start(ControlPlaneOptions::default())
        .await
        .unwrap();
    // Streaming lists (the default) and paged lists ask for different verbs.
    check_rbac(&cp, true).await;
    check_rbac(&cp, false).await;
    eprintln!("[chart] RBAC test total {:.1?}", start.elapsed());
}

/// Waits until the authorizer lets account `name` do what the first of `rules` allows (RBAC
/// objects take effect asynchronously).
async fn wait_for_rbac(cp: &ControlPlane, name: &str, rules: &[Value]) {
    let deadline = Instant::now() + Duration::from_secs(20);
    let verb = rules[0]["verbs"][0].as_str().unwrap().to_string();
    while !allowed(cp, name, &rules[0], &verb).await {
        assert!(Instant::now() < deadline, "{name}: RBAC never took effect");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The chart's account (rendered with `brain.streamingLists=streaming`) lets a brain sync; an
/// account without any one rule, or any one verb, does not. Every variant runs at once.
async fn check_rbac(cp: &ControlPlane, streaming: bool) {
    let client = cp.client();
    let (chart_yaml, rules) = chart_rbac(streaming);
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_splitproxy-lab"));
    let dir = tempfile::tempdir().unwrap();
    let pki = Pki::new("chart-rbac").unwrap();
    let mut opts = BrainOptions::default();
    opts.tuning.streaming_lists = streaming;
    let mode = if streaming { "streaming" } else { "paged" };

    // One account per rule and per verb removed (a rule's only verb is the rule itself).
    let mut variants: Vec<(String, String, Vec<Value>)> = Vec::new();
    for (i, rule) in rules.iter().enumerate() {
        let resource = rule["resources"][0].as_str().unwrap().to_string();
        let mut less = rules.clone();
        less.remove(i);
        variants.push((
            format!("{mode}-without-{resource}"),
            format!("rule {resource}"),
            less,
        ));
        let verbs = rule["verbs"].as_array().unwrap();
        if verbs.len() < 2 {
            continue;
        }
        for (v, verb) in verbs.iter().enumerate() {
            let verb = verb.as_str().unwrap();
            let mut less = rules.clone();
            less[i]["verbs"].as_array_mut().unwrap().remove(v);
            variants.push((
                format!("{mode}-without-{resource}-{verb}"),
                format!("{verb} on {resource}"),
                less,
            ));
        }
    }
    manifests::apply(&client, &chart_yaml, "kube-system", false)
        .await
        .unwrap();
    for (name, _, less) in &variants {
        manifests::apply(
            &client,
            &account_with_rules(name, less),
            "kube-system",
            false,
        )
        .await
        .unwrap();
    }
    wait_for_rbac(cp, "splitproxy-brain", &rules).await;
    for (name, _, less) in &variants {
        wait_for_rbac(cp, name, less).await;
    }

    // The chart's account: synced.
    let kubeconfig = kubeconfig_for_account(cp, "splitproxy-brain").await;
    let brain = Brain::start(&exe, &kubeconfig, &pki, dir.path(), mode, None, &opts).unwrap();
    let took = syncs_within(&brain, Duration::from_secs(30)).await;
    assert!(
        took.is_some(),
        "{mode}: the brain did not sync with the chart's RBAC:\n{}",
        brain.child.log_tail(30)
    );
    eprintln!("[chart] {mode} lists: synced with the chart's RBAC in {took:.1?}");
    drop(brain);

    // Every variant at once: none may sync, and each says what it was refused.
    let mut brains = Vec::new();
    for (name, what, _) in &variants {
        let kubeconfig = kubeconfig_for_account(cp, name).await;
        let brain = Brain::start(&exe, &kubeconfig, &pki, dir.path(), name, None, &opts).unwrap();
        brains.push((what.clone(), brain));
    }
    // Ten times what the full RBAC needed, and at least 5 s.
    let window = took.unwrap().mul_f32(10.0).max(Duration::from_secs(5));
    tokio::time::sleep(window).await;
    let mut failures = Vec::new();
    for (what, brain) in &brains {
        let log = brain.child.log_tail(200);
        if what == "list on servicecidrs" {
            // brain/src/watch.rs lists ServiceCIDRs once to learn whether the API server serves
            // them, and watches them anyway when that fails otherwise than with 404: the list is
            // granted so that this start-up check answers truthfully instead of warning.
            if !log.contains("listing ServiceCIDRs failed") {
                failures.push(format!(
                    "without {what}: the start-up check did not fail:\n{log}"
                ));
            }
            continue;
        }
        let refused = log.contains("forbidden") || log.contains("403");
        if !streaming && what.starts_with("watch on ") {
            // Paged lists without watch: each list succeeds, each watch after it is refused,
            // and kube's watcher backs off and lists again, so the brain reports ready while it
            // polls. The refusal must show (log, splitproxy_brain_relists_total).
            if !refused {
                failures.push(format!("without {what}: no refusal in the log:\n{log}"));
            }
            continue;
        }
        match brain.http_get("/readyz") {
            Ok((200, _)) => failures.push(format!("synced without {what}")),
            Ok(_) if refused => {}
            Ok(_) => failures.push(format!("without {what}: no refusal in the log:\n{log}")),
            Err(e) => failures.push(format!("without {what}: /readyz: {e:#}")),
        }
    }
    eprintln!(
        "[chart] {mode} lists: {} variants refused over {window:.1?}",
        brains.len(),
    );
    assert!(failures.is_empty(), "{mode}: {}", failures.join("\n"));
}

fn read_json(path: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

fn blob(layout: &Path, digest: &str) -> PathBuf {
    layout
        .join("blobs/sha256")
        .join(digest.strip_prefix("sha256:").unwrap())
}

/// Whether this process runs as root (chroot needs it).
fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().nth(1))
        == Some("0")
}

#[test]
fn images_are_reproducible_static_and_labelled() {
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    let first = timed("tools/image.sh (first)", || images::build(a.path(), None));
    let second = timed("tools/image.sh (second)", || images::build(b.path(), None));
    assert_eq!(first.len(), 4, "brain, actuator, check, echo: {first:?}");
    for (x, y) in first.iter().zip(&second) {
        assert_eq!(x[..3], y[..3], "not reproducible");
        assert_eq!(
            std::fs::read(&x[3]).unwrap(),
            std::fs::read(&y[3]).unwrap(),
            "archives differ"
        );
        eprintln!("[chart] image {} {} {}", x[0], x[1], x[2]);
    }
    let commit = String::from_utf8(
        Command::new("git")
            .args(["rev-parse", "HEAD"])
            .current_dir(tools::workspace_root())
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap();
    for line in &first {
        let (name, digest) = (&line[0], &line[2]);
        let layout = a.path().join(name);
        let index = read_json(&layout.join("index.json"));
        let desc = &index["manifests"][0];
        assert_eq!(desc["digest"], json!(digest));
        assert_eq!(
            desc["annotations"]["org.opencontainers.image.ref.name"],
            json!(line[1])
        );
        let manifest = read_json(&blob(&layout, digest));
        let config = read_json(&blob(
            &layout,
            manifest["config"]["digest"].as_str().unwrap(),
        ));
        let labels = &config["config"]["Labels"];
        assert_eq!(
            labels["org.opencontainers.image.revision"],
            json!(commit.trim())
        );
        assert_eq!(labels["org.opencontainers.image.version"], json!(line[1]));
        let user = config["config"]["User"].as_str().unwrap();
        // Root only where NET_ADMIN must be effective (tools/image.sh says why).
        let expected = if name == "splitproxy-actuator" {
            "0:0"
        } else {
            "65532:65532"
        };
        assert_eq!(user, expected, "{name}");
        // The layer: the binary and /etc/{passwd,group}, owned by 0:0, nothing else.
        let layer = blob(&layout, manifest["layers"][0]["digest"].as_str().unwrap());
        let listing = Command::new("tar")
            .args(["-tzvf"])
            .arg(&layer)
            .arg("--numeric-owner")
            .output()
            .unwrap();
        let listing = String::from_utf8_lossy(&listing.stdout);
        let paths: Vec<&str> = listing
            .lines()
            .map(|l| l.split_whitespace().last().unwrap())
            .collect();
        assert_eq!(
            paths,
            [
                "etc/",
                "etc/group",
                "etc/passwd",
                "usr/",
                "usr/bin/",
                &format!("usr/bin/{name}")
            ],
            "{listing}"
        );
        assert!(listing.lines().all(|l| l.contains(" 0/0 ")), "{listing}");
        // Static: it runs in a root holding nothing but the layer (no libc, no loader).
        if is_root() {
            let root = tempfile::tempdir().unwrap();
            let untar = Command::new("tar")
                .arg("-xzf")
                .arg(&layer)
                .arg("-C")
                .arg(root.path())
                .status()
                .unwrap();
            assert!(untar.success());
            let out = Command::new("chroot")
                .arg(root.path())
                .arg(format!("/usr/bin/{name}"))
                .arg("--version")
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{name} does not run alone: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
    // skopeo, when installed, reads the archive as a registry client would.
    if Command::new("skopeo").arg("--version").output().is_ok() {
        for line in &first {
            let out = Command::new("skopeo")
                .args(["inspect", "--raw"])
                .arg(format!("oci-archive:{}:{}", line[3], line[1]))
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "skopeo refused {}: {}",
                line[3],
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}

/// Runs the `helm test` program with `--timeout` seconds inside network namespace `ns` (where
/// `brain` and the API server are forwarded to the lab's, see the test); returns whether it
/// passed and what it printed.
fn run_check(
    lab: &splitproxy_tests::lab::Lab,
    ns: &splitproxy_tests::Netns,
    timeout: u64,
) -> (bool, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_splitproxy-check"));
    cmd.env("KUBECONFIG", lab.cp.kubeconfig_path())
        .args(["--namespace", "splitproxy-check"])
        .args([
            "--actuator-selector",
            "app.kubernetes.io/component=actuator",
        ])
        .args(["--brain-service", "splitproxy-brain"])
        .args(["--server-name", "localhost"])
        .arg("--ca")
        .arg(&lab.operator_tls.ca)
        .arg("--cert")
        .arg(&lab.operator_tls.cert)
        .arg("--key")
        .arg(&lab.operator_tls.key)
        .args(["--timeout", &timeout.to_string()]);
    let log = lab.dir().join(format!("check-{timeout}.log"));
    let _ = std::fs::remove_file(&log);
    let mut child = ns.spawn("splitproxy-check", cmd, &log).unwrap();
    let deadline = Instant::now() + Duration::from_secs(timeout + 30);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "splitproxy-check did not end");
        std::thread::sleep(Duration::from_millis(100));
    };
    (status.success(), std::fs::read_to_string(&log).unwrap())
}

/// An actuator pod object on `node` (what the check reads to know which nodes must be in sync).
fn actuator_pod(node: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: actuator-{node}\n  namespace: \
         splitproxy-check\n  labels:\n    app.kubernetes.io/component: actuator\nspec:\n  \
         nodeName: {node}\n  serviceAccountName: check\n  automountServiceAccountToken: false\n  \
         containers:\n  - name: actuator\n    image: splitproxy-actuator\n"
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn helm_test_program_passes_only_when_every_actuator_is_in_sync() {
    if !is_root() {
        eprintln!("SKIP: the lab needs root (network namespaces)");
        return;
    }
    let start = Instant::now();
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_splitproxy-lab"));
    let lab = splitproxy_tests::lab::Lab::start(splitproxy_tests::lab::LabOptions::new(exe))
        .await
        .unwrap();
    lab.wait_synced(Duration::from_secs(30)).await.unwrap();
    let client = lab.cp.client();
    // The objects the check reads: the actuator pods on each node, and the brains' headless
    // Service's EndpointSlice (the brain listens on host loopback in the lab).
    // EndpointSlices refuse loopback addresses, and the lab's brain listens on host loopback:
    // the check runs in the external client's namespace, where the client's own address
    // forwards to the brain and 127.0.0.1 to the API server.
    let external = lab.cluster.external_clients()[0].clone();
    let brain_at = std::net::SocketAddr::new(external.ip(), 19443);
    let _to_brain =
        splitproxy_tests::forward_port(external.netns(), brain_at, lab.brain(0).grpc).unwrap();
    let _to_api =
        splitproxy_tests::forward_port(external.netns(), lab.cp.addr(), lab.cp.addr()).unwrap();
    let grpc = brain_at;
    let mut yaml = format!(
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: splitproxy-check\n---\napiVersion: \
         v1\nkind: ServiceAccount\nmetadata:\n  name: check\n  namespace: splitproxy-check\n---\n\
         apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: \
         splitproxy-brain-1\n  namespace: splitproxy-check\n  labels:\n    \
         kubernetes.io/service-name: splitproxy-brain\naddressType: IPv4\nports:\n- name: grpc\n  \
         port: {}\n  protocol: TCP\nendpoints:\n- addresses: [\"{}\"]\n  conditions:\n    ready: \
         true\n",
        grpc.port(),
        grpc.ip()
    );
    for node in lab.node_specs() {
        yaml.push_str("---\n");
        yaml.push_str(&actuator_pod(&node.name));
    }
    manifests::apply(&client, &yaml, "splitproxy-check", false)
        .await
        .unwrap();

    let (ok, out) = timed("splitproxy-check, every node in sync", || {
        run_check(&lab, external.netns(), 30)
    });
    assert!(ok, "{out}");
    assert!(out.contains("every node is in sync (2 nodes)"), "{out}");

    // A node whose actuator never connected: the check fails and names it.
    manifests::apply(&client, &actuator_pod("node-9"), "splitproxy-check", false)
        .await
        .unwrap();
    let (ok, out) = timed("splitproxy-check, one node missing", || {
        run_check(&lab, external.netns(), 3)
    });
    assert!(!ok, "{out}");
    assert!(
        out.contains("node-9: no brain knows this node's actuator"),
        "{out}"
    );
    eprintln!(
        "[chart] helm test program test total {:.1?}",
        start.elapsed()
    );
}
