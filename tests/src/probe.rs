//! One request from inside a namespace, classified the way a test wants to assert on it.
//!
//! A dataplane test asks "what happens to a TCP connection / UDP datagram from here to there":
//! a pod answers (which one, and which source did it see), the connection is refused (a reject
//! rule or a closed port), nothing comes back (a drop, or no route further down the path), or
//! the kernel reports the destination unreachable. [`probe`] creates its socket inside the
//! namespace, optionally bound to a source address, sends one request to a [`PodServer`]-style
//! server and returns a [`ProbeResult`] that can be compared, printed and serialised to JSON.
//!
//! For UDP the socket is connected, so an ICMP port unreachable (what `reject` sends) shows up
//! as `ECONNREFUSED` and becomes [`ProbeResult::Refused`], as for TCP.
//!
//! [`PodServer`]: crate::podserver::PodServer

use std::fmt;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use serde::Serialize;
use tokio::io::AsyncReadExt;
use tokio::time::Instant;

use crate::netns::Netns;

/// Transport protocol of a probe.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Proto {
    Tcp,
    Udp,
}

impl fmt::Display for Proto {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
        })
    }
}

/// The outcome of one probe.
///
/// Serialised as `{"result": "answered", "detail": {"pod": .., "seen_source": ..}}`,
/// `{"result": "refused"}`, `{"result": "unreachable", "detail": ".."}`, and so on.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(tag = "result", content = "detail", rename_all = "snake_case")]
pub enum ProbeResult {
    /// A pod server answered with its name and the source address it saw.
    Answered {
        pod: String,
        seen_source: SocketAddr,
    },
    /// Connection refused: TCP reset or ICMP port unreachable.
    Refused,
    /// No answer within the timeout.
    TimedOut,
    /// The kernel reported the destination unreachable (no route, ICMP host/net unreachable,
    /// administratively prohibited).
    Unreachable(String),
    /// Anything else (bind failure, reset after connect, an answer that is not a pod server's).
    Error(String),
}

impl ProbeResult {
    /// Whether a pod answered.
    pub fn is_answered(&self) -> bool {
        matches!(self, ProbeResult::Answered { .. })
    }

    /// The name of the pod that answered.
    pub fn pod(&self) -> Option<&str> {
        match self {
            ProbeResult::Answered { pod, .. } => Some(pod),
            _ => None,
        }
    }

    /// The source address the answering pod saw.
    pub fn seen_source(&self) -> Option<SocketAddr> {
        match self {
            ProbeResult::Answered { seen_source, .. } => Some(*seen_source),
            _ => None,
        }
    }

    /// The result as one line of JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|err| format!("{{\"error\":\"{err}\"}}"))
    }

    /// Parses a pod server's answer line, `"<name> <ip>:<port>"`.
    pub fn from_answer(line: &str) -> ProbeResult {
        let line = line.trim_end_matches(['\n', '\r']);
        let parsed = line
            .split_once(' ')
            .and_then(|(pod, addr)| Some((pod, addr.parse::<SocketAddr>().ok()?)))
            .filter(|(pod, _)| !pod.is_empty());
        match parsed {
            Some((pod, seen_source)) => ProbeResult::Answered {
                pod: pod.to_string(),
                seen_source,
            },
            None => ProbeResult::Error(format!("unexpected answer {line:?}")),
        }
    }
}

impl fmt::Display for ProbeResult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProbeResult::Answered { pod, seen_source } => {
                write!(f, "answered by {pod} (saw source {seen_source})")
            }
            ProbeResult::Refused => f.write_str("refused"),
            ProbeResult::TimedOut => f.write_str("timed out"),
            ProbeResult::Unreachable(why) => write!(f, "unreachable: {why}"),
            ProbeResult::Error(why) => write!(f, "error: {why}"),
        }
    }
}

/// Sends one `proto` request from namespace `ns` to `dst` (optionally from source address
/// `src`) and classifies the outcome, waiting at most `timeout`.
///
/// Blocks the calling thread; from async code use [`probe_async`].
pub fn probe(
    ns: &Netns,
    proto: Proto,
    dst: SocketAddr,
    src: Option<IpAddr>,
    timeout: Duration,
) -> ProbeResult {
    match ns.run(move || probe_here(proto, dst, src, timeout)) {
        Ok(result) => result,
        Err(err) => ProbeResult::Error(format!("{err:#}")),
    }
}

/// [`probe`] for async code: runs on a thread of its own and does not block the runtime.
pub async fn probe_async(
    ns: &Netns,
    proto: Proto,
    dst: SocketAddr,
    src: Option<IpAddr>,
    timeout: Duration,
) -> ProbeResult {
    match ns
        .run_async(move || probe_here(proto, dst, src, timeout))
        .await
    {
        Ok(result) => result,
        Err(err) => ProbeResult::Error(format!("{err:#}")),
    }
}

/// Sends `count` probes one after the other from `ns` (each with its own socket and source
/// port) and returns their results in order. Useful for load-balancing assertions.
pub fn probe_repeat(
    ns: &Netns,
    proto: Proto,
    dst: SocketAddr,
    src: Option<IpAddr>,
    timeout: Duration,
    count: usize,
) -> Vec<ProbeResult> {
    let run = ns.run(move || {
        (0..count)
            .map(|_| probe_here(proto, dst, src, timeout))
            .collect::<Vec<_>>()
    });
    match run {
        Ok(results) => results,
        Err(err) => vec![ProbeResult::Error(format!("{err:#}")); count],
    }
}

