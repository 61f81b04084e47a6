//! What the listener counts and how it logs refusals: the surface's metrics (refusals, failed
//! handshakes by reason, open connections, TLS reloads, full and resumed handshakes) and log
//! lines rate limited to one per interval, so that a flood of refused connections or calls cannot
//! flood the log.
use std::collections::BTreeMap;
use std::io;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::auth::Refusal;

use super::LOG_EVERY;

/// The brain's counters for its surface: refusals by reason, failed handshakes by reason, open
/// connections, TLS reloads. Rendered with the brain's other metrics.
#[derive(Debug, Default)]
pub struct SurfaceMetrics {
    refused: Mutex<BTreeMap<Refusal, u64>>,
    handshake_failures: Mutex<BTreeMap<&'static str, u64>>,
    closed: Mutex<BTreeMap<&'static str, u64>>,
    pub open_connections: AtomicU64,
    pub tls_reloads: AtomicU64,
    pub tls_reload_errors: AtomicU64,
    /// Handshakes completed with the client's chain verified, and by resuming a session.
    pub handshakes_full: AtomicU64,
    pub handshakes_resumed: AtomicU64,
}

impl SurfaceMetrics {
    pub fn refused(&self, reason: Refusal) {
        if let Ok(mut m) = self.refused.lock() {
            *m.entry(reason).or_default() += 1;
        }
    }

    pub fn refused_count(&self, reason: Refusal) -> u64 {
        self.refused
            .lock()
            .map(|m| m.get(&reason).copied().unwrap_or(0))
            .unwrap_or(0)
    }

    pub(super) fn handshake_failed(&self, reason: &'static str) {
        if let Ok(mut m) = self.handshake_failures.lock() {
            *m.entry(reason).or_default() += 1;
        }
    }

    pub(super) fn closed(&self, reason: &'static str) {
        if let Ok(mut m) = self.closed.lock() {
            *m.entry(reason).or_default() += 1;
        }
    }

    /// Adds the surface's metrics to a scrape (`crate::metrics::Exposition`).
    pub fn expose(&self, out: &mut crate::metrics::Exposition) {
        fn by_reason<K: Ord>(
            m: &Mutex<BTreeMap<K, u64>>,
            reasons: impl IntoIterator<Item = (K, &'static str)>,
        ) -> Vec<(crate::metrics::Labels, u64)> {
            let Ok(m) = m.lock() else { return Vec::new() };
            reasons
                .into_iter()
                .map(|(k, label)| {
                    let n = m.get(&k).copied().unwrap_or(0);
                    (vec![("reason", label)], n)
                })
                .collect()
        }
        out.counters(
            "splitproxy_brain_refused_total",
            "Connections and calls refused, by reason (see docs/protocol.md, \"Who may call what\").",
            by_reason(&self.refused, Refusal::ALL.map(|r| (r, r.as_str()))),
        );
        out.counters(
            "splitproxy_brain_tls_handshake_failures_total",
            "TLS handshakes that failed or timed out, by reason.",
            by_reason(&self.handshake_failures, HANDSHAKE_FAILURES.map(|r| (r, r))),
        );
        out.counters(
            "splitproxy_brain_connections_closed_total",
            "Established connections the brain closed: no request in time (idle), client certificate expired.",
            by_reason(
                &self.closed,
                ["idle", "certificate_expired"].map(|r| (r, r)),
            ),
        );
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        out.gauge(
            "splitproxy_brain_open_connections",
            "gRPC connections held, handshaking or established.",
            g(&self.open_connections) as i64,
        );
        out.counters(
            "splitproxy_brain_tls_handshakes_total",
            "TLS handshakes completed, by kind: full (the client's chain verified) or resumed (a session ticket any replica issued; docs/protocol.md, \"Session tickets\").",
            [
                (vec![("kind", "full")], g(&self.handshakes_full)),
                (vec![("kind", "resumed")], g(&self.handshakes_resumed)),
            ],
        );
        out.counters(
            "splitproxy_brain_tls_reloads_total",
            "Reloads of the server's TLS files after they changed, by result.",
            [
                (vec![("result", "ok")], g(&self.tls_reloads)),
                (vec![("result", "error")], g(&self.tls_reload_errors)),
            ],
        );
    }
}

/// The `reason` values of `splitproxy_brain_tls_handshake_failures_total`.
pub const HANDSHAKE_FAILURES: [&str; 8] = [
    "timeout",
    "no_client_certificate",
    "expired_certificate",
    "unknown_issuer",
    "bad_certificate",
    "alert_received",
    "protocol",
    "closed",
];

/// Why a handshake failed, as a metric label.
pub(super) fn handshake_failure(e: &io::Error) -> &'static str {
    use rustls::{CertificateError, Error};
    match e.get_ref().and_then(|i| i.downcast_ref::<Error>()) {
        Some(Error::NoCertificatesPresented) => "no_client_certificate",
        Some(Error::InvalidCertificate(
            CertificateError::Expired | CertificateError::ExpiredContext { .. },
        )) => "expired_certificate",
        Some(Error::InvalidCertificate(CertificateError::UnknownIssuer)) => "unknown_issuer",
        Some(Error::InvalidCertificate(_)) => "bad_certificate",
        Some(Error::AlertReceived(_)) => "alert_received",
        Some(_) => "protocol",
        None => match e.kind() {
            io::ErrorKind::InvalidData => "protocol",
            _ => "closed",
        },
    }
}

/// At most one log line per interval; counts the lines it held back.
#[derive(Debug)]
pub struct RateLimitedLog {
    every: Duration,
    state: Mutex<(Option<Instant>, u64)>,
}

impl RateLimitedLog {
    pub const fn new(every: Duration) -> Self {
        RateLimitedLog {
            every,
            state: Mutex::new((None, 0)),
        }
    }

    /// `Some(held back since the last line)` when a line may be written now.
    pub fn admit(&self) -> Option<u64> {
        self.admit_at(Instant::now())
    }

    fn admit_at(&self, now: Instant) -> Option<u64> {
        let mut s = self.state.lock().ok()?;
        match s.0 {
            Some(last) if now.duration_since(last) < self.every => {
                s.1 += 1;
                None
            }
            _ => {
                let held = s.1;
                *s = (Some(now), 0);
                Some(held)
            }
        }
    }
}

pub(super) static HANDSHAKE_LOG: RateLimitedLog = RateLimitedLog::new(LOG_EVERY);

pub(super) static LIMIT_LOG: RateLimitedLog = RateLimitedLog::new(LOG_EVERY);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_admits_one_line_per_interval_and_counts_the_rest() {
        let log = RateLimitedLog::new(Duration::from_secs(10));
        let t0 = Instant::now();
        assert_eq!(log.admit_at(t0), Some(0));
        for i in 1..=500 {
            assert_eq!(log.admit_at(t0 + Duration::from_millis(i)), None);
        }
        assert_eq!(log.admit_at(t0 + Duration::from_secs(10)), Some(500));
    }
}
