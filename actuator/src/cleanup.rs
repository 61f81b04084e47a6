//! `splitproxy-actuator --cleanup`: removes what an actuator leaves on its node.
//!
//! An actuator that stops never touches its tables: it cannot tell a restart or an upgrade
//! from an uninstall, and a node whose Service rules vanish on every restart would drop
//! traffic ("fail static", docs/invariants.md). So after `helm uninstall` the last ruleset
//! stays until someone deletes it; this is that someone, as kube-proxy's `--cleanup` is for
//! kube-proxy. It deletes exactly the `ip` and `ip6` tables of the given name, in one
//! transaction, and nothing else on the node.
use splitproxy_proto::v1::Family;

use crate::nft::{Batch, NftSocket};

/// Deletes `ip TABLE` and `ip6 TABLE` if they exist (NFT_MSG_DESTROYTABLE, Linux 6.3 or later:
/// no error for a table that is absent, so running it twice, or on a node that never ran an
/// actuator, is fine).
pub fn delete_tables(table: &str) -> anyhow::Result<()> {
    let mut socket = NftSocket::open()?;
    let mut batch = Batch::new();
    for family in [Family::Ip, Family::Ip6] {
        batch.destroy_table(family, table);
    }
    socket
        .commit(&mut batch)
        .map_err(|e| anyhow::anyhow!("deleting the tables ip {table} and ip6 {table}: {e}"))?;
    Ok(())
}