/// Probes from the calling thread's own namespace. [`probe`] calls this on a thread inside
/// the target namespace.
pub fn probe_here(
    proto: Proto,
    dst: SocketAddr,
    src: Option<IpAddr>,
    timeout: Duration,
) -> ProbeResult {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => return ProbeResult::Error(format!("building probe runtime: {err}")),
    };
    runtime.block_on(async move {
        let deadline = Instant::now() + timeout;
        match proto {
            Proto::Tcp => probe_tcp(dst, src, deadline).await,
            Proto::Udp => probe_udp(dst, src, timeout, deadline).await,
        }
    })
}

fn unspecified_like(dst: SocketAddr) -> IpAddr {
    match dst {
        SocketAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        SocketAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    }
}

async fn probe_tcp(dst: SocketAddr, src: Option<IpAddr>, deadline: Instant) -> ProbeResult {
    let socket = match dst {
        SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4(),
        SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6(),
    };
    let socket = match socket {
        Ok(socket) => socket,
        Err(err) => return ProbeResult::Error(format!("creating socket: {err}")),
    };
    if let Some(src) = src
        && let Err(err) = socket.bind(SocketAddr::new(src, 0))
    {
        return ProbeResult::Error(format!("binding {src}: {err}"));
    }
    let mut stream = match tokio::time::timeout_at(deadline, socket.connect(dst)).await {
        Err(_) => return ProbeResult::TimedOut,
        Ok(Err(err)) => return classify(err),
        Ok(Ok(stream)) => stream,
    };
    let mut answer = Vec::new();
    let mut buf = [0u8; 512];
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Err(_) => return ProbeResult::TimedOut,
            Ok(Err(err)) => return classify(err),
            Ok(Ok(0)) => break,
            Ok(Ok(n)) => {
                answer.extend_from_slice(&buf[..n]);
                if answer.contains(&b'\n') || answer.len() > 4096 {
                    break;
                }
            }
        }
    }
    if answer.is_empty() {
        return ProbeResult::Error("connection closed without an answer".into());
    }
    let text = String::from_utf8_lossy(&answer);
    ProbeResult::from_answer(text.lines().next().unwrap_or_default())
}

async fn probe_udp(
    dst: SocketAddr,
    src: Option<IpAddr>,
    timeout: Duration,
    deadline: Instant,
) -> ProbeResult {
    let bind = SocketAddr::new(src.unwrap_or_else(|| unspecified_like(dst)), 0);
    let socket = match tokio::net::UdpSocket::bind(bind).await {
        Ok(socket) => socket,
        Err(err) => return ProbeResult::Error(format!("binding {bind}: {err}")),
    };
    if let Err(err) = socket.connect(dst).await {
        return classify(err);
    }
    // Up to three datagrams spread over the timeout, in case one is lost.
    const SENDS: u32 = 3;
    let interval = timeout / SENDS;
    let mut buf = vec![0u8; 4096];
    for attempt in 1..=SENDS {
        if let Err(err) = socket.send(b"probe\n").await {
            return classify(err);
        }
        let wait_until = if attempt == SENDS {
            deadline
        } else {
            (Instant::now() + interval).min(deadline)
        };
        match tokio::time::timeout_at(wait_until, socket.recv(&mut buf)).await {
            Err(_) => continue,
            Ok(Err(err)) => return classify(err),
            Ok(Ok(n)) => {
                let text = String::from_utf8_lossy(&buf[..n]);
                return ProbeResult::from_answer(text.lines().next().unwrap_or_default());
            }
        }
    }
    ProbeResult::TimedOut
}

/// Maps a socket error to a result.
fn classify(err: io::Error) -> ProbeResult {
    match err.kind() {
        io::ErrorKind::ConnectionRefused => ProbeResult::Refused,
        io::ErrorKind::TimedOut => ProbeResult::TimedOut,
        io::ErrorKind::HostUnreachable | io::ErrorKind::NetworkUnreachable => {
            ProbeResult::Unreachable(err.to_string())
        }
        _ => ProbeResult::Error(err.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_answers() {
        assert_eq!(
            ProbeResult::from_answer("pod-a 10.244.0.2:40000\n"),
            ProbeResult::Answered {
                pod: "pod-a".into(),
                seen_source: "10.244.0.2:40000".parse().unwrap()
            }
        );
        assert_eq!(
            ProbeResult::from_answer("b [fd00::1]:5").seen_source(),
            Some("[fd00::1]:5".parse().unwrap())
        );
        assert!(matches!(
            ProbeResult::from_answer("garbage"),
            ProbeResult::Error(_)
        ));
        assert!(matches!(
            ProbeResult::from_answer(" 1.2.3.4:5"),
            ProbeResult::Error(_)
        ));
    }

    #[test]
    fn serialises_to_json() {
        let answered = ProbeResult::Answered {
            pod: "a".into(),
            seen_source: "1.2.3.4:5".parse().unwrap(),
        };
        assert_eq!(
            answered.to_json(),
            r#"{"result":"answered","detail":{"pod":"a","seen_source":"1.2.3.4:5"}}"#
        );
        assert_eq!(ProbeResult::Refused.to_json(), r#"{"result":"refused"}"#);
        assert_eq!(
            ProbeResult::Unreachable("x".into()).to_json(),
            r#"{"result":"unreachable","detail":"x"}"#
        );
        assert_eq!(answered.to_string(), "answered by a (saw source 1.2.3.4:5)");
    }

    #[test]
    fn classifies_errors() {
        assert_eq!(
            classify(io::Error::from(io::ErrorKind::ConnectionRefused)),
            ProbeResult::Refused
        );
        assert!(matches!(
            classify(io::Error::from_raw_os_error(113)),
            ProbeResult::Unreachable(_)
        ));
        assert!(matches!(
            classify(io::Error::from_raw_os_error(101)),
            ProbeResult::Unreachable(_)
        ));
    }
}
