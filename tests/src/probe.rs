//! One request from inside a namespace, classified the way a test wants to assert on it.
//!
//! A dataplane test asks "what happens to a TCP connection / UDP datagram from here to there":
//! a pod answers (which one, on which endpoint address, and which source did it see), the
//! connection is refused (a reject rule or a closed port), nothing comes back (a drop, or no
//! route further down the path), or the kernel reports the destination unreachable. [`probe`]
//! creates its socket inside the namespace, optionally bound to a source address, sends one
//! request to a [`PodServer`]-style server and returns a [`ProbeResult`] that can be compared,
//! printed and serialised to JSON. IPv4 and IPv6 destinations work alike.
//!
//! For UDP the socket is connected, so an ICMP port unreachable (what `reject` sends) shows up
//! as `ECONNREFUSED` and becomes [`ProbeResult::Refused`], as for TCP.
//!
//! [`http_get`] does the same for an HTTP GET (for example to a node's healthCheckNodePort) and
//! returns the status, headers and body.
//!
//! [`PodServer`]: crate::podserver::PodServer

use std::collections::BTreeMap;
use std::fmt;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::Instant;

use crate::netns::Netns;

/// Transport protocol of a probe.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Proto {
    #[default]
    #[serde(alias = "TCP")]
    Tcp,
    #[serde(alias = "UDP")]
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

impl std::str::FromStr for Proto {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "tcp" => Ok(Proto::Tcp),
            "udp" => Ok(Proto::Udp),
            other => Err(format!("unknown protocol {other:?} (tcp, udp)")),
        }
    }
}

/// The outcome of one probe.
///
/// Serialised flat, one object per probe: `{"result": "answered", "pod": "web-0", "endpoint":
/// "10.244.0.10:8080", "source": "10.244.1.5:40000", "client": "10.244.1.5:40000"}`,
/// `{"result": "refused"}`, `{"result": "dropped"}` (timed out), `{"result": "unreachable",
/// "detail": ".."}`, `{"result": "error", "detail": ".."}`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ProbeResult {
    /// A pod server answered.
    Answered {
        /// The name the server answered with (the pod name).
        pod: String,
        /// The local address and port the connection arrived on at the server: the endpoint
        /// chosen by DNAT.
        endpoint: SocketAddr,
        /// The peer address the server saw: the client's own address unless it was
        /// masqueraded (SNAT) on the way.
        source: SocketAddr,
        /// The probing socket's own address (compare with `source` to tell whether the source
        /// was preserved). The unspecified address when the kernel did not say.
        client: SocketAddr,
    },
    /// Connection refused: TCP reset or ICMP port unreachable.
    Refused,
    /// No answer within the timeout: the packet was dropped somewhere ("DROPPED").
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

    /// Whether the connection was refused.
    pub fn is_refused(&self) -> bool {
        matches!(self, ProbeResult::Refused)
    }

    /// Whether nothing came back in time.
    pub fn is_dropped(&self) -> bool {
        matches!(self, ProbeResult::TimedOut)
    }

    /// `"answered"`, `"refused"`, `"dropped"`, `"unreachable"` or `"error"`.
    pub fn kind(&self) -> &'static str {
        match self {
            ProbeResult::Answered { .. } => "answered",
            ProbeResult::Refused => "refused",
            ProbeResult::TimedOut => "dropped",
            ProbeResult::Unreachable(_) => "unreachable",
            ProbeResult::Error(_) => "error",
        }
    }

    /// The name of the pod that answered.
    pub fn pod(&self) -> Option<&str> {
        match self {
            ProbeResult::Answered { pod, .. } => Some(pod),
            _ => None,
        }
    }

    /// The endpoint address and port the answer came from (after DNAT).
    pub fn endpoint(&self) -> Option<SocketAddr> {
        match self {
            ProbeResult::Answered { endpoint, .. } => Some(*endpoint),
            _ => None,
        }
    }

    /// The source address the answering pod saw.
    pub fn source(&self) -> Option<SocketAddr> {
        match self {
            ProbeResult::Answered { source, .. } => Some(*source),
            _ => None,
        }
    }

    /// Same as [`ProbeResult::source`].
    pub fn seen_source(&self) -> Option<SocketAddr> {
        self.source()
    }

    /// The probing socket's own address, when a pod answered.
    pub fn client(&self) -> Option<SocketAddr> {
        match self {
            ProbeResult::Answered { client, .. } => Some(*client),
            _ => None,
        }
    }

    /// Whether the pod saw the probe's own source address and port (`Some(false)`: SNAT, such
    /// as a masquerade, changed one of them; a node masqueraded to its own address still shows
    /// as a changed port most of the time).
    pub fn source_preserved(&self) -> Option<bool> {
        match self {
            ProbeResult::Answered { source, client, .. } if !client.ip().is_unspecified() => {
                Some(source == client)
            }
            _ => None,
        }
    }

    /// The result as one line of JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|err| format!("{{\"error\":\"{err}\"}}"))
    }

    /// Parses a pod server's answer line, `"<name> <endpoint> <source>"`, received by a socket
    /// whose own address is `client`.
    pub fn from_answer(line: &str, client: SocketAddr) -> ProbeResult {
        let line = line.trim_end_matches(['\n', '\r']);
        let mut words = line.split(' ');
        let parsed = (|| {
            let pod = words.next().filter(|p| !p.is_empty())?;
            let endpoint = words.next()?.parse::<SocketAddr>().ok()?;
            let source = words.next()?.parse::<SocketAddr>().ok()?;
            words.next().is_none().then_some((pod, endpoint, source))
        })();
        let canon = |a: SocketAddr| SocketAddr::new(a.ip().to_canonical(), a.port());
        match parsed {
            Some((pod, endpoint, source)) => ProbeResult::Answered {
                pod: pod.to_string(),
                endpoint,
                source,
                client: canon(client),
            },
            None => ProbeResult::Error(format!("unexpected answer {line:?}")),
        }
    }
}

