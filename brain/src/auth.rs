//! Who may call what on the brain's gRPC surface.
//!
//! A caller is an [`Identity`]: the names and groups its credential vouches for. A client
//! certificate gives its common name and DNS SANs as names and its Organizations as groups, as
//! Kubernetes reads them; a ServiceAccount token is mapped to the same shape by
//! [`crate::tokens`] (the node ServiceAccount's token bound to a pod on node N: names = \[N\],
//! groups = [node group]; a token whose user may `get` `splitproxy.io/introspection`: groups =
//! [operator group]). [`roles`] is the one place that turns an identity into what it may do,
//! and the RPCs ask the resulting [`Roles`]:
//!
//! - the node group (`--node-group`, `splitproxy:nodes`) may open `Sync` only for a node its
//!   credential names, and read only that node's state ("node scoped", docs/invariants.md);
//! - the operator group (`--operator-group`, `splitproxy:operators`) may call the introspection
//!   RPCs, and may not open `Sync`;
//! - anything else is refused with PERMISSION_DENIED and counted
//!   (`splitproxy_brain_refused_total{reason}`).
use std::time::SystemTime;

/// `--node-group`'s default.
pub const DEFAULT_NODE_GROUP: &str = "splitproxy:nodes";
/// `--operator-group`'s default.
pub const DEFAULT_OPERATOR_GROUP: &str = "splitproxy:operators";

/// What a caller's credential vouches for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Identity {
    /// Node names the credential may speak for: a certificate's common names and DNS SANs, or
    /// a node token's node-name claim.
    pub names: Vec<String>,
    /// Groups: a certificate's Organizations, or the role group a token was mapped to.
    pub groups: Vec<String>,
    /// When the credential stops being valid (a certificate's notAfter, a token's `exp`);
    /// streams opened with it end then, so a revoked-by-expiry node cannot keep receiving
    /// state.
    pub expires: Option<SystemTime>,
    /// Which credential this identity comes from (for refusal messages and logs).
    pub credential: Credential,
}

/// The credential an [`Identity`] was read from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Credential {
    /// None reached the brain (no client certificate, no bearer token).
    #[default]
    None,
    /// A client certificate verified against `--client-ca`.
    Certificate,
    /// A ServiceAccount (or other Kubernetes) token that TokenReview accepted, for this user.
    Token { user: String },
}

impl std::fmt::Display for Credential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Credential::None => f.write_str("no credential"),
            Credential::Certificate => f.write_str("the client certificate"),
            Credential::Token { user } => {
                write!(f, "the token of user {:?}", bounded(user, 256))
            }
        }
    }
}

/// The groups that carry the two roles (the brain's `--node-group` and `--operator-group`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Groups {
    pub node: String,
    pub operator: String,
}

impl Default for Groups {
    fn default() -> Self {
        Groups {
            node: DEFAULT_NODE_GROUP.to_string(),
            operator: DEFAULT_OPERATOR_GROUP.to_string(),
        }
    }
}

/// What one identity may do. A credential in both groups has both roles.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Roles {
    /// The nodes it may speak for, when it has the node role (never empty then).
    pub nodes: Option<Vec<String>>,
    /// Whether it has the operator role.
    pub operator: bool,
}

/// The role decision: the one function that says what an identity may do.
pub fn roles(identity: &Identity, groups: &Groups) -> Roles {
    let member = |g: &str| !g.is_empty() && identity.groups.iter().any(|x| x == g);
    let nodes = (member(&groups.node) && !identity.names.is_empty()).then(|| {
        identity
            .names
            .iter()
            .map(|n| bounded(n, MAX_NODE_NAME))
            .collect()
    });
    Roles {
        nodes,
        operator: member(&groups.operator),
    }
}

