//! The kernel as the applier sees it: something that takes a [`Batch`] as one transaction,
//! all of it or none of it ("atomic", docs/invariants.md), and that can say whether anything
//! was committed since (its generation) and what the owned tables hold (a read), for
//! reconciliation and adoption ("kernel is the truth").
//!
//! [`NftSocket`] is the real one. [`Recording`] is a fake for tests and benchmarks that need
//! no kernel and no root: it keeps every batch it accepts (how many messages, and what each
//! does, as the error reports describe it) and can be told to refuse the next one the way
//! nf_tables does, with an errno and an extended-ack text, so that the applier's failure path
//! runs without a kernel that misbehaves on cue.
use std::io;

use splitproxy_proto::model::Model;

use crate::nft::{Batch, CommitError, MessageFailure, NftSocket, ReadError, ReadTables};

/// Commits batches and reads the owned tables back. Implemented by [`NftSocket`] and by the
/// [`Recording`] fake.
pub trait Kernel {
    /// Commits `batch` as one transaction. On error nothing of it was applied, unless
    /// [`CommitError::rolled_back`] says the outcome is unknown. The batch is `mut` because
    /// the socket numbers its messages in place and sends them without a copy (nft/socket.rs).
    fn commit(&mut self, batch: &mut Batch) -> Result<(), CommitError>;

    /// The ruleset generation: it changes with every transaction anyone commits.
    fn generation(&mut self) -> io::Result<u32>;

    /// The tables `ip <table>` and `ip6 <table>` as the kernel holds them (nft/read.rs).
    fn read_tables(&mut self, table: &str) -> Result<ReadTables, ReadError>;
}

impl Kernel for NftSocket {
    fn commit(&mut self, batch: &mut Batch) -> Result<(), CommitError> {
        NftSocket::commit(self, batch)
    }

    fn generation(&mut self) -> io::Result<u32> {
        NftSocket::generation(self)
    }

    fn read_tables(&mut self, table: &str) -> Result<ReadTables, ReadError> {
        NftSocket::read_tables(self, table)
    }
}

/// One batch as [`Recording`] saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recorded {
    /// What each message does, in batch order, as [`CommitError::Rejected`] would name it
    /// (e.g. "delete elements from set service-ips (elements 0..=0 of the call)").
    pub messages: Vec<String>,
    /// Bytes of all messages.
    pub bytes: usize,
}

impl Recorded {
    fn of(batch: &Batch) -> Self {
        Recorded {
            messages: (0..batch.len()).map(|i| batch.describe(i, None)).collect(),
            bytes: batch.byte_len(),
        }
    }

    pub fn len(&self) -> usize {
        self.messages.len()
    }

    pub fn is_empty(&self) -> bool {
        self.messages.is_empty()
    }
}

/// How the next commit is to be refused.
#[derive(Debug, Clone)]
struct Refusal {
    /// Index of the refused message (clamped to the batch).
    message: usize,
    errno: i32,
    kernel_message: String,
}

/// A fake kernel that records what it is sent, in the spirit of google/nftables' recorder and
/// knftables' fake. It checks nothing about the messages themselves (the kernel tests under
/// nft/tests do): what it answers is what it was told to. Its generation moves with every
/// batch it takes and with [`Recording::tamper`]; a read returns the tables it was given
/// ([`Recording::hold`]), empty until then.
#[derive(Debug, Default)]
pub struct Recording {
    committed: Vec<Recorded>,
    refused: Vec<Recorded>,
    refuse: Option<Refusal>,
    generation: u32,
    holds: Model,
    reads: usize,
    undecodable: Option<String>,
    lose_acks: bool,
}

impl Recording {
    pub fn new() -> Self {
        Self::default()
    }

    /// Every batch taken, oldest first.
    pub fn committed(&self) -> &[Recorded] {
        &self.committed
    }

    /// Every batch refused, oldest first.
    pub fn refused(&self) -> &[Recorded] {
        &self.refused
    }

    /// The latest batch taken.
    pub fn last(&self) -> Option<&Recorded> {
        self.committed.last()
    }

    /// What a read returns from now on (the fake does not interpret batches).
    pub fn hold(&mut self, tables: Model) {
        self.holds = tables;
        self.undecodable = None;
    }

    /// Someone else commits: the tables become `tables` and the generation moves.
    pub fn tamper(&mut self, tables: Model) {
        self.hold(tables);
        self.generation = self.generation.wrapping_add(1);
    }

    /// Someone else commits something a read cannot decode.
    pub fn tamper_undecodable(&mut self, why: &str) {
        self.undecodable = Some(why.to_owned());
        self.generation = self.generation.wrapping_add(1);
    }