/// The flat JSON form of a [`ProbeResult`].
#[derive(Serialize, Deserialize)]
struct FlatResult {
    result: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pod: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    endpoint: Option<SocketAddr>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    source: Option<SocketAddr>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    client: Option<SocketAddr>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    detail: Option<String>,
}

impl Serialize for ProbeResult {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut flat = FlatResult {
            result: self.kind().to_string(),
            pod: None,
            endpoint: None,
            source: None,
            client: None,
            detail: None,
        };
        match self {
            ProbeResult::Answered {
                pod,
                endpoint,
                source,
                client,
            } => {
                flat.pod = Some(pod.clone());
                flat.endpoint = Some(*endpoint);
                flat.source = Some(*source);
                flat.client = Some(*client);
            }
            ProbeResult::Unreachable(d) | ProbeResult::Error(d) => flat.detail = Some(d.clone()),
            ProbeResult::Refused | ProbeResult::TimedOut => {}
        }
        flat.serialize(s)
    }
}

impl<'de> Deserialize<'de> for ProbeResult {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        let flat = FlatResult::deserialize(d)?;
        let detail = flat.detail.unwrap_or_default();
        Ok(match flat.result.as_str() {
            "answered" => ProbeResult::Answered {
                pod: flat.pod.ok_or_else(|| D::Error::missing_field("pod"))?,
                endpoint: flat
                    .endpoint
                    .ok_or_else(|| D::Error::missing_field("endpoint"))?,
                source: flat
                    .source
                    .ok_or_else(|| D::Error::missing_field("source"))?,
                client: flat
                    .client
                    .unwrap_or_else(|| SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0))),
            },
            "refused" => ProbeResult::Refused,
            "dropped" | "timed_out" => ProbeResult::TimedOut,
            "unreachable" => ProbeResult::Unreachable(detail),
            "error" => ProbeResult::Error(detail),
            other => return Err(D::Error::custom(format!("unknown result {other:?}"))),
        })
    }
}

impl fmt::Display for ProbeResult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProbeResult::Answered {
                pod,
                endpoint,
                source,
                ..
            } => {
                write!(f, "answered by {pod} at {endpoint} (saw source {source})")
            }
            ProbeResult::Refused => f.write_str("REFUSED"),
            ProbeResult::TimedOut => f.write_str("DROPPED (timed out)"),
            ProbeResult::Unreachable(why) => write!(f, "UNREACHABLE: {why}"),
            ProbeResult::Error(why) => write!(f, "ERROR: {why}"),
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

/// [`probe_repeat`] for async code.
pub async fn probe_repeat_async(
    ns: &Netns,
    proto: Proto,
    dst: SocketAddr,
    src: Option<IpAddr>,
    timeout: Duration,
    count: usize,
) -> Vec<ProbeResult> {
    probe_repeat_bound_async(ns, proto, dst, bind_addr(dst, src, 0), timeout, count).await
}

