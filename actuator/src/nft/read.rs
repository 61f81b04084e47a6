//! Reads the actuator's own tables back from the kernel into a [`Model`], with netlink dumps
//! decoded by the encoder's own inverses (table.rs, chain.rs, rule.rs, set.rs, element.rs,
//! expr/). When nothing drifted, the model read equals the model committed, digest included
//! ("kernel is the truth", docs/invariants.md): reconciliation compares the two, and an
//! actuator that starts without a brain adopts what it reads (restart without disruption).
//!
//! What the packet path changes is left out, on both sides of any comparison: the elements of
//! dynamic sets and of sets with timeouts (the affinity maps `dynset` fills; see
//! [`packet_path_owned`]). Counter values are not IR at all (the counter expression has no
//! fields), so they never differ.
//!
//! Several dumps are not one snapshot of the kernel: the read takes the ruleset generation
//! before and after, and reads again when a commit came in between.
//!
//! One dump is not always one snapshot either, with no commit at all. The kernel dumps a hash
//! set (nft_set_rhash) by walking its table and resumes each dump message by counting the
//! elements already sent. It grows that table in the background after a large insertion, and
//! a resize between two messages of a dump changes the walk's order: some elements come twice
//! and as many never come (a count-based resume over a reordered walk sends at least every
//! element's worth, so a missing element implies a repeated one). The generation does not
//! move and the dump is not marked interrupted, so the reader checks the one thing it can: an
//! element a set's dump repeats makes the read torn, and it reads again after a pause.

use std::io;
use std::time::Duration;

use prost::Message;
use splitproxy_proto::model::{Model, TableKey, element_key_bytes};
use splitproxy_proto::v1::{CtDirection, CtKey, Element, Family, Set, expr::Kind};

use super::consts::*;
use super::error::DecodeError;
use super::set::SetLayout;
use super::socket::NftSocket;
use super::{chain, element, rule, set, table};
use crate::netlink::attr::{Attrs, NlaBuf};

/// How often a read is retried when a commit lands while it runs, or a dump is torn.
const ATTEMPTS: usize = 4;

/// The pause before each further attempt, times the attempt (whether a commit landed or a dump
/// was torn): a background resize of a hash set with 100,000 elements takes milliseconds.
const TORN_PAUSE: Duration = Duration::from_millis(20);

