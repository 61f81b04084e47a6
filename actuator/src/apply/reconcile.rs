//! The applier against the kernel's own account of its tables ("kernel is the truth",
//! docs/invariants.md): adoption at start-up, and the periodic check that repairs drift.
//!
//! The check is cheap first: the ruleset generation (NFT_MSG_GETGEN) is compared with the one
//! right after this applier's last commit. Equal means nobody committed anything since, and
//! nothing is read. Otherwise the owned tables are read back (nft/read.rs) and compared with
//! the model by digest; on a difference, a diff says what drifted, and one transaction
//! replaces the tables whole from the model, as the first snapshot of a process does. The
//! model and what the brain was told stay as they are: the kernel is brought back to them.
//!
//! Both run under the applier's lock, so never while an update is being applied.

use std::collections::BTreeSet;
use std::fmt;
use std::time::{Duration, Instant};

use splitproxy_proto::model::Model;
use splitproxy_proto::v1::Family;

use super::kernel::Kernel;
use super::{Applied, Applier, ApplyError, Outcome};
use crate::nft::{ReadError, comparable};
use crate::{conntrack, guards};

/// What differed between the model and the kernel's tables, counted by kind. "Missing" is in
/// the model but not in the kernel; "rogue" is in the kernel but not in the model (a changed
/// object counts as rogue: the kernel's version is not the model's).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Drift {
    /// Tables of the model the kernel does not hold, as `family name`.
    pub missing_tables: Vec<String>,
    /// Owned tables the kernel holds and the model does not.
    pub rogue_tables: Vec<String>,
    pub missing_chains: usize,
    pub rogue_chains: usize,
    pub missing_sets: usize,
    pub rogue_sets: usize,
    pub missing_elements: usize,
    pub rogue_elements: usize,
    /// The kernel holds something the reader cannot decode (a set or expression this actuator
    /// does not make): why.
    pub undecodable: Option<String>,
}

impl Drift {
    /// What `actual` (the kernel) lacks or adds compared with `expected` (the model).
    pub fn between(expected: &Model, actual: &Model) -> Drift {
        let mut d = Drift::default();
        let name = |f: Family, n: &str| format!("{} {n}", f.nft_name());
        let delta = expected.diff(actual);
        for rm in &delta.remove {
            if rm.whole {
                d.missing_tables.push(name(rm.family(), &rm.name));
                continue;
            }
            d.missing_chains += rm.chains.len();
            d.missing_elements += rm.elements.iter().map(|s| s.elements.len()).sum::<usize>();
        }
        for up in &delta.upsert {
            let key = (up.family(), up.name.clone());
            let Some(old) = expected.tables.get(&key) else {
                d.rogue_tables.push(name(up.family(), &up.name));
                continue;
            };
            let replaced: BTreeSet<&String> = delta
                .remove
                .iter()
                .filter(|r| (r.family, &r.name) == (up.family, &up.name))
                .flat_map(|r| r.sets.iter())
                .collect();
            d.rogue_chains += up.chains.len();
            for s in &up.sets {
                if replaced.contains(&s.name) || !old.sets.contains_key(&s.name) {
                    d.rogue_sets += 1;
                } else {
                    d.rogue_elements += s.elements.len();
                }
            }
        }
        for rm in delta.remove.iter().filter(|r| !r.whole) {
            let ups: BTreeSet<&String> = delta
                .upsert
                .iter()
                .filter(|u| (u.family, &u.name) == (rm.family, &rm.name))
                .flat_map(|u| u.sets.iter().map(|s| &s.name))
                .collect();
            d.missing_sets += rm.sets.iter().filter(|s| !ups.contains(s)).count();
        }
        d
    }

    /// The kinds of object that drifted, as the metric's `what` label names them.
    pub fn kinds(&self) -> Vec<&'static str> {
        let mut out = Vec::new();
        if !self.missing_tables.is_empty() || !self.rogue_tables.is_empty() {
            out.push("table");
        }
        if self.missing_chains + self.rogue_chains > 0 {
            out.push("chain");
        }
        if self.missing_sets + self.rogue_sets > 0 {
            out.push("set");
        }
        if self.missing_elements + self.rogue_elements > 0 {
            out.push("element");
        }
        if self.undecodable.is_some() {
            out.push("undecodable");
        }
        out
    }

    pub fn is_empty(&self) -> bool {
        self.kinds().is_empty()
    }
}

impl fmt::Display for Drift {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        if !self.missing_tables.is_empty() {
            parts.push(format!(
                "missing tables: {}",
                self.missing_tables.join(", ")
            ));
        }
        if !self.rogue_tables.is_empty() {
            parts.push(format!("rogue tables: {}", self.rogue_tables.join(", ")));
        }
        for (n, what) in [
            (self.missing_chains, "missing chains"),
            (self.rogue_chains, "rogue or changed chains"),
            (self.missing_sets, "missing sets"),
            (self.rogue_sets, "rogue or changed sets"),
            (self.missing_elements, "missing elements"),
            (self.rogue_elements, "rogue or changed elements"),
        ] {
            if n > 0 {
                parts.push(format!("{what}: {n}"));
            }
        }
        if let Some(why) = &self.undecodable {
            parts.push(format!("undecodable: {why}"));
        }
        if parts.is_empty() {
            parts.push("nothing".to_owned());
        }
        f.write_str(&parts.join("; "))
    }
}

