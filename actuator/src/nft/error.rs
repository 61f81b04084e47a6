//! Errors of encoding IR objects into nf_tables messages and of committing a batch.

use std::fmt;
use std::io;

use splitproxy_proto::v1::DataType;

/// The IR object cannot be expressed as an nf_tables message. Nothing was added to the batch.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    #[error("invalid {what} name {name:?}: {why}")]
    InvalidName {
        what: &'static str,
        name: String,
        why: &'static str,
    },
    #[error("{what} comment is longer than {max} bytes")]
    CommentTooLong { what: &'static str, max: usize },
    #[error("family must be ip, ip6 or inet, got {0}")]
    Family(i32),
    #[error("{field}: unknown or unspecified value {value}")]
    Enum { field: &'static str, value: i32 },
    #[error("{0} is missing")]
    Missing(&'static str),
    #[error("{field}: register {reg} out of range 0..16")]
    Register { field: &'static str, reg: u32 },
    #[error("{field}: {len} bytes, must be 1..={max}")]
    Length {
        field: &'static str,
        len: usize,
        max: usize,
    },
    #[error("{0}")]
    Invalid(String),
    #[error("set {set}: {why}")]
    Set { set: String, why: String },
    #[error("set {set}, element {index}: {why}")]
    Element {
        set: String,
        index: usize,
        why: String,
    },
    #[error("{what} does not fit in a netlink attribute (64 KiB)")]
    TooLarge { what: String },
}

/// What the kernel returned cannot be read back as IR: an attribute missing, of the wrong
/// size, or a value no IR object produces. The reader (read.rs) then treats the table as
/// drifted and replaces it; it never guesses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("decoding {what}: {why}")]
pub struct DecodeError {
    pub what: &'static str,
    pub why: String,
}

impl DecodeError {
    pub(crate) fn new(what: &'static str, why: impl Into<String>) -> Self {
        Self {
            what,
            why: why.into(),
        }
    }
}

impl EncodeError {
    pub(crate) fn set(set: &str, why: impl Into<String>) -> Self {
        Self::Set {
            set: set.to_owned(),
            why: why.into(),
        }
    }

    pub(crate) fn element(set: &str, index: usize, why: impl Into<String>) -> Self {
        Self::Element {
            set: set.to_owned(),
            index,
            why: why.into(),
        }
    }
}

/// One message of a batch the kernel refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MessageFailure {
    /// Positive errno, e.g. 2 (ENOENT).
    pub errno: i32,
    /// Index of the message in the batch; `None` when the kernel refused the transaction as a
    /// whole (an error on the batch header: permission, memory, or the commit step itself).
    pub message: Option<usize>,
    /// What the message did, e.g. "add elements to set service-ips (element 17 of this call)".
    pub description: String,
    /// The kernel's extended ack text, when it gave one.
    pub kernel_message: Option<String>,
}

impl fmt::Display for MessageFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {}",
            self.description,
            io::Error::from_raw_os_error(self.errno)
        )?;
        if let Some(m) = &self.kernel_message {
            write!(f, " ({m})")?;
        }
        Ok(())
    }
}

/// Why a batch did not commit.
#[derive(Debug, thiserror::Error)]
pub enum CommitError {
    /// An earlier `Batch` call could not encode its object; nothing was sent.
    #[error("batch not sent: {0}")]
    Encode(#[from] EncodeError),
    /// The batch never reached nf_tables; nothing was applied.
    #[error("sending a batch of {messages} messages ({bytes} bytes): {source}")]
    Send {
        messages: usize,
        bytes: usize,
        source: io::Error,
    },
    /// nf_tables refused the transaction and rolled it back: nothing was applied.
    /// `failures` lists every refused message, in batch order; the first is usually the cause.
    #[error("nf_tables rolled the transaction back: {}", summary(.failures))]
    Rejected { failures: Vec<MessageFailure> },
    /// Not every acknowledgement arrived, so the outcome is unknown: the caller must re-read
    /// or resynchronise the kernel state.
    #[error("outcome unknown: {received} of {expected} acknowledgements received: {source}")]
    AcksLost {
        expected: usize,
        received: usize,
        source: io::Error,
    },
}

fn summary(failures: &[MessageFailure]) -> String {
    match failures {
        [] => "no failure reported".to_owned(),
        [one] => one.to_string(),
        [first, rest @ ..] => format!("{first} (and {} more failed messages)", rest.len()),
    }
}

impl CommitError {
    /// The errno of the first kernel failure, if the kernel refused the batch.
    pub fn errno(&self) -> Option<i32> {
        match self {
            Self::Rejected { failures } => failures.first().map(|f| f.errno),
            Self::Send { source, .. } | Self::AcksLost { source, .. } => source.raw_os_error(),
            Self::Encode(_) => None,
        }
    }

    /// True when the kernel state is known to be unchanged by this commit.
    pub fn rolled_back(&self) -> bool {
        !matches!(self, Self::AcksLost { .. })
    }
}

/// Short name of a data type for error messages.
pub(crate) fn type_name(t: DataType) -> &'static str {
    match t {
        DataType::Unspecified => "unspecified",
        DataType::Verdict => "verdict",
        DataType::Integer => "integer",
        DataType::Ipv4Addr => "ipv4_addr",
        DataType::Ipv6Addr => "ipv6_addr",
        DataType::InetProto => "inet_proto",
        DataType::InetService => "inet_service",
        DataType::Mark => "mark",
    }
}