/// Why a call was refused: the `reason` label of `splitproxy_brain_refused_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Refusal {
    /// Neither a client certificate nor a bearer token reached the RPC.
    NoIdentity,
    /// The bearer token is refused before any role: expired by its own `exp` (refused without
    /// a review), or TokenReview did not authenticate it (for another audience, bound to a pod
    /// or secret that is gone, not a token at all). The refusal's message tells these apart.
    BadToken,
    /// A token of the node ServiceAccount that carries no node-name claim (not bound to a pod
    /// scheduled on a node), so it names no node.
    NoNodeClaim,
    /// The token could not be reviewed: the API server did not answer TokenReview or
    /// SubjectAccessReview (UNAVAILABLE: the caller tries again, or another brain).
    TokenReviewUnavailable,
    /// The credential is in neither group.
    NoRole,
    /// `Sync` without the node role (an operator, for instance).
    NotANode,
    /// A node asked for another node's stream or state.
    OtherNode,
    /// An introspection RPC a node may not call.
    NotAnOperator,
    /// `Sync` whose first message was not a usable Hello.
    BadHello,
    /// `Sync` whose first message did not come in time.
    HelloTimeout,
    /// The peer opened more connections than `--max-connections-per-ip`.
    PeerConnectionLimit,
    /// The brain holds `--max-connections` already.
    ConnectionLimit,
}

impl Refusal {
    pub const ALL: [Refusal; 12] = [
        Refusal::NoIdentity,
        Refusal::BadToken,
        Refusal::NoNodeClaim,
        Refusal::TokenReviewUnavailable,
        Refusal::NoRole,
        Refusal::NotANode,
        Refusal::OtherNode,
        Refusal::NotAnOperator,
        Refusal::BadHello,
        Refusal::HelloTimeout,
        Refusal::PeerConnectionLimit,
        Refusal::ConnectionLimit,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::NoIdentity => "no_identity",
            Refusal::BadToken => "bad_token",
            Refusal::NoNodeClaim => "no_node_claim",
            Refusal::TokenReviewUnavailable => "token_review_unavailable",
            Refusal::NoRole => "no_role",
            Refusal::NotANode => "not_a_node",
            Refusal::OtherNode => "other_node",
            Refusal::NotAnOperator => "not_an_operator",
            Refusal::BadHello => "bad_hello",
            Refusal::HelloTimeout => "hello_timeout",
            Refusal::PeerConnectionLimit => "peer_connection_limit",
            Refusal::ConnectionLimit => "connection_limit",
        }
    }
}

impl Roles {
    /// Whether this identity may open `Sync` as `node`.
    pub fn may_sync(&self, node: &str) -> Result<(), Refusal> {
        match &self.nodes {
            None if self.operator => Err(Refusal::NotANode),
            None => Err(Refusal::NoRole),
            Some(names) if names.iter().any(|n| n == node) => Ok(()),
            Some(_) => Err(Refusal::OtherNode),
        }
    }

    /// Whether this identity may read `node`'s state (`GetNodeRuleset`).
    pub fn may_read(&self, node: &str) -> Result<(), Refusal> {
        if self.operator {
            return Ok(());
        }
        self.may_sync(node)
    }

    /// Which nodes `ListNodes` shows: all of them (`None`) for an operator, only its own for a
    /// node.
    pub fn listable(&self) -> Result<Option<&[String]>, Refusal> {
        match (&self.nodes, self.operator) {
            (_, true) => Ok(None),
            (Some(names), false) => Ok(Some(names)),
            (None, false) => Err(Refusal::NoRole),
        }
    }

    /// Whether the identity may use the server at all (reflection, health).
    pub fn any(&self) -> Result<(), Refusal> {
        if self.operator || self.nodes.is_some() {
            Ok(())
        } else {
            Err(Refusal::NoRole)
        }
    }
}

/// Longest node name a Hello or a request may carry: a Kubernetes object name (DNS subdomain).
pub const MAX_NODE_NAME: usize = 253;
/// Longest free-form text kept or logged from a peer (errors, refused messages, versions).
pub const MAX_PEER_TEXT: usize = 2048;

