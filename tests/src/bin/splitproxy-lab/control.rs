//! The lab's control socket: one JSON request per connection, one JSON answer. The supervisor
//! owns every namespace, process and pod; the other subcommands only ask it.
use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, SocketAddr};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};
use splitproxy_tests::probe::{HttpJson, ProbeResult, Proto};
use splitproxy_tests::scenario::ProbeReport;

use crate::cli::{HttpArgs, ProbeArgs, ReplayArgs};

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "snake_case")]
pub enum Request {
    Apply {
        path: PathBuf,
    },
    Probe {
        from: String,
        protocol: Proto,
        dst: SocketAddr,
        count: usize,
        #[serde(default)]
        source_port: u16,
        timeout_ms: u64,
    },
    Http {
        from: String,
        url: String,
        timeout_ms: u64,
    },
    /// Run a scenario directory's probes.yaml (or a probes file); `apply` applies the
    /// scenario's objects first.
    Replay {
        path: PathBuf,
        apply: bool,
        settle_ms: u64,
    },
    AddPod {
        node: String,
        name: String,
        ips: Vec<IpAddr>,
        tcp: Vec<u16>,
        udp: Vec<u16>,
    },
    AddExternal {
        name: String,
        ips: Vec<IpAddr>,
        via: Option<String>,
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
    let protocol = if p.udp { Proto::Udp } else { Proto::Tcp };
    let v = call(
        state_dir,
        &Request::Probe {
            from: p.from.clone(),
            protocol,
            dst: p.dst,
            count: p.count,
            source_port: p.source_port,
            timeout_ms: p.timeout_ms,
        },
    )?;
    for r in v["results"].as_array().into_iter().flatten() {
        if p.json {
            match serde_json::from_value::<ProbeResult>(r.clone()) {
                Ok(result) => println!("{}", result.to_json()),
                Err(_) => println!("{r}"),
            }
        } else {
            println!("{} -> {protocol} {}: {}", p.from, p.dst, describe(r));
        }
    }
    Ok(())
}

pub fn http(state_dir: &Path, h: HttpArgs) -> anyhow::Result<()> {
    let v = call(
        state_dir,
        &Request::Http {
            from: h.from.clone(),
            url: h.url.clone(),
            timeout_ms: h.timeout_ms,
        },
    )?;
    let r: HttpJson = serde_json::from_value(v["response"].clone()).context("bad answer")?;
    if h.json {
        println!("{}", serde_json::to_string(&r)?);
        return Ok(());
    }
    match r.result.as_str() {
        "response" => {
            println!(
                "HTTP {} {}",
                r.status.unwrap_or_default(),
                r.reason.unwrap_or_default()
            );
            for (k, val) in r.headers.unwrap_or_default() {
                println!("{k}: {val}");
            }
            println!();
            let body = r.body.unwrap_or_default();
            print!("{body}");
            if !body.ends_with('\n') {
                println!();
            }
        }
        "refused" => println!("REFUSED"),
        "dropped" => println!("DROPPED (timed out)"),
        other => println!("{}: {}", other.to_uppercase(), r.detail.unwrap_or_default()),
    }
    Ok(())
}

/// Prints replay reports; fails when any expectation failed.
pub fn print_reports(v: &serde_json::Value, json: bool) -> anyhow::Result<()> {
    let reports: Vec<ProbeReport> =
        serde_json::from_value(v["reports"].clone()).context("bad replay answer")?;
    for r in &reports {
        if json {
            println!("{}", serde_json::to_string(r)?);
        } else {
            print!("{}", r.to_text());
        }
    }
    let failed = reports.iter().filter(|r| r.pass == Some(false)).count();
    let checked = reports.iter().filter(|r| r.pass.is_some()).count();
    if !json {
        println!(
            "\n{} probes, {} with expectations: {} passed, {failed} failed",
            reports.len(),
            checked,
            checked - failed
        );
    }
    if failed > 0 {
        bail!("{failed} of {checked} probe expectations failed");
    }
    Ok(())
}

pub fn replay(state_dir: &Path, r: ReplayArgs) -> anyhow::Result<()> {
    let path = std::fs::canonicalize(&r.path).with_context(|| format!("{}", r.path.display()))?;
    let v = call(
        state_dir,
        &Request::Replay {
            path,
            apply: r.apply,
            settle_ms: r.settle_ms,
        },
    )?;
    print_reports(&v, r.json)
}

/// Text form of a probe result as the harness serialises it.
pub fn describe(r: &serde_json::Value) -> String {
    match serde_json::from_value::<ProbeResult>(r.clone()) {
        Ok(result) => result.to_string(),
        Err(_) => r.to_string(),
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
