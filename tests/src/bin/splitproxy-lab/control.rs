//! The lab's control socket: one JSON request per connection, one JSON answer. The supervisor
//! owns every namespace, process and pod; the other subcommands only ask it.
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};

use crate::cli::ProbeArgs;

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "lowercase")]
pub enum Request {
    Apply {
        path: PathBuf,
    },
    Probe {
        from: String,
        udp: bool,
        dst: std::net::SocketAddr,
        count: usize,
        timeout_ms: u64,
    },
    AddPod {
        node: String,
        name: String,
        ip: std::net::Ipv4Addr,
        tcp: Vec<u16>,
        udp: Vec<u16>,
    },
    Status,
    Down,
}

pub fn socket_path(state_dir: &Path) -> PathBuf {
    state_dir.join("control.sock")
}

/// Sends one request to the running lab and returns its answer.
pub fn call(state_dir: &Path, req: &Request) -> anyhow::Result<serde_json::Value> {
    let path = socket_path(state_dir);
    let mut s = UnixStream::connect(&path).with_context(|| {
        format!(
            "no lab is running (cannot reach {}); start one with `up` or `demo`",
            path.display()
        )
    })?;
    serde_json::to_writer(&mut s, req)?;
    s.write_all(b"\n")?;
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line)?;
    let v: serde_json::Value = serde_json::from_str(&line).context("bad answer from the lab")?;
    if let Some(e) = v.get("error").and_then(|e| e.as_str()) {
        bail!("{e}");
    }
    Ok(v)
}

pub fn apply(state_dir: &Path, path: &Path) -> anyhow::Result<()> {
    let path = std::fs::canonicalize(path).with_context(|| format!("{}", path.display()))?;
    let v = call(state_dir, &Request::Apply { path })?;
    for o in v["applied"].as_array().into_iter().flatten() {
        println!("applied {}", o.as_str().unwrap_or_default());
    }
    Ok(())
}

pub fn probe(state_dir: &Path, p: ProbeArgs) -> anyhow::Result<()> {
    let v = call(
        state_dir,
        &Request::Probe {
            from: p.from.clone(),
            udp: p.udp,
            dst: p.dst,
            count: p.count,
            timeout_ms: p.timeout_ms,
        },
    )?;
    let proto = if p.udp { "udp" } else { "tcp" };
    for r in v["results"].as_array().into_iter().flatten() {
        if p.json {
            println!("{r}");
        } else {
            println!("{} -> {proto} {}: {}", p.from, p.dst, describe(r));
        }
    }
    Ok(())
}

/// Text form of a probe result as the harness serialises it.
pub fn describe(r: &serde_json::Value) -> String {
    match r["result"].as_str() {
        Some("answered") => format!(
            "answered by {} (it saw source {})",
            r["pod"].as_str().unwrap_or("?"),
            r["seen_source"].as_str().unwrap_or("?")
        ),
        Some("refused") => "REFUSED".into(),
        Some("timed_out") => "DROPPED (timed out)".into(),
        _ => r.to_string(),
    }
}

pub fn status(state_dir: &Path) -> anyhow::Result<()> {
    let v = call(state_dir, &Request::Status)?;
    println!("{}", serde_json::to_string_pretty(&v)?);
    Ok(())
}

pub fn down(state_dir: &Path) -> anyhow::Result<()> {
    call(state_dir, &Request::Down)?;
    // The supervisor removes the socket when it has cleaned up.
    for _ in 0..300 {
        if !socket_path(state_dir).exists() {
            println!("lab is down");
            return Ok(());
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    bail!("the lab did not finish tearing down in 30 s")
}