/// Like [`probe_repeat_async`], with the socket bound to `bind` (an address and a fixed source
/// port, either may be unspecified/0); for example to send several UDP probes from one
/// source port, as conntrack tests need.
pub async fn probe_repeat_bound_async(
    ns: &Netns,
    proto: Proto,
    dst: SocketAddr,
    bind: Option<SocketAddr>,
    timeout: Duration,
    count: usize,
) -> Vec<ProbeResult> {
    let run = ns
        .run_async(move || {
            (0..count)
                .map(|_| probe_here_bound(proto, dst, bind, timeout))
                .collect::<Vec<_>>()
        })
        .await;
    match run {
        Ok(results) => results,
        Err(err) => vec![ProbeResult::Error(format!("{err:#}")); count],
    }
}

/// One probe with the socket bound to `bind` (address and/or fixed port). Blocks.
pub fn probe_bound(
    ns: &Netns,
    proto: Proto,
    dst: SocketAddr,
    bind: SocketAddr,
    timeout: Duration,
) -> ProbeResult {
    match ns.run(move || probe_here_bound(proto, dst, Some(bind), timeout)) {
        Ok(result) => result,
        Err(err) => ProbeResult::Error(format!("{err:#}")),
    }
}

/// The address to bind for source address `src` and source port `port` (0: any), if any.
pub fn bind_addr(dst: SocketAddr, src: Option<IpAddr>, port: u16) -> Option<SocketAddr> {
    match (src, port) {
        (None, 0) => None,
        (ip, port) => Some(SocketAddr::new(
            ip.unwrap_or_else(|| unspecified_like(dst)),
            port,
        )),
    }
}

fn runtime() -> io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
}

/// Probes from the calling thread's own namespace. [`probe`] calls this on a thread inside
/// the target namespace.
pub fn probe_here(
    proto: Proto,
    dst: SocketAddr,
    src: Option<IpAddr>,
    timeout: Duration,
) -> ProbeResult {
    probe_here_bound(proto, dst, bind_addr(dst, src, 0), timeout)
}

/// [`probe_here`] with the socket bound to `bind`.
pub fn probe_here_bound(
    proto: Proto,
    dst: SocketAddr,
    bind: Option<SocketAddr>,
    timeout: Duration,
) -> ProbeResult {
    let runtime = match runtime() {
        Ok(runtime) => runtime,
        Err(err) => return ProbeResult::Error(format!("building probe runtime: {err}")),
    };
    runtime.block_on(async move {
        let deadline = Instant::now() + timeout;
        match proto {
            Proto::Tcp => probe_tcp(dst, bind, deadline).await,
            Proto::Udp => probe_udp(dst, bind, timeout, deadline).await,
        }
    })
}

fn unspecified_like(dst: SocketAddr) -> IpAddr {
    match dst {
        SocketAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        SocketAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    }
}

/// A TCP connection from `bind` (if given) to `dst`, classified on failure.
async fn connect_tcp(
    dst: SocketAddr,
    bind: Option<SocketAddr>,
    deadline: Instant,
) -> Result<tokio::net::TcpStream, ProbeResult> {
    let socket = match dst {
        SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4(),
        SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6(),
    };
    let socket = socket.map_err(|err| ProbeResult::Error(format!("creating socket: {err}")))?;
    if let Some(bind) = bind {
        if bind.port() != 0 {
            // The same source port again soon after a previous connection.
            socket
                .set_reuseaddr(true)
                .map_err(|err| ProbeResult::Error(format!("SO_REUSEADDR: {err}")))?;
        }
        socket
            .bind(bind)
            .map_err(|err| ProbeResult::Error(format!("binding {bind}: {err}")))?;
    }
    match tokio::time::timeout_at(deadline, socket.connect(dst)).await {
        Err(_) => Err(ProbeResult::TimedOut),
        Ok(Err(err)) => Err(classify(err)),
        Ok(Ok(stream)) => Ok(stream),
    }
}

async fn probe_tcp(dst: SocketAddr, bind: Option<SocketAddr>, deadline: Instant) -> ProbeResult {
    let mut stream = match connect_tcp(dst, bind, deadline).await {
        Ok(stream) => stream,
        Err(result) => return result,
    };
    let client = stream
        .local_addr()
        .unwrap_or_else(|_| SocketAddr::new(unspecified_like(dst), 0));
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
    ProbeResult::from_answer(text.lines().next().unwrap_or_default(), client)
}