/// `s`, cut to at most `max` bytes on a character boundary, with a marker when cut. Everything
/// the brain keeps or logs from a peer goes through this, so a hostile or broken node cannot
/// grow the brain's memory, its logs or `ListNodes` answers.
pub fn bounded(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes cut)", &s[..end], s.len() - end)
}

/// Whether `name` is a plausible node name: a Kubernetes object name (lowercase letters, digits,
/// '-' and '.', at most 253 bytes). A Hello naming anything else is refused.
pub fn valid_node_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NODE_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(names: &[&str], groups: &[&str]) -> Identity {
        Identity {
            names: names.iter().map(|s| s.to_string()).collect(),
            groups: groups.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn nodes_sync_and_read_only_themselves() {
        let g = Groups::default();
        let r = roles(&id(&["node-1"], &[DEFAULT_NODE_GROUP]), &g);
        assert_eq!(r.may_sync("node-1"), Ok(()));
        assert_eq!(r.may_sync("node-2"), Err(Refusal::OtherNode));
        assert_eq!(r.may_read("node-1"), Ok(()));
        assert_eq!(r.may_read("node-2"), Err(Refusal::OtherNode));
        assert_eq!(r.listable(), Ok(Some(&["node-1".to_string()][..])));
        assert_eq!(r.any(), Ok(()));
    }

    #[test]
    fn operators_read_everything_and_never_sync() {
        let g = Groups::default();
        let r = roles(&id(&["operator"], &[DEFAULT_OPERATOR_GROUP]), &g);
        assert_eq!(r.may_sync("operator"), Err(Refusal::NotANode));
        assert_eq!(r.may_read("node-2"), Ok(()));
        assert_eq!(r.listable(), Ok(None));
    }

    #[test]
    fn anything_else_is_refused() {
        let g = Groups::default();
        for who in [
            id(&["node-1"], &[]),
            id(&["node-1"], &["system:masters"]),
            id(&[], &[DEFAULT_NODE_GROUP]),
        ] {
            let r = roles(&who, &g);
            assert_eq!(r.may_sync("node-1"), Err(Refusal::NoRole), "{who:?}");
            assert_eq!(r.may_read("node-1"), Err(Refusal::NoRole), "{who:?}");
            assert_eq!(r.listable(), Err(Refusal::NoRole), "{who:?}");
            assert_eq!(r.any(), Err(Refusal::NoRole), "{who:?}");
        }
        // Groups are configurable, and an empty group names nobody.
        let custom = Groups {
            node: "nodes".into(),
            operator: String::new(),
        };
        let r = roles(&id(&["n"], &[DEFAULT_NODE_GROUP, ""]), &custom);
        assert_eq!(r.any(), Err(Refusal::NoRole));
        assert_eq!(
            roles(&id(&["n"], &["nodes"]), &custom).may_sync("n"),
            Ok(())
        );
    }

    /// The labels of `splitproxy_brain_refused_total` are part of the metrics' interface:
    /// dashboards and alerts select on them.
    #[test]
    fn refusal_labels_are_pinned() {
        let labels: Vec<&str> = Refusal::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(
            labels,
            [
                "no_identity",
                "bad_token",
                "no_node_claim",
                "token_review_unavailable",
                "no_role",
                "not_a_node",
                "other_node",
                "not_an_operator",
                "bad_hello",
                "hello_timeout",
                "peer_connection_limit",
                "connection_limit",
            ]
        );
    }

    #[test]
    fn peer_text_is_bounded_on_a_character_boundary() {
        assert_eq!(bounded("short", 10), "short");
        let long = "é".repeat(10_000);
        let cut = bounded(&long, MAX_PEER_TEXT);
        assert!(cut.len() < MAX_PEER_TEXT + 40, "{}", cut.len());
        assert!(cut.ends_with("bytes cut)"), "{cut}");
    }

    #[test]
    fn node_names_are_kubernetes_names() {
        assert!(valid_node_name("node-1.example"));
        for bad in ["", "Node", "a b", "x\n", &"a".repeat(254)] {
            assert!(!valid_node_name(bad), "{bad:?}");
        }
    }
}
