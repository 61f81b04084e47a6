//! Stale UDP conntrack entries, deleted after each commit the way kube-proxy does.
//!
//! Why: UDP has no connection teardown. A client that keeps sending to a Service reuses its
//! conntrack entry, and with it the DNAT decision taken for the first packet, for as long as it
//! keeps sending: to an endpoint that is gone, or, when the Service had no endpoints, past the
//! DNAT (to a refusal) even after endpoints appear. TCP recovers by itself (resets, timeouts);
//! UDP needs the entry deleted.
//!
//! The actuator knows no Services. The brain marks sets with a [`ConntrackRole`], and what
//! changed in them between the model before a commit and the model after says what to delete:
//! - `ENDPOINTS`, a map `addr . inet_proto . inet_service . slot : addr . inet_service`: a UDP
//!   element removed, or whose endpoint changed, makes the entries from that destination to the
//!   old endpoint stale, unless the same endpoint still serves the destination under another
//!   slot;
//! - `NO_ENDPOINTS`, a set `addr . inet_proto . inet_service`: a UDP element removed (the
//!   destination got endpoints) makes the entries to that destination that were not DNATed
//!   stale.
//!
//! An address of all zeros stands for any local address (node ports): only the port is
//! matched.
//!
//! The first commit of a process has no previous model to compare with: the kernel kept the
//! rules and conntrack its entries while no actuator ran, and endpoints may have gone meanwhile.
//! That commit adds a [`Resync`]: every UDP entry to a destination the new model lists whose
//! reply comes from none of its endpoints now is stale, as kube-proxy's full resync finds. Finding what changed walks only the changed parts of those sets (the models share
//! structure), so a commit that touches none costs nothing and sends nothing to the kernel.
//! Otherwise one dump of the family's UDP entries, then a delete per stale entry.

#[cfg(test)]
mod kernel_tests;
mod netlink;
#[cfg(test)]
pub(crate) mod tests;

use std::collections::{BTreeSet, HashMap};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use imbl::ordmap::DiffItem;
use prost::Message;
use splitproxy_proto::family::IpFamily;
use splitproxy_proto::model::{Model, SetModel, TableKey};
use splitproxy_proto::v1::{ConntrackRole, Datum, Element, datum::Value};

use crate::metrics::Metrics;
pub use netlink::{CtSocket, Deleted, Entry, Tuple};

const UDP: u32 = 17;

/// What, besides its destination, makes an entry stale.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Via {
    /// It was DNATed to this endpoint (the reply comes from it).
    Endpoint(SocketAddr),
    /// It was not DNATed (the reply comes from the original destination).
    NotNat,
}

/// A kind of UDP entry to delete.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Stale {
    /// The original destination; an unspecified address matches any (node ports).
    pub dst: SocketAddr,
    pub via: Via,
}

impl Stale {
    pub fn matches(&self, e: &Entry) -> bool {
        let (o, r) = (&e.orig, &e.reply);
        let dst_ok = if self.dst.ip().is_unspecified() {
            self.dst.is_ipv4() == o.dst.is_ipv4()
        } else {
            o.dst == self.dst.ip()
        };
        let via_ok = match self.via {
            Via::Endpoint(ep) => r.src == ep.ip() && r.sport == ep.port(),
            Via::NotNat => r.src == o.dst && r.sport == o.dport,
        };
        o.proto == netlink::IPPROTO_UDP && o.dport == self.dst.port() && dst_ok && via_ok
    }
}

/// The stale entries one commit leaves.
#[derive(Debug, Clone, Default)]
pub struct Plan {
    stale: BTreeSet<Stale>,
    /// After a process's first commit: the model a [`Resync`] judges by, built when cleaning
    /// (after the ack), not on the apply path.
    resync: Option<Model>,
}

impl FromIterator<Stale> for Plan {
    fn from_iter<I: IntoIterator<Item = Stale>>(iter: I) -> Self {
        Plan {
            stale: iter.into_iter().collect(),
            resync: None,
        }
    }
}

impl Plan {
    pub fn is_empty(&self) -> bool {
        self.stale.is_empty() && self.resync.is_none()
    }