async fn probe_udp(
    dst: SocketAddr,
    bind: Option<SocketAddr>,
    timeout: Duration,
    deadline: Instant,
) -> ProbeResult {
    let bind = bind.unwrap_or_else(|| SocketAddr::new(unspecified_like(dst), 0));
    let socket = match tokio::net::UdpSocket::bind(bind).await {
        Ok(socket) => socket,
        Err(err) => return ProbeResult::Error(format!("binding {bind}: {err}")),
    };
    if let Err(err) = socket.connect(dst).await {
        return classify(err);
    }
    let client = socket
        .local_addr()
        .unwrap_or_else(|_| SocketAddr::new(unspecified_like(dst), 0));
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
                return ProbeResult::from_answer(text.lines().next().unwrap_or_default(), client);
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

/// An HTTP response, as [`http_get`] read it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HttpResponse {
    /// Status code, e.g. 200 or 503.
    pub status: u16,
    /// Reason phrase, e.g. "OK".
    pub reason: String,
    /// Header fields in the order received, names as sent.
    pub headers: Vec<(String, String)>,
    /// The body (de-chunked), lossily decoded as UTF-8.
    pub body: String,
}

impl HttpResponse {
    /// The first value of header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The body parsed as JSON.
    pub fn json(&self) -> Option<serde_json::Value> {
        serde_json::from_str(&self.body).ok()
    }
}

/// The outcome of an HTTP GET from a namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HttpResult {
    /// The server answered (any status).
    Response(HttpResponse),
    /// Connection refused.
    Refused,
    /// No connection or no complete answer in time.
    TimedOut,
    /// The kernel reported the destination unreachable.
    Unreachable(String),
    /// Anything else (bad URL, malformed answer).
    Error(String),
}

impl HttpResult {
    /// The response, if the server answered.
    pub fn response(&self) -> Option<&HttpResponse> {
        match self {
            HttpResult::Response(r) => Some(r),
            _ => None,
        }
    }

    /// The status code, if the server answered.
    pub fn status(&self) -> Option<u16> {
        self.response().map(|r| r.status)
    }

    /// One JSON object: `{"result": "response", "status": 200, "reason": "OK", "headers":
    /// {"content-type": ".."}, "body": ".."}` (header names in lower case, repeated headers joined
    /// with ", "), or `{"result": "refused"}`, `{"result": "dropped"}`, ...
    pub fn to_json_value(&self) -> serde_json::Value {
        serde_json::to_value(self.flat()).unwrap_or_default()
    }

    /// The same as one line of text (fields in the order above).
    pub fn to_json(&self) -> String {
        serde_json::to_string(&self.flat()).unwrap_or_default()
    }

    /// The flat JSON form.
    pub fn flat(&self) -> HttpJson {
        let mut flat = HttpJson {
            result: String::new(),
            status: None,
            reason: None,
            headers: None,
            body: None,
            detail: None,
        };
        match self {
            HttpResult::Response(r) => {
                let mut headers: BTreeMap<String, String> = BTreeMap::new();
                for (k, v) in &r.headers {
                    headers
                        .entry(k.to_ascii_lowercase())
                        .and_modify(|old| {
                            old.push_str(", ");
                            old.push_str(v);
                        })
                        .or_insert_with(|| v.clone());
                }
                flat.result = "response".into();
                flat.status = Some(r.status);
                flat.reason = Some(r.reason.clone());
                flat.headers = Some(headers);
                flat.body = Some(r.body.clone());
            }
            HttpResult::Refused => flat.result = "refused".into(),
            HttpResult::TimedOut => flat.result = "dropped".into(),
            HttpResult::Unreachable(d) => {
                flat.result = "unreachable".into();
                flat.detail = Some(d.clone());
            }
            HttpResult::Error(d) => {
                flat.result = "error".into();
                flat.detail = Some(d.clone());
            }
        }
        flat
    }
}

/// The flat JSON form of an [`HttpResult`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HttpJson {
    /// `response`, `refused`, `dropped`, `unreachable` or `error`.
    pub result: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Header names in lower case.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub headers: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

impl fmt::Display for HttpResult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HttpResult::Response(r) => {
                writeln!(f, "HTTP {} {}", r.status, r.reason)?;
                for (k, v) in &r.headers {
                    writeln!(f, "{k}: {v}")?;
                }
                writeln!(f)?;
                f.write_str(&r.body)
            }
            HttpResult::Refused => f.write_str("REFUSED"),
            HttpResult::TimedOut => f.write_str("DROPPED (timed out)"),
            HttpResult::Unreachable(why) => write!(f, "UNREACHABLE: {why}"),
            HttpResult::Error(why) => write!(f, "ERROR: {why}"),
        }
    }
}

