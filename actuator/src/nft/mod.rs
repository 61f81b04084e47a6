//! nf_tables over netlink: lowers the ruleset IR one to one into nf_tables messages, batches
//! them into one transaction, and commits it atomically.
//!
//! Messages are encoded by hand into one buffer (see netlink/attr.rs): `netlink-packet-netfilter`
//! 0.4 knows tables, chains, rules and sets but only 6 of the 14 expressions splitproxy needs
//! (no ct, fib, numgen, nat, masq, reject, dynset, counter), and building an attribute tree per
//! set element would cost an allocation per element at 100,000 elements. The tests parse our
//! bytes back with that crate, as an independent decoder, and check the result in a real
//! kernel inside a private network namespace with `nft -j list ruleset`.
//!
//! Layout: one module per expression under `expr/`, one per object (`table`, `chain`, `rule`,
//! `set`, `element`), the key/data layout in `datum`, the transaction in `batch`, the socket
//! in `socket`; `read` reads the owned tables back into a model with the encoders' inverses.

mod batch;
mod chain;
mod check;
pub(crate) mod consts;
mod datum;
mod element;
mod error;
mod expr;
mod read;
mod rule;
mod set;
mod socket;
mod table;
mod udata;

#[cfg(test)]
pub(crate) mod tests;

pub use batch::Batch;
pub use element::RawElement;
pub use error::{CommitError, DecodeError, EncodeError, MessageFailure};
pub use read::{ReadError, ReadTables, comparable, packet_path_owned};
pub use set::DataMapLayout;
pub use socket::NftSocket;
