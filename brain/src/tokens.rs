//! Bearer tokens: which [`Identity`] a Kubernetes token stands for, so that [`crate::auth::roles`]
//! decides what it may do exactly as for a client certificate ("node scoped",
//! docs/invariants.md; docs/protocol.md, "Who may call what").
//!
//! A caller without a client certificate sends gRPC metadata `authorization: Bearer <token>`.
//! The brain does not verify the token itself: it asks the API server (TokenReview, audiences =
//! `--token-audience`), which knows the signing keys, the token's audience, and whether the
//! pod it is bound to still exists. Then:
//!
//! - a token of the node ServiceAccount (`--node-service-account`) whose review carries the
//!   node-name claim ([`NODE_NAME_CLAIM`], set when the token is bound to a pod scheduled on a
//!   node) stands for that node only: names = \[node\], groups = \[node group\]. Without the claim
//!   it is refused ([`Refusal::NoNodeClaim`]): it names no node;
//! - any other authenticated user is an operator iff a SubjectAccessReview allows it `get` on
//!   `splitproxy.io/introspection` (groups = [operator group]); otherwise it has no role;
//! - the identity expires at the token's JWT `exp`, so a node's stream ends when its token does.
//!
//! A token whose own `exp` has passed is refused without a review ("the token expired ... ago"):
//! whatever TokenReview answered, the brain would refuse it (an accepted identity ends at its
//! `exp`), so reading that claim unverified decides nothing a review could change. The claims
//! are otherwise read unverified only to say why TokenReview refused a token (a JWT for another
//! audience says so), never to accept one ([`UnverifiedClaims`]).
//!
//! Reviews are cached, keyed by the token's SHA-256 (the token itself is never kept): an accepted
//! token until min(its `exp`, [`POSITIVE_TTL`]), so a deleted pod's token stops opening new calls
//! within that bound; a refused one for [`NEGATIVE_TTL`], so a flood of bad tokens costs the API
//! server little and a new RoleBinding takes effect soon. Concurrent calls with one token share
//! one review. The cache holds at most [`CACHE_ENTRIES`]. An API server that does not answer is
//! not cached: the call is refused with UNAVAILABLE ([`Refusal::TokenReviewUnavailable`]), never
//! PERMISSION_DENIED, so the caller tries again rather than giving up.
//!
//! The reviews go through the [`Reviewer`] trait: [`api::ApiReviewer`] asks the API server, and
//! tests fake it.
use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use base64::Engine as _;
use sha2::{Digest, Sha256};

use crate::auth::{Credential, Groups, Identity, Refusal};

pub mod api;
#[cfg(test)]
mod tests;

/// `--token-audience`'s default.
pub const DEFAULT_AUDIENCE: &str = "splitproxy";
/// The TokenReview `user.extra` key naming the node a pod-bound token's pod runs on.
pub const NODE_NAME_CLAIM: &str = "authentication.kubernetes.io/node-name";
/// The API group and resource an operator token's user must be allowed to `get`.
pub const INTROSPECTION_GROUP: &str = "splitproxy.io";
pub const INTROSPECTION_RESOURCE: &str = "introspection";
pub const INTROSPECTION_VERB: &str = "get";
/// Longest an accepted token is trusted without a new review.
pub const POSITIVE_TTL: Duration = Duration::from_secs(300);
/// How long a refused token (or a user without a role) stays refused without a new review.
pub const NEGATIVE_TTL: Duration = Duration::from_secs(10);
/// Reviews held at once (each entry is a hash and an identity: a few hundred bytes).
pub const CACHE_ENTRIES: u64 = 20_000;
/// How long one TokenReview or SubjectAccessReview may take before the call is refused with
/// UNAVAILABLE.
pub const REVIEW_TIMEOUT: Duration = Duration::from_secs(5);
/// Reviews in flight at once: when thousands of nodes reconnect together (a brain restarted),
/// their reviews reach the API server a few dozen at a time rather than all at once.
pub const MAX_CONCURRENT_REVIEWS: usize = 64;
/// Longest token sent for review (projected tokens are about 1 KiB); longer ones are refused
/// without asking the API server.
pub const MAX_TOKEN: usize = 16 * 1024;

/// A ServiceAccount, written `<namespace>/<name>` on the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceAccountRef {
    pub namespace: String,
    pub name: String,
}

