//! Address families, typed: [`IpFamily`] for what splitproxy computes per family (an `ip` and
//! an `ip6` table, each holding only its family's addresses), and the nft name of a table's
//! [`Family`], written once for every user (model keys, rendering, logs).
//!
//! Why a type rather than `ipv6: bool`: rule builders take the family through many layers, and
//! a literal `true` at a call site says nothing, while `IpFamily::V6` does; a `(IpFamily, T)`
//! key cannot be confused with any other flag.
use std::fmt;
use std::net::IpAddr;
use std::ops::{Index, IndexMut};

use crate::v1::Family;

/// One of the two address families splitproxy keeps a table for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum IpFamily {
    /// IPv4: the `ip` table.
    V4,
    /// IPv6: the `ip6` table.
    V6,
}

impl IpFamily {
    /// Both families, IPv4 first (the order tables and per-family work come in).
    pub const ALL: [IpFamily; 2] = [IpFamily::V4, IpFamily::V6];

    /// The family of an address.
    pub fn of(addr: IpAddr) -> IpFamily {
        match addr {
            IpAddr::V4(_) => IpFamily::V4,
            IpAddr::V6(_) => IpFamily::V6,
        }
    }

    /// The family of a prefix.
    pub fn of_net(net: ipnet::IpNet) -> IpFamily {
        match net {
            ipnet::IpNet::V4(_) => IpFamily::V4,
            ipnet::IpNet::V6(_) => IpFamily::V6,
        }
    }

    /// Whether `addr` belongs to this family.
    pub fn holds(self, addr: IpAddr) -> bool {
        IpFamily::of(addr) == self
    }

    /// Whether `net` belongs to this family.
    pub fn holds_net(self, net: ipnet::IpNet) -> bool {
        IpFamily::of_net(net) == self
    }

    /// The table family of this address family.
    pub fn table_family(self) -> Family {
        match self {
            IpFamily::V4 => Family::Ip,
            IpFamily::V6 => Family::Ip6,
        }
    }

    /// Bytes of an address: 4 or 16.
    pub fn addr_len(self) -> u32 {
        match self {
            IpFamily::V4 => 4,
            IpFamily::V6 => 16,
        }
    }

    /// The nft name of this family's table: `ip` or `ip6`.
    pub fn nft_name(self) -> &'static str {
        self.table_family().nft_name()
    }
}

impl fmt::Display for IpFamily {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.nft_name())
    }
}

impl From<IpFamily> for Family {
    fn from(family: IpFamily) -> Family {
        family.table_family()
    }
}

/// A table family that is not one address family (`inet`, or unspecified).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("table family {} is not an address family", .0.nft_name())]
pub struct NotAnIpFamily(pub Family);

impl TryFrom<Family> for IpFamily {
    type Error = NotAnIpFamily;

    fn try_from(family: Family) -> Result<IpFamily, NotAnIpFamily> {
        match family {
            Family::Ip => Ok(IpFamily::V4),
            Family::Ip6 => Ok(IpFamily::V6),
            Family::Inet | Family::Unspecified => Err(NotAnIpFamily(family)),
        }
    }
}

impl Family {
    /// The family as nft writes it (`ip`, `ip6`, `inet`); `unknown` for the unspecified value,
    /// which no valid table has. For a raw wire value, go through the message's getter (e.g.
    /// `table.family()`), which reads unknown numbers as unspecified.
    pub fn nft_name(self) -> &'static str {
        match self {
            Family::Ip => "ip",
            Family::Ip6 => "ip6",
            Family::Inet => "inet",
            Family::Unspecified => "unknown",
        }
    }
}

/// One value per address family, addressed by [`IpFamily`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct PerFamily<T> {
    pub v4: T,
    pub v6: T,
}

impl<T> PerFamily<T> {
    /// The value of each family, computed by `f`, IPv4 first.
    pub fn from_fn(mut f: impl FnMut(IpFamily) -> T) -> Self {
        PerFamily {
            v4: f(IpFamily::V4),
            v6: f(IpFamily::V6),
        }
    }