    /// The next batch is taken, but its acknowledgements are lost: the caller gets
    /// [`CommitError::AcksLost`] and cannot know the outcome.
    pub fn lose_acks_next(&mut self) {
        self.lose_acks = true;
    }

    /// How many reads were made.
    pub fn reads(&self) -> usize {
        self.reads
    }

    /// Refuses the next commit, blaming its first message, with `errno` (positive, e.g. 2 for
    /// ENOENT) and the kernel's extended-ack text `kernel_message`.
    pub fn refuse_next(&mut self, errno: i32, kernel_message: &str) {
        self.refuse_next_at(0, errno, kernel_message);
    }

    /// Like [`Recording::refuse_next`], blaming message `message` of the batch (the last one
    /// if the batch is shorter).
    pub fn refuse_next_at(&mut self, message: usize, errno: i32, kernel_message: &str) {
        self.refuse = Some(Refusal {
            message,
            errno,
            kernel_message: kernel_message.to_owned(),
        });
    }
}

impl Kernel for Recording {
    /// Answers like [`NftSocket::commit`]: a poisoned batch is refused before anything is
    /// sent, an empty one is taken without a trace, and a refusal has the shape nf_tables
    /// gives it.
    fn commit(&mut self, batch: &mut Batch) -> Result<(), CommitError> {
        if let Some(e) = batch.error() {
            return Err(CommitError::Encode(e.clone()));
        }
        if batch.is_empty() {
            return Ok(());
        }
        let Some(refusal) = self.refuse.take() else {
            self.committed.push(Recorded::of(batch));
            self.generation = self.generation.wrapping_add(1);
            if std::mem::take(&mut self.lose_acks) {
                return Err(CommitError::AcksLost {
                    expected: batch.len(),
                    received: 0,
                    source: io::Error::from(io::ErrorKind::TimedOut),
                });
            }
            return Ok(());
        };
        let index = refusal.message.min(batch.len() - 1);
        self.refused.push(Recorded::of(batch));
        Err(CommitError::Rejected {
            failures: vec![MessageFailure {
                errno: refusal.errno,
                message: Some(index),
                description: batch.describe(index, None),
                kernel_message: Some(refusal.kernel_message).filter(|m| !m.is_empty()),
            }],
        })
    }

    fn generation(&mut self) -> io::Result<u32> {
        Ok(self.generation)
    }

    fn read_tables(&mut self, _table: &str) -> Result<ReadTables, ReadError> {
        self.reads += 1;
        if let Some(why) = &self.undecodable {
            return Err(ReadError::Decode(crate::nft::DecodeError {
                what: "set",
                why: why.clone(),
            }));
        }
        Ok(ReadTables {
            model: self.holds.clone(),
            generation: self.generation,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use splitproxy_proto::v1::Family;

    fn two_messages() -> Batch {
        let mut b = Batch::new();
        b.add_table(Family::Ip, "t", "");
        b.del_set(Family::Ip, "t", "s");
        b
    }

    #[test]
    fn records_what_it_takes_and_refuses_on_cue() {
        let mut k = Recording::new();
        k.commit(&mut two_messages()).unwrap();
        k.commit(&mut Batch::new()).unwrap();
        assert_eq!(k.committed().len(), 1, "an empty batch leaves no trace");
        assert_eq!(
            k.last().unwrap().messages,
            vec!["add table ip t".to_owned(), "delete set s".to_owned()]
        );
        assert_eq!(k.last().unwrap().bytes, two_messages().byte_len());

        k.refuse_next_at(7, 16, "Device or resource busy");
        let err = k.commit(&mut two_messages()).unwrap_err();
        let CommitError::Rejected { failures } = &err else {
            panic!("{err:?}");
        };
        assert_eq!(
            failures,
            &vec![MessageFailure {
                errno: 16,
                message: Some(1),
                description: "delete set s".to_owned(),
                kernel_message: Some("Device or resource busy".to_owned()),
            }]
        );
        assert!(err.rolled_back());
        assert_eq!((k.committed().len(), k.refused().len()), (1, 1));
        // Only the next commit is refused.
        k.commit(&mut two_messages()).unwrap();
        assert_eq!(k.committed().len(), 2);
    }

    #[test]
    fn a_poisoned_batch_is_refused_before_sending() {
        let mut k = Recording::new();
        let mut b = two_messages();
        b.del_table(Family::Unspecified, "t");
        assert!(matches!(k.commit(&mut b), Err(CommitError::Encode(_))));
        assert!(k.committed().is_empty() && k.refused().is_empty());
    }
}