/// What a reconciliation found.
#[derive(Debug, Clone, PartialEq)]
pub enum Reconciled {
    /// Nothing applied or adopted yet: there is no model to hold the kernel to.
    NoModel,
    /// The generation did not move since the last commit or check: nothing was read.
    Unchanged,
    /// The tables were read back and equal the model.
    Clean { read: Duration },
    /// The tables differed and were replaced from the model in one transaction.
    Repaired {
        drift: Drift,
        read: Duration,
        repair: Duration,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error("{0}")]
    Read(#[from] std::io::Error),
    /// The drift was found but the kernel refused the repair.
    #[error("repairing drift ({drift}): {source}")]
    Repair {
        drift: Box<Drift>,
        source: Box<ApplyError>,
    },
}

impl<K: Kernel> Applier<K> {
    /// Compares the kernel's tables with the model and repairs any difference in one
    /// transaction. Cheap when nobody committed since the last check.
    pub fn reconcile(&mut self) -> Result<Reconciled, ReconcileError> {
        if !self.adopted {
            return Ok(Reconciled::NoModel);
        }
        let forced = std::mem::take(&mut self.reconcile_due);
        let generation = self.kernel.generation()?;
        if !forced && self.kernel_generation == Some(generation) {
            return Ok(Reconciled::Unchanged);
        }
        let start = Instant::now();
        let expected = comparable(&self.model);
        let drift = match self.kernel.read_tables(&self.table) {
            Ok(read) if read.model.digest() == expected.digest() => {
                self.kernel_generation = Some(read.generation);
                self.replace_next = false;
                return Ok(Reconciled::Clean {
                    read: start.elapsed(),
                });
            }
            Ok(read) => Drift::between(&expected, &read.model),
            Err(ReadError::Decode(e)) => Drift {
                undecodable: Some(e.to_string()),
                ..Drift::default()
            },
            Err(ReadError::Io(e)) => return Err(e.into()),
        };
        let read = start.elapsed();
        let start = Instant::now();
        let mut batch = self
            .replacement(&self.model)
            .map_err(|source| ReconcileError::Repair {
                drift: Box::new(drift.clone()),
                source: Box::new(source),
            })?;
        if let Err(e) = self.kernel.commit(&mut batch) {
            self.refused(&e);
            return Err(ReconcileError::Repair {
                drift: Box::new(drift),
                source: Box::new(e.into()),
            });
        }
        self.kernel_generation = self.kernel.generation().ok();
        self.replace_next = false;
        Ok(Reconciled::Repaired {
            drift,
            read,
            repair: start.elapsed(),
        })
    }

    /// What follows a repair, for after_commit.rs: the conntrack resync (UDP flows that began
    /// while the tables were damaged were not DNATed, and would keep their entry to a Service
    /// address that no endpoint answers) and the health check servers, against the model.
    pub fn after_repair(&self) -> Outcome {
        Outcome {
            took: Duration::ZERO,
            took_on_cpu: None,
            changed: true,
            messages: 0,
            bytes: 0,
            conntrack: conntrack::Plan::resync(&self.model),
            guards: guards::Plan::between(&self.model, &self.model),
            model: self.model.clone(),
        }
    }

    /// Takes the owned tables the kernel holds as the applied model, before any brain answers
    /// (restart without disruption): health checks, readiness and the conntrack resync work at
    /// once, and `Hello` carries the digest of what the node holds (epoch and generation 0; no
    /// resource versions: the kernel does not say which API state its tables came from, so the
    /// brain resumes the node by content or with a snapshot, never with a restating delta).
    /// `None` when the kernel holds no owned table; an error when it holds one this actuator
    /// cannot read back, in which case nothing changes and the first snapshot replaces it.
    pub fn adopt(&mut self) -> Result<Option<Outcome>, ReadError> {
        let start = Instant::now();
        let read = self.kernel.read_tables(&self.table)?;
        if read.model.tables.is_empty() {
            return Ok(None);
        }
        let model = read.model;
        self.applied = Applied {
            brain_epoch: 0,
            generation: 0,
            digest: model.digest(),
            resource_versions: Vec::new(),
        };
        self.model = model;
        self.adopted = true;
        self.replace_next = false;
        self.kernel_generation = Some(read.generation);
        Ok(Some(Outcome {
            took: start.elapsed(),
            took_on_cpu: None,
            changed: false,
            messages: 0,
            bytes: 0,
            // Endpoints may have gone while no actuator ran.
            conntrack: conntrack::Plan::resync(&self.model),
            guards: guards::Plan::between(&self.model, &self.model),
            model: self.model.clone(),
        }))
    }
}