/// Splits `http://IP:PORT/path` (IPv6 in brackets; port 80 when absent) into the address, the
/// Host header value and the request target.
pub fn parse_http_url(url: &str) -> Result<(SocketAddr, String, String), String> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| format!("{url:?}: only http:// URLs with an IP address are supported"))?;
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let addr = authority
        .parse::<SocketAddr>()
        .or_else(|_| {
            let host = authority.trim_start_matches('[').trim_end_matches(']');
            host.parse::<IpAddr>().map(|ip| SocketAddr::new(ip, 80))
        })
        .map_err(|_| format!("{url:?}: the host must be an IP address (with an optional port)"))?;
    Ok((addr, authority.to_string(), path.to_string()))
}

/// GETs `url` (`http://IP:PORT/path`) from namespace `ns`, optionally from source address
/// `src`, waiting at most `timeout` for the whole answer. Blocks; see [`http_get_async`].
pub fn http_get(ns: &Netns, src: Option<IpAddr>, url: &str, timeout: Duration) -> HttpResult {
    let url = url.to_string();
    match ns.run(move || http_get_here(src, &url, timeout)) {
        Ok(result) => result,
        Err(err) => HttpResult::Error(format!("{err:#}")),
    }
}

/// [`http_get`] for async code.
pub async fn http_get_async(
    ns: &Netns,
    src: Option<IpAddr>,
    url: &str,
    timeout: Duration,
) -> HttpResult {
    let url = url.to_string();
    match ns
        .run_async(move || http_get_here(src, &url, timeout))
        .await
    {
        Ok(result) => result,
        Err(err) => HttpResult::Error(format!("{err:#}")),
    }
}

/// [`http_get`] from the calling thread's own namespace.
pub fn http_get_here(src: Option<IpAddr>, url: &str, timeout: Duration) -> HttpResult {
    let (dst, host, path) = match parse_http_url(url) {
        Ok(parts) => parts,
        Err(err) => return HttpResult::Error(err),
    };
    let runtime = match runtime() {
        Ok(runtime) => runtime,
        Err(err) => return HttpResult::Error(format!("building probe runtime: {err}")),
    };
    runtime.block_on(async move {
        let deadline = Instant::now() + timeout;
        let mut stream = match connect_tcp(dst, bind_addr(dst, src, 0), deadline).await {
            Ok(stream) => stream,
            Err(ProbeResult::Refused) => return HttpResult::Refused,
            Err(ProbeResult::TimedOut) => return HttpResult::TimedOut,
            Err(ProbeResult::Unreachable(d)) => return HttpResult::Unreachable(d),
            Err(other) => return HttpResult::Error(other.to_string()),
        };
        let request = format!(
            "GET {path} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: splitproxy-lab\r\nAccept: */*\r\nConnection: close\r\n\r\n"
        );
        if let Err(err) = stream.write_all(request.as_bytes()).await {
            return HttpResult::Error(format!("sending the request: {err}"));
        }
        let mut raw = Vec::new();
        match tokio::time::timeout_at(deadline, stream.read_to_end(&mut raw)).await {
            Err(_) if raw.is_empty() => return HttpResult::TimedOut,
            Err(_) => {}
            Ok(Err(err)) if raw.is_empty() => {
                return match classify(err) {
                    ProbeResult::Refused => HttpResult::Refused,
                    other => HttpResult::Error(other.to_string()),
                };
            }
            Ok(_) => {}
        }
        parse_http_response(&raw)
    })
}