    /// Stale kinds named one by one (a resync counts as none).
    pub fn len(&self) -> usize {
        self.stale.len()
    }

    pub fn iter(&self) -> impl Iterator<Item = &Stale> {
        self.stale.iter()
    }

    /// Adds the plan of a commit of `new` (when one was not cleaned yet). A pending resync
    /// judges by the newest model: an endpoint added since is not stale.
    pub fn extend(&mut self, other: Plan, new: &Model) {
        self.stale.extend(other.stale);
        if other.resync.is_some() || self.resync.is_some() {
            self.resync = Some(new.clone());
        }
    }

    /// The first commit of a process, of `new`: see [`Resync`].
    pub fn resync(new: &Model) -> Plan {
        Plan {
            stale: BTreeSet::new(),
            resync: Some(new.clone()),
        }
    }

    pub fn resyncs(&self) -> bool {
        self.resync.is_some()
    }

    /// What committing `new` over `old` leaves stale.
    pub fn between(old: &Model, new: &Model) -> Plan {
        let mut plan = Plan::default();
        for (tkey, table) in old.tables.iter() {
            for (name, set) in table.sets.iter() {
                let role = ConntrackRole::try_from(set.def.conntrack).unwrap_or_default();
                if role == ConntrackRole::None {
                    continue;
                }
                let after = new.set(tkey, name);
                if after.is_some_and(|a| a.elements.ptr_eq(&set.elements)) {
                    continue;
                }
                let empty = Default::default();
                let after_elements = after.map(|a| &a.elements).unwrap_or(&empty);
                for item in set.elements.diff(after_elements) {
                    // Removed, or still there with other data (an endpoint replaced in place).
                    let (gone, removed) = match item {
                        DiffItem::Remove(_, v) => (v, true),
                        DiffItem::Update { old: (_, v), .. } => (v, false),
                        DiffItem::Add(..) => continue,
                    };
                    if let Ok(e) = Element::decode(&gone[..])
                        && let Some(stale) = stale_of(role, &e, removed, new, tkey)
                    {
                        plan.stale.insert(stale);
                    }
                }
            }
        }
        plan
    }

    /// The IP families with something to clean: AF_INET, AF_INET6 (both for a resync).
    fn families(&self) -> BTreeSet<u8> {
        if self.resync.is_some() {
            return [netlink::AF_INET, netlink::AF_INET6].into();
        }
        self.stale
            .iter()
            .map(|s| {
                if s.dst.is_ipv4() {
                    netlink::AF_INET
                } else {
                    netlink::AF_INET6
                }
            })
            .collect()
    }

    /// The entries of `entries` that are stale; `resync` is [`Resync::of`] the plan's resync
    /// model, if it has one.
    pub fn select<'a>(&self, entries: &'a [Entry], resync: Option<&Resync>) -> Vec<&'a Entry> {
        let mut by_port: HashMap<u16, Vec<&Stale>> = HashMap::new();
        for s in &self.stale {
            by_port.entry(s.dst.port()).or_default().push(s);
        }
        entries
            .iter()
            .filter(|e| {
                by_port
                    .get(&e.orig.dport)
                    .is_some_and(|v| v.iter().any(|s| s.matches(e)))
                    || resync.is_some_and(|r| r.stale(e))
            })
            .collect()
    }
}

/// What a process's first commit makes stale, from the committed model alone: for each UDP
/// destination it lists, the entries whose reply comes from none of the destination's
/// endpoints (an endpoint that went while no actuator ran, or no DNAT though endpoints exist
/// now), and for a destination without endpoints, the entries DNATed anywhere. Destinations
/// the model does not list are left alone: what they were is not known.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Resync {
    /// Destination (all-zeros address: a node port) -> its endpoints, empty for none.
    destinations: HashMap<SocketAddr, BTreeSet<SocketAddr>>,
    /// The addresses node ports answer on (`nodeport-ips`): an entry counts as a node port's
    /// only when sent to one of them.
    node_addresses: BTreeSet<IpAddr>,
}