impl ServiceAccountRef {
    /// The user name its tokens authenticate as.
    pub fn username(&self) -> String {
        format!("system:serviceaccount:{}:{}", self.namespace, self.name)
    }
}

impl FromStr for ServiceAccountRef {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.split_once('/') {
            Some((ns, name))
                if crate::auth::valid_node_name(ns)
                    && crate::auth::valid_node_name(name)
                    && !name.contains('/') =>
            {
                Ok(ServiceAccountRef {
                    namespace: ns.to_string(),
                    name: name.to_string(),
                })
            }
            _ => Err(format!(
                "{s:?} is not <namespace>/<name> of a ServiceAccount"
            )),
        }
    }
}

impl std::fmt::Display for ServiceAccountRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// `--token-audience` and `--node-service-account`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenSettings {
    /// The audience tokens must be for; empty disables tokens.
    pub audience: String,
    /// The actuators' ServiceAccount; without it no token gets the node role.
    pub node_service_account: Option<ServiceAccountRef>,
}

impl Default for TokenSettings {
    fn default() -> Self {
        TokenSettings {
            audience: DEFAULT_AUDIENCE.to_string(),
            node_service_account: None,
        }
    }
}

impl TokenSettings {
    /// Whether callers may authenticate with bearer tokens.
    pub fn enabled(&self) -> bool {
        !self.audience.is_empty()
    }
}

/// The user a token authenticated as, as TokenReview reports it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UserInfo {
    pub username: String,
    pub uid: String,
    pub groups: Vec<String>,
    pub extra: BTreeMap<String, Vec<String>>,
}

/// What TokenReview said about a token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenReviewed {
    Authenticated(UserInfo),
    /// Not authenticated, with the API server's reason when it gave one.
    Unauthenticated(String),
}

/// The API server could not be asked (no answer, an error status, a forbidden review).
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct ReviewError(pub String);

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The two questions the brain asks the API server about a token.
pub trait Reviewer: Send + Sync {
    /// TokenReview of `token` for `audience`.
    fn review_token<'a>(
        &'a self,
        token: &'a str,
        audience: &'a str,
    ) -> BoxFuture<'a, Result<TokenReviewed, ReviewError>>;

    /// SubjectAccessReview: may `user` `get` `splitproxy.io/introspection`?
    fn may_introspect<'a>(&'a self, user: &'a UserInfo)
    -> BoxFuture<'a, Result<bool, ReviewError>>;
}

/// What an authenticated user is, before the operator check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Class {
    /// The node ServiceAccount, bound to a pod on this node.
    Node(String),
    /// The node ServiceAccount without a (usable) node-name claim.
    NoNodeClaim,
    /// Anybody else: an operator if SubjectAccessReview allows it.
    Other,
}

/// Sorts an authenticated user: the node ServiceAccount with a node-name claim is that node.
/// A claim that is not exactly one node name is no claim.
pub fn classify(user: &UserInfo, node_account: Option<&ServiceAccountRef>) -> Class {
    let Some(account) = node_account else {
        return Class::Other;
    };
    if user.username != account.username() {
        return Class::Other;
    }
    match user.extra.get(NODE_NAME_CLAIM).map(Vec::as_slice) {
        Some([node]) if crate::auth::valid_node_name(node) => Class::Node(node.clone()),
        _ => Class::NoNodeClaim,
    }
}

/// What a JWT says about itself, read from its payload without checking its signature. Used
/// only where trusting it cannot accept anything: the expiry of a token TokenReview accepted
/// ([`jwt_expiry`]), refusing a token whose `exp` has passed, and the words of a refusal.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UnverifiedClaims {
    /// `exp`, in seconds since the epoch.
    pub exp: Option<u64>,
    /// `aud`: one string or a list of them in the JWT; empty when absent.
    pub aud: Vec<String>,
}

