//! The token-to-identity mapping and the review cache, with a fake [`Reviewer`].
use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::sync::atomic::AtomicUsize;

use super::*;
use crate::auth::{self, DEFAULT_NODE_GROUP, DEFAULT_OPERATOR_GROUP};
use crate::metrics::Metrics;

const NODE_SA: &str = "system:serviceaccount:kube-system:splitproxy-actuator";

/// Answers from tables, counting the reviews; `None` in `tokens` is an API error.
#[derive(Default)]
struct Fake {
    tokens: HashMap<String, Option<TokenReviewed>>,
    operators: Vec<String>,
    sar_fails: bool,
    delay: Duration,
    token_reviews: AtomicUsize,
    access_reviews: AtomicUsize,
    asked: Mutex<Vec<UserInfo>>,
}

impl Reviewer for Fake {
    fn review_token<'a>(
        &'a self,
        token: &'a str,
        audience: &'a str,
    ) -> BoxFuture<'a, Result<TokenReviewed, ReviewError>> {
        Box::pin(async move {
            assert_eq!(audience, "splitproxy");
            self.token_reviews.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(self.delay).await;
            match self.tokens.get(token) {
                Some(Some(r)) => Ok(r.clone()),
                Some(None) => Err(ReviewError("connection refused".into())),
                None => Ok(TokenReviewed::Unauthenticated(
                    "invalid bearer token".into(),
                )),
            }
        })
    }

    fn may_introspect<'a>(
        &'a self,
        user: &'a UserInfo,
    ) -> BoxFuture<'a, Result<bool, ReviewError>> {
        Box::pin(async move {
            self.access_reviews.fetch_add(1, Ordering::SeqCst);
            self.asked.lock().unwrap().push(user.clone());
            if self.sar_fails {
                return Err(ReviewError("etcd timeout".into()));
            }
            Ok(self.operators.contains(&user.username))
        })
    }
}