impl Resync {
    pub fn of(model: &Model) -> Resync {
        let mut r = Resync::default();
        for (tkey, table) in model.tables.iter() {
            let family = table_family(tkey);
            for (name, set) in table.sets.iter() {
                let role = ConntrackRole::try_from(set.def.conntrack).unwrap_or_default();
                let is_node_ips = name == crate::healthcheck::NODEPORT_IPS;
                if role == ConntrackRole::None && !is_node_ips {
                    continue;
                }
                for e in set.decoded() {
                    if is_node_ips {
                        r.node_addresses.extend(e.key.first().and_then(ip_of));
                    } else if role == ConntrackRole::Endpoints {
                        if let Some((dst, ep)) = endpoint_of(&e, family) {
                            r.destinations.entry(dst).or_default().insert(ep);
                        }
                    } else if let Some((dst, _)) = udp_destination(&e.key, family) {
                        r.destinations.entry(dst).or_default();
                    }
                }
            }
        }
        r
    }

    pub fn stale(&self, e: &Entry) -> bool {
        let (o, r) = (&e.orig, &e.reply);
        if o.proto != netlink::IPPROTO_UDP {
            return false;
        }
        let any: IpAddr = if o.dst.is_ipv4() {
            Ipv4Addr::UNSPECIFIED.into()
        } else {
            Ipv6Addr::UNSPECIFIED.into()
        };
        let endpoints = self
            .destinations
            .get(&SocketAddr::new(o.dst, o.dport))
            .or_else(|| {
                self.node_addresses
                    .contains(&o.dst)
                    .then(|| self.destinations.get(&SocketAddr::new(any, o.dport)))
                    .flatten()
            });
        let Some(endpoints) = endpoints else {
            return false;
        };
        let not_nat = r.src == o.dst && r.sport == o.dport;
        if endpoints.is_empty() {
            !not_nat
        } else {
            !endpoints.contains(&SocketAddr::new(r.src, r.sport))
        }
    }
}

/// What an element of a set with `role` that went away (`removed`) or changed leaves stale
/// after the commit of `new`.
fn stale_of(
    role: ConntrackRole,
    e: &Element,
    removed: bool,
    new: &Model,
    tkey: &TableKey,
) -> Option<Stale> {
    match role {
        ConntrackRole::Endpoints => {
            let (dst, ep) = endpoint_of(e, table_family(tkey))?;
            (!still_served(new, tkey, e, ep)).then_some(Stale {
                dst,
                via: Via::Endpoint(ep),
            })
        }
        // A destination still without endpoints (its element changed otherwise) keeps its
        // refusals.
        ConntrackRole::NoEndpoints if removed => Some(Stale {
            dst: udp_destination(&e.key, table_family(tkey))?.0,
            via: Via::NotNat,
        }),
        ConntrackRole::NoEndpoints | ConntrackRole::None => None,
    }
}

fn ip_of(d: &Datum) -> Option<IpAddr> {
    match d.value.as_ref()? {
        Value::Ipv4(b) => Some(Ipv4Addr::from(<[u8; 4]>::try_from(&b[..]).ok()?).into()),
        Value::Ipv6(b) => Some(Ipv6Addr::from(<[u8; 16]>::try_from(&b[..]).ok()?).into()),
        _ => None,
    }
}

fn port_of(d: &Datum) -> Option<u16> {
    match d.value.as_ref()? {
        Value::Port(p) => u16::try_from(*p).ok(),
        _ => None,
    }
}

/// `addr . udp . port ...` as a socket address, or `udp . port ...` (a port on every local
/// address, NodePorts) as the all-zeros address of the endpoint's family; with the number of
/// key fields that name the destination. None for other protocols or shapes.
fn udp_destination(key: &[Datum], family: IpFamily) -> Option<(SocketAddr, usize)> {
    let (addr, proto, port, fields) = match key {
        [
            proto @ Datum {
                value: Some(Value::Proto(_)),
            },
            port,
            ..,
        ] => {
            let any: IpAddr = match family {
                IpFamily::V4 => Ipv4Addr::UNSPECIFIED.into(),
                IpFamily::V6 => Ipv6Addr::UNSPECIFIED.into(),
            };
            (any, proto, port, 2)
        }
        [addr, proto, port, ..] => (ip_of(addr)?, proto, port, 3),
        _ => return None,
    };
    if proto.value != Some(Value::Proto(UDP)) {
        return None;
    }
    Some((SocketAddr::new(addr, port_of(port)?), fields))
}