impl UnverifiedClaims {
    /// The claims of `token`; `None` for a token that is not a JWT with a JSON object as its
    /// payload. A claim of another type than the JWT's (an `exp` that is a string) is absent.
    pub fn of(token: &str) -> Option<UnverifiedClaims> {
        let mut parts = token.split('.');
        let (_header, payload, _signature) = (parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() {
            return None;
        }
        let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(payload.trim_end_matches('='))
            .ok()?;
        let claims: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(&bytes).ok()?;
        let aud = match claims.get("aud") {
            Some(serde_json::Value::String(a)) => vec![a.clone()],
            Some(serde_json::Value::Array(a)) => a
                .iter()
                .filter_map(|a| a.as_str().map(str::to_string))
                .collect(),
            _ => Vec::new(),
        };
        Some(UnverifiedClaims {
            exp: claims.get("exp").and_then(serde_json::Value::as_u64),
            aud,
        })
    }

    /// When the token says it expires.
    pub fn expiry(&self) -> Option<SystemTime> {
        SystemTime::UNIX_EPOCH.checked_add(Duration::from_secs(self.exp?))
    }
}

/// When a JWT says it expires (`exp`), read from its payload without checking its signature:
/// only called once TokenReview accepted the token, which checked it. `None` for a token that
/// is not a JWT or has no `exp`.
pub fn jwt_expiry(token: &str) -> Option<SystemTime> {
    UnverifiedClaims::of(token)?.expiry()
}

/// The refusal of a token that expired at `at`: it says so, how long ago, and when.
fn expired(at: SystemTime, now: SystemTime) -> Rejected {
    let ago = now.duration_since(at).unwrap_or_default().as_secs();
    let when = at
        .duration_since(SystemTime::UNIX_EPOCH)
        .ok()
        .and_then(|d| i64::try_from(d.as_secs()).ok())
        .and_then(|s| k8s_openapi::jiff::Timestamp::from_second(s).ok())
        .map(|t| t.to_string())
        .unwrap_or_else(|| "?".into());
    Rejected::new(
        Refusal::BadToken,
        format!("the token expired {ago} s ago (exp {when})"),
    )
}

/// Why TokenReview (for `audience`) refused `token`, in words: when the token's own `aud` does
/// not name `audience`, that is the likely reason and is said first; otherwise the API server's
/// reason (`why`). Peer-supplied text is bounded.
fn not_accepted(token: &str, audience: &str, why: &str) -> String {
    let why = if why.is_empty() {
        "not authenticated".to_string()
    } else {
        crate::auth::bounded(why, 512)
    };
    let aud = UnverifiedClaims::of(token)
        .map(|c| c.aud)
        .unwrap_or_default();
    if !aud.is_empty() && !aud.iter().any(|a| a == audience) {
        let shown: Vec<String> = aud
            .iter()
            .take(4)
            .map(|a| crate::auth::bounded(a, 64))
            .collect();
        let more = if aud.len() > shown.len() {
            format!(" and {} more", aud.len() - shown.len())
        } else {
            String::new()
        };
        return format!(
            "the token is for audience {shown:?}{more}, not {audience:?}; TokenReview: {why}"
        );
    }
    format!("TokenReview (audience {audience:?}) did not accept the token: {why}")
}

/// Why a token was not accepted: the refusal (its metric label and status code) and the
/// detail given to the caller and the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejected {
    pub reason: Refusal,
    pub detail: String,
}

impl Rejected {
    fn new(reason: Refusal, detail: impl Into<String>) -> Self {
        Rejected {
            reason,
            detail: detail.into(),
        }
    }
}

#[derive(Debug, Clone)]
enum Verdict {
    /// An identity, which may have no role (a user SubjectAccessReview did not allow).
    Accepted(Identity),
    Refused(Rejected),
}

/// One review's result and how long it may be reused.
#[derive(Debug, Clone)]
struct Cached {
    verdict: Verdict,
    ttl: Duration,
}

/// Each entry expires after its own time to live.
struct PerEntry;

impl moka::Expiry<[u8; 32], Cached> for PerEntry {
    fn expire_after_create(
        &self,
        _key: &[u8; 32],
        value: &Cached,
        _created_at: std::time::Instant,
    ) -> Option<Duration> {
        Some(value.ttl)
    }
}

/// Counters of the reviews (`splitproxy_brain_token_reviews_total{result}`,
/// `splitproxy_brain_subject_access_reviews_total{result}`, `splitproxy_brain_token_cache_total{result}`).
#[derive(Debug, Default)]
pub struct TokenMetrics {
    pub authenticated: AtomicU64,
    pub unauthenticated: AtomicU64,
    pub review_errors: AtomicU64,
    pub access_allowed: AtomicU64,
    pub access_denied: AtomicU64,
    pub access_errors: AtomicU64,
    pub cache_hits: AtomicU64,
    pub cache_misses: AtomicU64,
}

