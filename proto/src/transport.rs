//! The transport settings both ends of `splitproxy.v1.Dataplane` must agree on: message size
//! limits and HTTP/2 keepalives. Kept in one place because a limit raised on one side only
//! fails at run time, on the largest cluster first.
use std::time::Duration;

/// Largest message a node accepts from a brain. Updates are sent in parts of bounded size
/// (see [`crate::parts`]), so this only guards against a broken peer, not a large cluster.
pub const MAX_UPDATE_MESSAGE: usize = 1 << 30;
/// Largest message a brain encodes (the same bound, seen from the sender).
pub const MAX_ENCODED_MESSAGE: usize = MAX_UPDATE_MESSAGE;
/// Largest message a brain accepts from a node or an operator (Hello, Ack, requests).
pub const MAX_REQUEST_MESSAGE: usize = 64 << 20;
/// HTTP/2 PING interval on long-lived streams, both ways: a peer that vanished without a FIN
/// (a node powered off, a partition) is noticed within interval + timeout.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
/// How long a PING may go unanswered before the connection is closed.
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);
/// TCP and TLS connection set-up towards a brain.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