/// The address family of a table's addresses (only `ip` and `ip6` tables are applied).
fn table_family(tkey: &TableKey) -> IpFamily {
    IpFamily::try_from(tkey.0).unwrap_or(IpFamily::V4)
}

/// The destination and endpoint of an endpoints-map element with a UDP key.
fn endpoint_of(e: &Element, family: IpFamily) -> Option<(SocketAddr, SocketAddr)> {
    let (dst, _) = udp_destination(&e.key, family)?;
    let [addr, port] = &e.data[..] else {
        return None;
    };
    Some((dst, SocketAddr::new(ip_of(addr)?, port_of(port)?)))
}

/// Whether an endpoints map of `new`'s table `tkey` still sends `e`'s destination (its key but
/// the slot) to `ep`. Keys are stored encoded, and the encoding of the first three key fields
/// is a prefix of the whole key's, so this is a range scan over one destination's slots.
fn still_served(new: &Model, tkey: &TableKey, e: &Element, ep: SocketAddr) -> bool {
    let Some(table) = new.tables.get(tkey) else {
        return false;
    };
    let family = table_family(tkey);
    let Some((_, fields)) = udp_destination(&e.key, family) else {
        return false;
    };
    let Some(destination) = e.key.get(..fields) else {
        return false;
    };
    let prefix: Box<[u8]> = Element {
        key: destination.to_vec(),
        ..Default::default()
    }
    .encode_to_vec()
    .into();
    let serves = |s: &SetModel| {
        s.elements
            .range(prefix.clone()..)
            .take_while(|(k, _)| k.starts_with(&prefix))
            .filter_map(|(_, v)| Element::decode(&v[..]).ok())
            .any(|other| endpoint_of(&other, family).is_some_and(|(_, to)| to == ep))
    };
    table
        .sets
        .values()
        .filter(|s| s.def.conntrack == ConntrackRole::Endpoints as i32)
        .any(serves)
}

/// Deletes the entries a [`Plan`] names. Holds its netlink socket across commits, opened on
/// first use (so a node that never cleans never opens it) and reopened after a failure.
#[derive(Default)]
pub struct Cleaner {
    socket: Option<CtSocket>,
}

impl Cleaner {
    pub fn new() -> Self {
        Self::default()
    }

    /// Deletes what `plan` names and returns how many entries went. Failures are logged and
    /// counted, never returned: the commit they follow has succeeded.
    pub fn clean(&mut self, plan: &Plan, metrics: &Metrics) -> usize {
        if plan.is_empty() {
            return 0;
        }
        match self.try_clean(plan) {
            Ok(d) => {
                metrics.conntrack_deleted(d.deleted as u64);
                if d.failed > 0 {
                    metrics.conntrack_cleanup_failed();
                    tracing::warn!(
                        failed = d.failed,
                        "some stale conntrack entries were not deleted"
                    );
                }
                tracing::debug!(
                    deleted = d.deleted,
                    already_gone = d.missing,
                    stale = plan.len(),
                    "conntrack cleanup done"
                );
                d.deleted
            }
            Err(e) => {
                self.socket = None;
                metrics.conntrack_cleanup_failed();
                tracing::warn!(error = %e, "conntrack cleanup failed; stale UDP entries stay until they expire");
                0
            }
        }
    }

    fn try_clean(&mut self, plan: &Plan) -> std::io::Result<Deleted> {
        let sock = match &mut self.socket {
            Some(s) => s,
            None => self.socket.insert(CtSocket::open()?),
        };
        let mut total = Deleted::default();
        let resync = plan.resync.as_ref().map(Resync::of);
        for family in plan.families() {
            let entries = sock.dump_udp(family)?;
            let stale: Vec<Entry> = plan
                .select(&entries, resync.as_ref())
                .into_iter()
                .cloned()
                .collect();
            for e in &stale {
                tracing::debug!(entry = %e, "deleting stale conntrack entry");
            }
            let d = sock.delete(&stale)?;
            total.deleted += d.deleted;
            total.missing += d.missing;
            total.failed += d.failed;
        }
        Ok(total)
    }
}