impl TokenMetrics {
    /// Adds the token metrics to a scrape (`crate::metrics::Exposition`).
    pub fn expose(&self, out: &mut crate::metrics::Exposition) {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let by_result = |values: &[(&'static str, u64)]| {
            values
                .iter()
                .map(|(result, n)| (vec![("result", *result)], *n))
                .collect::<Vec<_>>()
        };
        out.counters(
            "splitproxy_brain_token_reviews_total",
            "TokenReviews of bearer tokens sent to the API server, by result (error: no answer, counted as refusals token_review_unavailable).",
            by_result(&[
                ("authenticated", g(&self.authenticated)),
                ("unauthenticated", g(&self.unauthenticated)),
                ("error", g(&self.review_errors)),
            ]),
        );
        out.counters(
            "splitproxy_brain_subject_access_reviews_total",
            "SubjectAccessReviews (get splitproxy.io/introspection) for token users other than the node ServiceAccount, by result.",
            by_result(&[
                ("allowed", g(&self.access_allowed)),
                ("denied", g(&self.access_denied)),
                ("error", g(&self.access_errors)),
            ]),
        );
        out.counters(
            "splitproxy_brain_token_cache_total",
            "Bearer tokens looked up in the review cache, by result.",
            by_result(&[
                ("hit", g(&self.cache_hits)),
                ("miss", g(&self.cache_misses)),
            ]),
        );
    }
}

/// Turns bearer tokens into identities, through cached reviews.
pub struct Authenticator {
    settings: TokenSettings,
    groups: Groups,
    reviewer: Arc<dyn Reviewer>,
    cache: moka::future::Cache<[u8; 32], Cached>,
    /// Bounds the reviews in flight ([`MAX_CONCURRENT_REVIEWS`]).
    in_flight: tokio::sync::Semaphore,
    metrics: Arc<crate::metrics::Metrics>,
}

impl Authenticator {
    pub fn new(
        settings: TokenSettings,
        groups: Groups,
        reviewer: Arc<dyn Reviewer>,
        metrics: Arc<crate::metrics::Metrics>,
    ) -> Self {
        Authenticator {
            settings,
            groups,
            reviewer,
            cache: moka::future::Cache::builder()
                .max_capacity(CACHE_ENTRIES)
                .expire_after(PerEntry)
                .build(),
            in_flight: tokio::sync::Semaphore::new(MAX_CONCURRENT_REVIEWS),
            metrics,
        }
    }

    fn counters(&self) -> &TokenMetrics {
        &self.metrics.tokens
    }

    /// The identity `token` stands for, or why it is refused.
    pub async fn identity(&self, token: &str) -> Result<Identity, Rejected> {
        if token.is_empty() || token.len() > MAX_TOKEN {
            return Err(Rejected::new(
                Refusal::BadToken,
                format!("a bearer token must have 1 to {MAX_TOKEN} bytes"),
            ));
        }
        let key: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        let entry = self
            .cache
            .entry(key)
            .or_try_insert_with(self.review(token))
            .await
            .map_err(|e| Rejected::new(Refusal::TokenReviewUnavailable, e.to_string()))?;
        let counter = if entry.is_fresh() {
            &self.counters().cache_misses
        } else {
            &self.counters().cache_hits
        };
        counter.fetch_add(1, Ordering::Relaxed);
        match entry.into_value().verdict {
            // Cached until its expiry: this is the moment it passes, or it passed while the
            // review was under way.
            Verdict::Accepted(Identity {
                expires: Some(at), ..
            }) if at <= SystemTime::now() => Err(expired(at, SystemTime::now())),
            Verdict::Accepted(identity) => Ok(identity),
            Verdict::Refused(rejected) => Err(rejected),
        }
    }