    /// Each family with its value, IPv4 first.
    pub fn iter(&self) -> impl Iterator<Item = (IpFamily, &T)> {
        [(IpFamily::V4, &self.v4), (IpFamily::V6, &self.v6)].into_iter()
    }

    /// Both values, IPv4 first.
    pub fn values(&self) -> impl Iterator<Item = &T> {
        [&self.v4, &self.v6].into_iter()
    }
}

impl<T> Index<IpFamily> for PerFamily<T> {
    type Output = T;

    fn index(&self, family: IpFamily) -> &T {
        match family {
            IpFamily::V4 => &self.v4,
            IpFamily::V6 => &self.v6,
        }
    }
}

impl<T> IndexMut<IpFamily> for PerFamily<T> {
    fn index_mut(&mut self, family: IpFamily) -> &mut T {
        match family {
            IpFamily::V4 => &mut self.v4,
            IpFamily::V6 => &mut self.v6,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn of_an_address_and_a_prefix() {
        assert_eq!(IpFamily::of("10.0.0.1".parse().unwrap()), IpFamily::V4);
        assert_eq!(IpFamily::of("fd00::1".parse().unwrap()), IpFamily::V6);
        // An IPv4-mapped IPv6 address is an IPv6 address: it goes to the ip6 table.
        assert_eq!(
            IpFamily::of("::ffff:10.0.0.1".parse().unwrap()),
            IpFamily::V6
        );
        assert_eq!(
            IpFamily::of_net("10.96.0.0/12".parse().unwrap()),
            IpFamily::V4
        );
        assert_eq!(
            IpFamily::of_net("fd00::/108".parse().unwrap()),
            IpFamily::V6
        );
        assert!(IpFamily::V4.holds("192.0.2.1".parse().unwrap()));
        assert!(!IpFamily::V4.holds("2001:db8::1".parse().unwrap()));
        assert!(IpFamily::V6.holds_net("2001:db8::/32".parse().unwrap()));
        assert!(!IpFamily::V6.holds_net("192.0.2.0/24".parse().unwrap()));
    }

    #[test]
    fn converts_to_and_from_table_families() {
        for family in IpFamily::ALL {
            assert_eq!(IpFamily::try_from(Family::from(family)), Ok(family));
        }
        assert_eq!(Family::from(IpFamily::V4), Family::Ip);
        assert_eq!(Family::from(IpFamily::V6), Family::Ip6);
        assert_eq!(
            IpFamily::try_from(Family::Inet),
            Err(NotAnIpFamily(Family::Inet))
        );
        assert!(IpFamily::try_from(Family::Unspecified).is_err());
        assert_eq!(
            NotAnIpFamily(Family::Inet).to_string(),
            "table family inet is not an address family"
        );
    }

    #[test]
    fn renders_as_nft_does() {
        assert_eq!(IpFamily::V4.to_string(), "ip");
        assert_eq!(IpFamily::V6.to_string(), "ip6");
        assert_eq!(Family::Inet.nft_name(), "inet");
        assert_eq!(Family::Unspecified.nft_name(), "unknown");
        assert_eq!(IpFamily::V4.addr_len(), 4);
        assert_eq!(IpFamily::V6.addr_len(), 16);
    }

    #[test]
    fn all_is_ipv4_first_and_ordered() {
        assert_eq!(IpFamily::ALL, [IpFamily::V4, IpFamily::V6]);
        assert!(IpFamily::V4 < IpFamily::V6);
    }

    #[test]
    fn per_family_is_indexed_by_family() {
        let mut p = PerFamily::from_fn(|f| f.nft_name().to_string());
        assert_eq!(p[IpFamily::V4], "ip");
        assert_eq!(p[IpFamily::V6], "ip6");
        p[IpFamily::V6].push('!');
        assert_eq!(
            p.iter().map(|(f, v)| (f, v.as_str())).collect::<Vec<_>>(),
            [(IpFamily::V4, "ip"), (IpFamily::V6, "ip6!")]
        );
        assert_eq!(p.values().count(), 2);
    }
}
