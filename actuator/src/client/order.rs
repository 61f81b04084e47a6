//! Which brain a node tries, and when: its own order of the brains by rendezvous hashing, and
//! the jittered pacing of reconnects (docs/protocol.md, "Which brain").
use std::time::Duration;

use tonic::transport::Uri;

const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(10);
/// After a healthy stream breaks, the first reconnect waits a random time up to this: every
/// node of a replica that died notices at the same instant, and this spreads their arrival at
/// the next replica over the interval.
const RECONNECT_SPREAD: Duration = Duration::from_secs(1);

/// The brain addresses in `node`'s order of preference: by rendezvous (highest random weight)
/// hashing of (node, address), highest weight first. Each node prefers one address, the
/// preferences spread evenly over the addresses, and removing an address moves only the nodes
/// that preferred it (each to its own next choice); adding one takes only the nodes that now
/// prefer it. The weight is a fixed function of the two strings, the same in every process and
/// version, so a node's order survives restarts.
pub fn brain_order(node: &str, brains: &[Uri]) -> Vec<Uri> {
    let mut weighted: Vec<(u64, String, &Uri)> = brains
        .iter()
        .map(|b| {
            let address = b.to_string();
            (rendezvous_weight(node, &address), address, b)
        })
        .collect();
    // Ties (practically never) are broken by the address, so the order is total.
    weighted.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
    weighted.into_iter().map(|(_, _, b)| b.clone()).collect()
}