/// Why the tables could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// Netlink itself failed (or the ruleset kept changing during the read).
    #[error("reading the tables: {0}")]
    Io(#[from] io::Error),
    /// The kernel holds something the actuator did not make (or cannot read back): the table
    /// is not one this actuator can take as its model.
    #[error("{0}")]
    Decode(#[from] DecodeError),
}

/// The owned tables as the kernel holds them, and the generation they were read at.
#[derive(Debug, Clone)]
pub struct ReadTables {
    pub model: Model,
    pub generation: u32,
}

/// Sets whose elements the packet path adds and expires (dynamic sets, sets with timeouts):
/// their elements are not compared, read or adopted.
pub fn packet_path_owned(set: &Set) -> bool {
    set.dynamic || set.timeout || set.default_timeout_ms > 0
}

/// `model` as a read of the kernel can reproduce it: without the elements of the sets the
/// packet path owns, and with `ct protocol` read as `ct original protocol` (the kernel keeps no
/// direction for it; expr/ct.rs). Cheap when those sets are empty, as the brain sends them,
/// and the brain always names the direction.
pub fn comparable(model: &Model) -> Model {
    let mut out = model.clone();
    for (key, tm) in model.tables.iter() {
        for chain in tm.chains.values() {
            let mut c = (**chain).clone();
            let mut changed = false;
            for x in c.rules.iter_mut().flat_map(|r| r.exprs.iter_mut()) {
                if let Some(Kind::Ct(ct)) = &mut x.kind
                    && ct.key == CtKey::Protocol as i32
                    && ct.direction == CtDirection::Unspecified as i32
                {
                    ct.direction = CtDirection::Original as i32;
                    changed = true;
                }
            }
            if changed {
                out.upsert_chain(key, c);
            }
        }
        for (name, sm) in tm.sets.iter() {
            if packet_path_owned(&sm.def) && !sm.is_empty() {
                for k in sm.elements.keys() {
                    out.remove_element(key, name, k);
                }
            }
        }
    }
    out
}

impl NftSocket {
    /// Reads `ip <table>` and `ip6 <table>` (whichever exist) into a model. A table that is
    /// absent is absent from the model; an object the actuator cannot read back is an error.
    pub fn read_tables(&mut self, table: &str) -> Result<ReadTables, ReadError> {
        let mut last = None;
        for attempt in 0..ATTEMPTS {
            if last.is_some() {
                std::thread::sleep(TORN_PAUSE * attempt as u32);
            }
            let before = self.generation()?;
            let read = self.read_once(table);
            let generation = self.generation()?;
            if generation != before {
                // A commit landed meanwhile: whatever was read (or failed to decode, such as a
                // rule of a chain created between two dumps) may mix two states.
                tracing::debug!(attempt, "a commit landed during the read: reading again");
                last = Some(io::Error::other(
                    "the ruleset kept changing while it was read",
                ));
                continue;
            }
            match read {
                Ok(model) => return Ok(ReadTables { model, generation }),
                Err(ReadError::Io(e)) if e.kind() == io::ErrorKind::Interrupted => {
                    tracing::debug!(attempt, error = %e, "reading the tables again");
                    last = Some(e)
                }
                Err(e) => return Err(e),
            }
        }
        Err(ReadError::Io(last.unwrap_or_else(|| {
            io::Error::other("the ruleset kept changing while it was read")
        })))
    }

    fn read_once(&mut self, table: &str) -> Result<Model, ReadError> {
        let mut model = Model::default();
        for family in [Family::Ip, Family::Ip6] {
            self.read_table(family, table, &mut model)?;
        }
        Ok(model)
    }

    fn read_table(
        &mut self,
        family: Family,
        name: &str,
        model: &mut Model,
    ) -> Result<(), ReadError> {
        let nfproto = match family {
            Family::Ip => NFPROTO_IPV4,
            _ => NFPROTO_IPV6,
        };
        let key: TableKey = (family, name.to_owned());
        let mut failed: Option<DecodeError> = None;
        let mut keep = |r: Result<(), DecodeError>| {
            if let Err(e) = r
                && failed.is_none()
            {
                failed = Some(e);
            }
        };

        // The table.
        let mut comment = None;
        self.dump(NFT_MSG_GETTABLE, nfproto, &NlaBuf::new(), |attrs| {
            match table::decode(&Attrs::new(attrs)) {
                Ok((n, c)) if n == name => comment = Some(c),
                Ok(_) => {}
                Err(e) => keep(Err(e)),
            }
            Ok(())
        })?;
        let Some(comment) = comment else {
            return Ok(()); // absent
        };
        model.upsert_table(&key, &comment);

        // Chains, then their rules (the rules of a chain come in order).
        let mut chains = Vec::new();
        let mut filter = NlaBuf::new();
        filter.put_strz(NFTA_CHAIN_TABLE, name);
        self.dump(NFT_MSG_GETCHAIN, nfproto, &filter, |attrs| {
            match chain::decode(&Attrs::new(attrs)) {
                Ok((t, c)) if t == name => chains.push(c),
                Ok(_) => {}
                Err(e) => keep(Err(e)),
            }
            Ok(())
        })?;
        let mut filter = NlaBuf::new();
        filter.put_strz(NFTA_RULE_TABLE, name);
        self.dump(NFT_MSG_GETRULE, nfproto, &filter, |attrs| {
            match rule::decode(&Attrs::new(attrs)) {
                Ok((t, c, r)) if t == name => match chains.iter_mut().find(|x| x.name == c) {
                    Some(chain) => chain.rules.push(r),
                    None => keep(Err(DecodeError::new(
                        "rule",
                        format!("a rule of chain {c}, which the chain dump did not list"),
                    ))),
                },
                Ok(_) => {}
                Err(e) => keep(Err(e)),
            }
            Ok(())
        })?;
        for c in chains {
            model.upsert_chain(&key, c);
        }

        // Sets, then the elements of each set the packet path does not own.
        let mut sets = Vec::new();
        let mut filter = NlaBuf::new();
        filter.put_strz(NFTA_SET_TABLE, name);
        self.dump(NFT_MSG_GETSET, nfproto, &filter, |attrs| {
            match set::decode(&Attrs::new(attrs)) {
                Ok((t, s)) if t == name => sets.push(s),
                Ok(_) => {}
                Err(e) => keep(Err(e)),
            }
            Ok(())
        })?;
        if let Some(e) = failed.take() {
            return Err(e.into());
        }
        for s in &sets {
            model.upsert_set(&key, s);
            if packet_path_owned(s) {
                continue;
            }
            let layout = SetLayout::new(s)
                .map_err(|e| DecodeError::new("set", format!("{}: {e}", s.name)))?;
            let mut filter = NlaBuf::new();
            filter.put_strz(NFTA_SET_ELEM_LIST_TABLE, name);
            filter.put_strz(NFTA_SET_ELEM_LIST_SET, &s.name);
            let mut entries = Vec::new();
            let mut failed: Option<DecodeError> = None;
            self.dump(NFT_MSG_GETSETELEM, nfproto, &filter, |attrs| {
                if let Some(list) = Attrs::new(attrs).find(NFTA_SET_ELEM_LIST_ELEMENTS)
                    && let Err(e) = element::decode_entries(&layout, &list, &mut entries)
                    && failed.is_none()
                {
                    failed = Some(e);
                }
                Ok(())
            })?;
            if let Some(e) = failed {
                return Err(e.into());
            }
            let mut elements = Vec::with_capacity(entries.len());
            element::decode(&layout, entries, &mut elements)?;
            insert_elements(model, &key, &s.name, elements)?;
        }
        Ok(())
    }
}

/// Puts one set's dumped elements into `model` (where the set is still empty), and refuses a
/// dump that sent an element twice: the walk was torn by a resize (see the module's doc),
/// and other elements are missing. `Interrupted`, so that [`NftSocket::read_tables`] reads
/// again.
pub(super) fn insert_elements(
    model: &mut Model,
    key: &TableKey,
    set: &str,
    elements: Vec<Element>,
) -> io::Result<()> {
    let sent = elements.len();
    for e in elements {
        model.insert_element(
            key,
            set,
            element_key_bytes(&e),
            e.encode_to_vec().into_boxed_slice(),
        );
    }
    let held = model
        .tables
        .get(key)
        .and_then(|t| t.sets.get(set))
        .map_or(0, |s| s.elements.len());
    if held == sent {
        return Ok(());
    }
    Err(io::Error::new(
        io::ErrorKind::Interrupted,
        format!(
            "the dump of set {set} sent {} elements more than once: the kernel resized it \
             during the dump",
            sent - held
        ),
    ))
}