    /// Asks the API server about `token`. An `Err` (no answer) is not cached.
    async fn review(&self, token: &str) -> Result<Cached, ReviewError> {
        let c = self.counters();
        // Refused whatever TokenReview says (see the module's documentation): not asked.
        let now = SystemTime::now();
        if let Some(at) = UnverifiedClaims::of(token).and_then(|c| c.expiry())
            && at <= now
        {
            return Ok(Cached {
                verdict: Verdict::Refused(expired(at, now)),
                ttl: NEGATIVE_TTL,
            });
        }
        // Waiting for a turn is not the API server failing: only the reviews are timed.
        let _turn = self
            .in_flight
            .acquire()
            .await
            .map_err(|_| ReviewError("shutting down".into()))?;
        let reviewed = within_timeout(
            "TokenReview",
            self.reviewer.review_token(token, &self.settings.audience),
        )
        .await
        .inspect_err(|_| {
            c.review_errors.fetch_add(1, Ordering::Relaxed);
        })?;
        let user = match reviewed {
            TokenReviewed::Authenticated(user) => {
                c.authenticated.fetch_add(1, Ordering::Relaxed);
                user
            }
            TokenReviewed::Unauthenticated(why) => {
                c.unauthenticated.fetch_add(1, Ordering::Relaxed);
                return Ok(refused(
                    Refusal::BadToken,
                    not_accepted(token, &self.settings.audience, &why),
                ));
            }
        };
        let expires = jwt_expiry(token);
        let trusted_for = ttl_until(expires, SystemTime::now());
        let credential = Credential::Token {
            user: crate::auth::bounded(&user.username, 256),
        };
        let class = classify(&user, self.settings.node_service_account.as_ref());
        let (identity, ttl) = match class {
            Class::Node(node) => (
                Identity {
                    names: vec![node],
                    groups: vec![self.groups.node.clone()],
                    expires,
                    credential,
                },
                trusted_for,
            ),
            Class::NoNodeClaim => {
                return Ok(refused(
                    Refusal::NoNodeClaim,
                    format!(
                        "a token of the node ServiceAccount {} must be bound to a pod on a node (its review carries no {NODE_NAME_CLAIM})",
                        self.settings
                            .node_service_account
                            .as_ref()
                            .map(ToString::to_string)
                            .unwrap_or_default()
                    ),
                ));
            }
            Class::Other => {
                let allowed =
                    within_timeout("SubjectAccessReview", self.reviewer.may_introspect(&user))
                        .await
                        .inspect_err(|_| {
                            c.access_errors.fetch_add(1, Ordering::Relaxed);
                        })?;
                if allowed {
                    c.access_allowed.fetch_add(1, Ordering::Relaxed);
                    let identity = Identity {
                        names: Vec::new(),
                        groups: vec![self.groups.operator.clone()],
                        expires,
                        credential,
                    };
                    (identity, trusted_for)
                } else {
                    c.access_denied.fetch_add(1, Ordering::Relaxed);
                    // No role: `auth::roles` refuses it, and a RoleBinding granted meanwhile
                    // takes effect within NEGATIVE_TTL.
                    let identity = Identity {
                        expires,
                        credential,
                        ..Default::default()
                    };
                    (identity, NEGATIVE_TTL.min(trusted_for))
                }
            }
        };
        Ok(Cached {
            verdict: Verdict::Accepted(identity),
            ttl,
        })
    }
}

fn refused(reason: Refusal, detail: String) -> Cached {
    Cached {
        verdict: Verdict::Refused(Rejected::new(reason, detail)),
        ttl: NEGATIVE_TTL,
    }
}

/// How long an accepted token may be trusted from `now`: until it expires, at most
/// [`POSITIVE_TTL`].
fn ttl_until(expires: Option<SystemTime>, now: SystemTime) -> Duration {
    expires.map_or(POSITIVE_TTL, |at| {
        at.duration_since(now)
            .unwrap_or(Duration::ZERO)
            .min(POSITIVE_TTL)
    })
}

/// `review`, failed after [`REVIEW_TIMEOUT`].
async fn within_timeout<T>(
    what: &str,
    review: impl Future<Output = Result<T, ReviewError>>,
) -> Result<T, ReviewError> {
    match tokio::time::timeout(REVIEW_TIMEOUT, review).await {
        Ok(r) => r.map_err(|e| ReviewError(format!("{what} failed: {e}"))),
        Err(_) => Err(ReviewError(format!(
            "{what} got no answer within {REVIEW_TIMEOUT:?}"
        ))),
    }
}