/// The rendezvous weight of (node, address): 64-bit FNV-1a over both (separated by a byte no
/// UTF-8 string holds), then the MurmurHash3 finalizer so that names differing in one character
/// get unrelated weights. Not a secret: it only spreads load.
fn rendezvous_weight(node: &str, address: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let bytes = node.bytes().chain([0xff]).chain(address.bytes());
    for b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

/// When to try again after a stream ended: full jitter on an exponential backoff after
/// failures (a random time between zero and the backoff, so retries of many nodes do not
/// synchronise), and after a healthy stream a random time up to `RECONNECT_SPREAD` with the
/// backoff reset.
#[derive(Debug, Clone)]
pub struct Pacing {
    backoff: Duration,
}

impl Default for Pacing {
    fn default() -> Self {
        Pacing {
            backoff: BACKOFF_MIN,
        }
    }
}

impl Pacing {
    /// The wait before the next attempt, for a stream that ended `healthy` or not; `random` is
    /// uniform in [0, 1).
    pub fn next_delay(&mut self, healthy: bool, random: f64) -> Duration {
        let random = random.clamp(0.0, 1.0);
        if healthy {
            self.backoff = BACKOFF_MIN;
            return RECONNECT_SPREAD.mul_f64(random);
        }
        let delay = self.backoff.mul_f64(random);
        self.backoff = (self.backoff * 2).min(BACKOFF_MAX);
        delay
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uris(addresses: &[&str]) -> Vec<Uri> {
        addresses.iter().map(|a| a.parse().unwrap()).collect()
    }

    const THREE: [&str; 3] = [
        "https://brain-0.splitproxy:9443",
        "https://brain-1.splitproxy:9443",
        "https://brain-2.splitproxy:9443",
    ];

    /// A node's order depends on its name and the set of addresses only: not on the order the
    /// addresses were given in, nor on the process (the weights are pinned).
    #[test]
    fn the_order_is_stable() {
        let brains = uris(&THREE);
        let mut reversed = brains.clone();
        reversed.reverse();
        for i in 0..100 {
            let node = format!("node-{i}");
            let order = brain_order(&node, &brains);
            assert_eq!(order, brain_order(&node, &brains));
            assert_eq!(order, brain_order(&node, &reversed));
            let mut sorted = order.clone();
            sorted.sort_by_key(ToString::to_string);
            assert_eq!(sorted, brains, "every address once");
        }
        // Pinned: a change of the weight function would move every node of a running cluster.
        // (FNV-1a 64 then the MurmurHash3 finalizer, computed independently.)
        assert_eq!(
            rendezvous_weight("node-0", "https://a:1/"),
            0x2faa_7426_70e3_d992
        );
    }

    /// 10,000 nodes over 3 addresses: each address is preferred by a third of them, within a
    /// few percent, and each is the second choice of a third of those preferring another.
    #[test]
    fn nodes_spread_evenly() {
        let brains = uris(&THREE);
        let mut first = [0usize; 3];
        let mut second = [[0usize; 3]; 3];
        for i in 0..10_000 {
            let order = brain_order(&format!("node-{i}"), &brains);
            let at = |u: &Uri| brains.iter().position(|b| b == u).unwrap();
            first[at(&order[0])] += 1;
            second[at(&order[0])][at(&order[1])] += 1;
        }
        for (b, n) in first.iter().enumerate() {
            assert!(
                (3_033..=3_633).contains(n),
                "address {b} preferred by {n} of 10,000: {first:?}"
            );
        }
        // Where a replica's nodes go when it fails: evenly to the others.
        for (b, row) in second.iter().enumerate() {
            let others: Vec<usize> = (0..3).filter(|o| *o != b).map(|o| row[o]).collect();
            let (lo, hi) = (others[0].min(others[1]), others[0].max(others[1]));
            assert!(
                (hi - lo) as f64 <= 0.1 * first[b] as f64,
                "nodes of {b} fail over unevenly: {row:?}"
            );
        }
        // Names that differ in one character, and short names, spread too.
        let mut short = [0usize; 3];
        for c in 'a'..='z' {
            for d in 0..10 {
                let order = brain_order(&format!("{c}{d}"), &brains);
                short[brains.iter().position(|b| *b == order[0]).unwrap()] += 1;
            }
        }
        assert!(short.iter().all(|n| *n >= 60), "{short:?}");
    }

    /// Removing an address moves only the nodes that preferred it; the others keep their whole
    /// order (minus the removed address). Adding one back takes only the nodes that prefer it.
    #[test]
    fn removing_an_address_moves_only_its_nodes() {
        let brains = uris(&THREE);
        let without: Vec<Uri> = brains[..2].to_vec();
        let mut moved = 0;
        for i in 0..10_000 {
            let node = format!("node-{i}");
            let full = brain_order(&node, &brains);
            let less = brain_order(&node, &without);
            let kept: Vec<Uri> = full.iter().filter(|b| **b != brains[2]).cloned().collect();
            assert_eq!(less, kept, "{node}: the remaining order is unchanged");
            if full[0] != less[0] {
                assert_eq!(full[0], brains[2], "{node} moved though its replica stayed");
                moved += 1;
            }
        }
        assert!((3_033..=3_633).contains(&moved), "{moved}");
    }

    /// After failures: a random wait up to a doubling backoff (full jitter), capped; after a
    /// healthy stream: a random wait up to the spread, and the backoff starts over.
    #[test]
    fn reconnects_are_jittered() {
        let mut p = Pacing::default();
        assert_eq!(
            p.next_delay(false, 0.999_999),
            BACKOFF_MIN.mul_f64(0.999_999)
        );
        assert_eq!(p.next_delay(false, 0.5), BACKOFF_MIN);
        assert_eq!(p.next_delay(false, 0.0), Duration::ZERO);
        for _ in 0..20 {
            p.next_delay(false, 0.5);
        }
        assert_eq!(p.next_delay(false, 1.0), BACKOFF_MAX, "capped");
        assert_eq!(p.next_delay(true, 0.25), RECONNECT_SPREAD / 4);
        assert_eq!(
            p.next_delay(false, 1.0),
            BACKOFF_MIN,
            "the backoff starts over after a healthy stream"
        );
        // Many nodes losing one replica at once arrive spread over the interval.
        let delays: Vec<Duration> = (0..1_000)
            .map(|_| Pacing::default().next_delay(true, rand::random_range(0.0..1.0)))
            .collect();
        let early = delays
            .iter()
            .filter(|d| **d < RECONNECT_SPREAD / 10)
            .count();
        assert!(early < 200, "{early} of 1,000 in the first tenth");
        assert!(delays.iter().all(|d| *d < RECONNECT_SPREAD));
    }
}