/// Parses a complete HTTP/1.x response.
pub fn parse_http_response(raw: &[u8]) -> HttpResult {
    let Some(split) = raw.windows(4).position(|w| w == b"\r\n\r\n") else {
        return HttpResult::Error(format!(
            "incomplete HTTP answer: {:?}",
            String::from_utf8_lossy(raw)
        ));
    };
    let head = String::from_utf8_lossy(&raw[..split]);
    let body = raw.get(split + 4..).unwrap_or_default();
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let mut parts = status_line.splitn(3, ' ');
    let version = parts.next().unwrap_or_default();
    let Some(status) = parts.next().and_then(|s| s.parse::<u16>().ok()) else {
        return HttpResult::Error(format!("bad status line {status_line:?}"));
    };
    if !version.starts_with("HTTP/") {
        return HttpResult::Error(format!("bad status line {status_line:?}"));
    }
    let reason = parts.next().unwrap_or_default().to_string();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    let chunked = headers.iter().any(|(k, v)| {
        k.eq_ignore_ascii_case("transfer-encoding") && v.eq_ignore_ascii_case("chunked")
    });
    let body = if chunked {
        crate::deploy::dechunk(body)
    } else {
        body.to_vec()
    };
    HttpResult::Response(HttpResponse {
        status,
        reason,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn any() -> SocketAddr {
        "10.244.0.2:40000".parse().unwrap()
    }

    #[test]
    fn parses_answers() {
        assert_eq!(
            ProbeResult::from_answer("pod-a 10.244.1.5:8080 10.244.0.2:40000\n", any()),
            ProbeResult::Answered {
                pod: "pod-a".into(),
                endpoint: "10.244.1.5:8080".parse().unwrap(),
                source: "10.244.0.2:40000".parse().unwrap(),
                client: any(),
            }
        );
        let v6 = ProbeResult::from_answer("b [fd00:244::5]:80 [fd00::1]:5", any());
        assert_eq!(v6.source(), Some("[fd00::1]:5".parse().unwrap()));
        assert_eq!(v6.endpoint(), Some("[fd00:244::5]:80".parse().unwrap()));
        assert_eq!(v6.source_preserved(), Some(false));
        for bad in [
            "garbage",
            " 1.2.3.4:5 1.2.3.4:5",
            "a 1.2.3.4:5",
            "a 1.2.3.4:5 1.2.3.4:6 extra",
        ] {
            assert!(
                matches!(ProbeResult::from_answer(bad, any()), ProbeResult::Error(_)),
                "{bad}"
            );
        }
    }

    #[test]
    fn serialises_flat_json_and_back() {
        let answered = ProbeResult::Answered {
            pod: "a".into(),
            endpoint: "10.0.0.1:80".parse().unwrap(),
            source: "1.2.3.4:5".parse().unwrap(),
            client: "1.2.3.4:5".parse().unwrap(),
        };
        assert_eq!(
            answered.to_json(),
            r#"{"result":"answered","pod":"a","endpoint":"10.0.0.1:80","source":"1.2.3.4:5","client":"1.2.3.4:5"}"#
        );
        assert_eq!(answered.source_preserved(), Some(true));
        assert_eq!(ProbeResult::Refused.to_json(), r#"{"result":"refused"}"#);
        assert_eq!(ProbeResult::TimedOut.to_json(), r#"{"result":"dropped"}"#);
        assert_eq!(
            ProbeResult::Unreachable("x".into()).to_json(),
            r#"{"result":"unreachable","detail":"x"}"#
        );
        for r in [
            answered.clone(),
            ProbeResult::Refused,
            ProbeResult::TimedOut,
            ProbeResult::Error("e".into()),
        ] {
            let back: ProbeResult = serde_json::from_str(&r.to_json()).unwrap();
            assert_eq!(back, r);
        }
        assert_eq!(
            answered.to_string(),
            "answered by a at 10.0.0.1:80 (saw source 1.2.3.4:5)"
        );
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

    #[test]
    fn parses_http_urls_and_responses() {
        assert_eq!(
            parse_http_url("http://192.168.77.10:30100/healthz").unwrap(),
            (
                "192.168.77.10:30100".parse().unwrap(),
                "192.168.77.10:30100".into(),
                "/healthz".into()
            )
        );
        assert_eq!(
            parse_http_url("http://[fd00:77::10]:10256").unwrap().0,
            "[fd00:77::10]:10256".parse().unwrap()
        );
        assert_eq!(
            parse_http_url("http://10.0.0.1").unwrap().0,
            "10.0.0.1:80".parse().unwrap()
        );
        assert!(parse_http_url("https://10.0.0.1/").is_err());
        assert!(parse_http_url("http://example.com/").is_err());

        let r = parse_http_response(
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nX-Load-Balancing-Endpoint-Weight: 0\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n{\"a\"\r\n3\r\n:1}\r\n0\r\n\r\n",
        );
        let resp = r.response().unwrap();
        assert_eq!(resp.status, 503);
        assert_eq!(resp.reason, "Service Unavailable");
        assert_eq!(resp.header("content-type"), Some("application/json"));
        assert_eq!(resp.json().unwrap()["a"], 1);
        let v = r.to_json_value();
        assert_eq!(v["headers"]["x-load-balancing-endpoint-weight"], "0");
        assert!(matches!(
            parse_http_response(b"garbage"),
            HttpResult::Error(_)
        ));
    }
}