/// A JWT-shaped token (unsigned: the fake reviewer stands for the API server's check).
fn jwt(exp: Option<SystemTime>, salt: &str) -> String {
    let b64 = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
    let payload = match exp {
        Some(at) => format!(
            r#"{{"aud":["splitproxy"],"exp":{},"sub":"{salt}"}}"#,
            at.duration_since(SystemTime::UNIX_EPOCH).unwrap().as_secs()
        ),
        None => format!(r#"{{"sub":"{salt}"}}"#),
    };
    format!("{}.{}.c2ln", b64(r#"{"alg":"RS256"}"#), b64(&payload))
}

fn user(name: &str, node: Option<&str>) -> UserInfo {
    let mut extra = BTreeMap::new();
    if let Some(node) = node {
        extra.insert(NODE_NAME_CLAIM.to_string(), vec![node.to_string()]);
        extra.insert(
            "authentication.kubernetes.io/pod-name".to_string(),
            vec!["actuator-x".to_string()],
        );
    }
    UserInfo {
        username: name.to_string(),
        uid: format!("uid-{name}"),
        groups: vec![
            "system:serviceaccounts".into(),
            "system:authenticated".into(),
        ],
        extra,
    }
}

fn node_account() -> ServiceAccountRef {
    "kube-system/splitproxy-actuator".parse().unwrap()
}

fn authenticator(fake: Fake) -> (Authenticator, Arc<Fake>, Arc<Metrics>) {
    let fake = Arc::new(fake);
    let metrics = Arc::new(Metrics::default());
    let a = Authenticator::new(
        TokenSettings {
            audience: "splitproxy".into(),
            node_service_account: Some(node_account()),
        },
        Groups::default(),
        fake.clone(),
        metrics.clone(),
    );
    (a, fake, metrics)
}

fn in_an_hour() -> SystemTime {
    SystemTime::now() + Duration::from_secs(3600)
}

#[test]
fn service_account_references_parse_and_print() {
    let sa = node_account();
    assert_eq!(sa.username(), NODE_SA);
    assert_eq!(sa.to_string(), "kube-system/splitproxy-actuator");
    for bad in ["", "x", "/x", "x/", "a/b/c", "A/b", "a b/c"] {
        assert!(bad.parse::<ServiceAccountRef>().is_err(), "{bad:?}");
    }
}

#[test]
fn only_the_node_account_with_one_valid_node_claim_is_a_node() {
    let sa = node_account();
    assert_eq!(
        classify(&user(NODE_SA, Some("node-0")), Some(&sa)),
        Class::Node("node-0".into())
    );
    assert_eq!(
        classify(&user(NODE_SA, None), Some(&sa)),
        Class::NoNodeClaim
    );
    assert_eq!(
        classify(&user(NODE_SA, Some("Not A Node")), Some(&sa)),
        Class::NoNodeClaim
    );
    let mut two = user(NODE_SA, Some("node-0"));
    two.extra.insert(
        NODE_NAME_CLAIM.into(),
        vec!["node-0".into(), "node-1".into()],
    );
    assert_eq!(classify(&two, Some(&sa)), Class::NoNodeClaim);
    // Another account's token bound to a pod on a node is no node, nor is any token when no
    // node account is configured.
    let other = "system:serviceaccount:kube-system:other";
    assert_eq!(
        classify(&user(other, Some("node-0")), Some(&sa)),
        Class::Other
    );
    assert_eq!(classify(&user(NODE_SA, Some("node-0")), None), Class::Other);
}

#[test]
fn the_expiry_is_read_from_the_jwt_payload() {
    let at = SystemTime::UNIX_EPOCH + Duration::from_secs(1_900_000_000);
    assert_eq!(jwt_expiry(&jwt(Some(at), "a")), Some(at));
    assert_eq!(jwt_expiry(&jwt(None, "a")), None);
    for garbage in ["", "abc", "a.b", "a.!!!.c", "a.e30.c.d", "x.bm90IGpzb24.y"] {
        assert_eq!(jwt_expiry(garbage), None, "{garbage:?}");
    }
}

#[test]
fn accepted_tokens_are_trusted_until_their_expiry_at_most_five_minutes() {
    let now = SystemTime::now();
    assert_eq!(ttl_until(None, now), POSITIVE_TTL);
    assert_eq!(
        ttl_until(Some(now + Duration::from_secs(3600)), now),
        POSITIVE_TTL
    );
    assert_eq!(
        ttl_until(Some(now + Duration::from_secs(42)), now),
        Duration::from_secs(42)
    );
    assert_eq!(
        ttl_until(Some(now - Duration::from_secs(1)), now),
        Duration::ZERO
    );
}

#[tokio::test]
async fn tokens_map_to_the_node_and_operator_roles_or_to_none() {
    let exp = in_an_hour();
    let node0 = jwt(Some(exp), "node-0");
    let ops = jwt(Some(exp), "ops");
    let nobody = jwt(Some(exp), "nobody");
    let unbound = jwt(Some(exp), "unbound");
    let tokens = HashMap::from([
        (
            node0.clone(),
            Some(TokenReviewed::Authenticated(user(NODE_SA, Some("node-0")))),
        ),
        (
            ops.clone(),
            Some(TokenReviewed::Authenticated(user("alice", None))),
        ),
        (
            nobody.clone(),
            Some(TokenReviewed::Authenticated(user(
                "system:serviceaccount:default:other",
                Some("node-0"),
            ))),
        ),
        (
            unbound.clone(),
            Some(TokenReviewed::Authenticated(user(NODE_SA, None))),
        ),
    ]);
    let (a, fake, _) = authenticator(Fake {
        tokens,
        operators: vec!["alice".into()],
        ..Default::default()
    });
    let groups = Groups::default();

    let id = a.identity(&node0).await.unwrap();
    assert_eq!(id.names, ["node-0"]);
    assert_eq!(id.groups, [DEFAULT_NODE_GROUP]);
    // Whole seconds, as the JWT carries them.
    let exp_secs = exp
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    assert_eq!(
        id.expires,
        Some(SystemTime::UNIX_EPOCH + Duration::from_secs(exp_secs))
    );
    assert_eq!(
        id.credential,
        Credential::Token {
            user: NODE_SA.into()
        }
    );
    let roles = auth::roles(&id, &groups);
    assert_eq!(roles.may_sync("node-0"), Ok(()));
    assert_eq!(roles.may_sync("node-1"), Err(Refusal::OtherNode));
    assert_eq!(roles.may_read("node-1"), Err(Refusal::OtherNode));
    assert!(!roles.operator);

    let id = a.identity(&ops).await.unwrap();
    assert_eq!(id.groups, [DEFAULT_OPERATOR_GROUP]);
    let roles = auth::roles(&id, &groups);
    assert_eq!(roles.listable(), Ok(None));
    assert_eq!(roles.may_sync("node-0"), Err(Refusal::NotANode));
    // SubjectAccessReview is asked with everything TokenReview said about the user.
    assert_eq!(fake.asked.lock().unwrap()[0], user("alice", None));

    // Another account's token, even bound to a pod on a node: no role.
    let id = a.identity(&nobody).await.unwrap();
    assert_eq!(auth::roles(&id, &groups).any(), Err(Refusal::NoRole));
    assert_eq!(
        auth::roles(&id, &groups).may_sync("node-0"),
        Err(Refusal::NoRole)
    );

    let err = a.identity(&unbound).await.unwrap_err();
    assert_eq!(err.reason, Refusal::NoNodeClaim);
    assert!(err.detail.contains(NODE_NAME_CLAIM), "{}", err.detail);

    let err = a.identity("garbage").await.unwrap_err();
    assert_eq!(err.reason, Refusal::BadToken);
    assert!(
        err.detail.contains("invalid bearer token"),
        "{}",
        err.detail
    );
    let err = a.identity("").await.unwrap_err();
    assert_eq!(err.reason, Refusal::BadToken);
    let err = a.identity(&"x".repeat(MAX_TOKEN + 1)).await.unwrap_err();
    assert_eq!(err.reason, Refusal::BadToken);
    // The node account's token is never sent to SubjectAccessReview; the others once each.
    assert_eq!(fake.access_reviews.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn reviews_are_cached_positive_and_negative_and_shared_by_concurrent_calls() {
    let node0 = jwt(Some(in_an_hour()), "node-0");
    let (a, fake, metrics) = authenticator(Fake {
        tokens: HashMap::from([(
            node0.clone(),
            Some(TokenReviewed::Authenticated(user(NODE_SA, Some("node-0")))),
        )]),
        delay: Duration::from_millis(50),
        ..Default::default()
    });
    let a = Arc::new(a);
    let calls: Vec<_> = (0..20)
        .map(|_| {
            let (a, t) = (a.clone(), node0.clone());
            tokio::spawn(async move { a.identity(&t).await })
        })
        .collect();
    for c in calls {
        assert_eq!(c.await.unwrap().unwrap().names, ["node-0"]);
    }
    assert_eq!(fake.token_reviews.load(Ordering::SeqCst), 1, "one review");
    for _ in 0..3 {
        assert_eq!(
            a.identity("bad").await.unwrap_err().reason,
            Refusal::BadToken
        );
    }
    assert_eq!(
        fake.token_reviews.load(Ordering::SeqCst),
        2,
        "a refused token is remembered too"
    );
    let c = &metrics.tokens;
    assert_eq!(c.cache_misses.load(Ordering::Relaxed), 2);
    assert_eq!(c.cache_hits.load(Ordering::Relaxed), 21);
    assert_eq!(c.authenticated.load(Ordering::Relaxed), 1);
    assert_eq!(c.unauthenticated.load(Ordering::Relaxed), 1);
    let text = metrics.render(0);
    assert!(
        text.contains("splitproxy_brain_token_cache_total{result=\"hit\"} 21"),
        "{text}"
    );
    assert!(text.contains("splitproxy_brain_token_reviews_total{result=\"unauthenticated\"} 1"));
}

#[tokio::test]
async fn cached_results_live_as_long_as_they_may() {
    let soon = SystemTime::now() + Duration::from_secs(42);
    let node0 = jwt(Some(soon), "node-0");
    let denied = jwt(Some(in_an_hour()), "denied");
    let forever = jwt(None, "static");
    let (a, _, _) = authenticator(Fake {
        tokens: HashMap::from([
            (
                node0.clone(),
                Some(TokenReviewed::Authenticated(user(NODE_SA, Some("node-0")))),
            ),
            (
                denied.clone(),
                Some(TokenReviewed::Authenticated(user("bob", None))),
            ),
            (
                forever.clone(),
                Some(TokenReviewed::Authenticated(user("carol", None))),
            ),
        ]),
        operators: vec!["carol".into()],
        ..Default::default()
    });
    let ttl = |c: Cached| c.ttl;
    let t = ttl(a.review(&node0).await.unwrap());
    assert!(
        t <= Duration::from_secs(42) && t >= Duration::from_secs(40),
        "until exp: {t:?}"
    );
    assert_eq!(ttl(a.review(&denied).await.unwrap()), NEGATIVE_TTL);
    assert_eq!(ttl(a.review("garbage").await.unwrap()), NEGATIVE_TTL);
    assert_eq!(ttl(a.review(&forever).await.unwrap()), POSITIVE_TTL);
}

#[tokio::test]
async fn api_errors_are_unavailable_and_not_cached() {
    let down = jwt(Some(in_an_hour()), "down");
    let ops = jwt(Some(in_an_hour()), "ops");
    let (a, fake, metrics) = authenticator(Fake {
        tokens: HashMap::from([
            (down.clone(), None),
            (
                ops.clone(),
                Some(TokenReviewed::Authenticated(user("alice", None))),
            ),
        ]),
        operators: vec!["alice".into()],
        sar_fails: true,
        ..Default::default()
    });
    for _ in 0..2 {
        let err = a.identity(&down).await.unwrap_err();
        assert_eq!(err.reason, Refusal::TokenReviewUnavailable);
        assert!(err.detail.contains("connection refused"), "{}", err.detail);
        let err = a.identity(&ops).await.unwrap_err();
        assert_eq!(err.reason, Refusal::TokenReviewUnavailable);
        assert!(err.detail.contains("SubjectAccessReview"), "{}", err.detail);
    }
    assert_eq!(fake.token_reviews.load(Ordering::SeqCst), 4, "asked again");
    assert_eq!(metrics.tokens.review_errors.load(Ordering::Relaxed), 2);
    assert_eq!(metrics.tokens.access_errors.load(Ordering::Relaxed), 2);
}

/// The API server accepts a token up to a minute past its `exp` (its JWT validation's leeway);
/// the brain does not, and says why in words rather than relaying a review. A token whose `exp`
/// has passed is not even sent for review: whatever the answer, it would be refused.
#[tokio::test]
async fn an_expired_token_is_refused_as_expired_without_a_review() {
    let past = jwt(Some(SystemTime::now() - Duration::from_secs(5)), "old");
    let (a, fake, metrics) = authenticator(Fake {
        tokens: HashMap::from([(
            past.clone(),
            Some(TokenReviewed::Authenticated(user(NODE_SA, Some("node-0")))),
        )]),
        ..Default::default()
    });
    for _ in 0..2 {
        let err = a.identity(&past).await.unwrap_err();
        assert_eq!(err.reason, Refusal::BadToken);
        assert!(
            err.detail.starts_with("the token expired ") && err.detail.contains(" s ago (exp 20"),
            "{}",
            err.detail
        );
    }
    assert_eq!(fake.token_reviews.load(Ordering::SeqCst), 0);
    assert_eq!(metrics.tokens.unauthenticated.load(Ordering::Relaxed), 0);
}

/// An accepted token whose review is cached is refused as expired from its `exp` on, without a
/// new review (the cache entry lives until then at most).
#[tokio::test]
async fn an_accepted_token_is_refused_as_expired_from_its_exp_on() {
    let soon = SystemTime::now() + Duration::from_secs(2);
    let token = jwt(Some(soon), "soon");
    let (a, fake, _) = authenticator(Fake {
        tokens: HashMap::from([(
            token.clone(),
            Some(TokenReviewed::Authenticated(user(NODE_SA, Some("node-0")))),
        )]),
        ..Default::default()
    });
    assert_eq!(a.identity(&token).await.unwrap().names, ["node-0"]);
    let exp = jwt_expiry(&token).unwrap();
    tokio::time::sleep(exp.duration_since(SystemTime::now()).unwrap_or_default()).await;
    let err = a.identity(&token).await.unwrap_err();
    assert_eq!(err.reason, Refusal::BadToken);
    assert!(err.detail.contains("expired"), "{}", err.detail);
    assert_eq!(fake.token_reviews.load(Ordering::SeqCst), 1);
}

/// A token TokenReview refuses whose own `aud` does not name the brain's audience: the refusal
/// says so (the claim explains, TokenReview decided). With the right audience, or no JWT at
/// all, the API server's reason is relayed as before.
#[tokio::test]
async fn a_wrong_audience_is_named_in_the_refusal() {
    let b64 = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
    let with_payload =
        |payload: &str| format!("{}.{}.c2ln", b64(r#"{"alg":"RS256"}"#), b64(payload));
    let exp = in_an_hour()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let (a, fake, _) = authenticator(Fake::default());
    let one = with_payload(&format!(r#"{{"aud":"somebody-else","exp":{exp}}}"#));
    let err = a.identity(&one).await.unwrap_err();
    assert_eq!(err.reason, Refusal::BadToken);
    assert!(
        err.detail.starts_with(
            r#"the token is for audience ["somebody-else"], not "splitproxy"; TokenReview: invalid bearer token"#
        ),
        "{}",
        err.detail
    );
    let many = with_payload(&format!(
        r#"{{"aud":["a","b","c","d","e","{}"],"exp":{exp}}}"#,
        "f".repeat(1000)
    ));
    let err = a.identity(&many).await.unwrap_err();
    assert!(
        err.detail
            .contains(r#"["a", "b", "c", "d"] and 2 more, not "splitproxy""#),
        "{}",
        err.detail
    );
    for relayed in [
        with_payload(&format!(r#"{{"aud":["splitproxy"],"exp":{exp}}}"#)),
        with_payload(r#"{"aud":7}"#),
        "garbage".to_string(),
    ] {
        let err = a.identity(&relayed).await.unwrap_err();
        assert!(
            err.detail
                .starts_with(r#"TokenReview (audience "splitproxy") did not accept the token: invalid bearer token"#),
            "{relayed}: {}",
            err.detail
        );
    }
    assert_eq!(fake.token_reviews.load(Ordering::SeqCst), 5);
}

#[test]
fn unverified_claims_take_one_audience_or_several() {
    let b64 = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
    let of = |payload: &str| UnverifiedClaims::of(&format!("e30.{}.c2ln", b64(payload)));
    assert_eq!(
        of(r#"{"aud":"x","exp":5}"#),
        Some(UnverifiedClaims {
            exp: Some(5),
            aud: vec!["x".into()]
        })
    );
    assert_eq!(
        of(r#"{"aud":["x",3,"y"]}"#).unwrap().aud,
        ["x".to_string(), "y".to_string()]
    );
    assert_eq!(of(r#"{"exp":"soon"}"#), Some(UnverifiedClaims::default()));
    assert_eq!(of("[1]"), None);
}
