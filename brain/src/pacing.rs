//! When the watch task may publish again ([`crate::watch`]). Every publication costs one update
//! per node, so under churn the events of a while are folded into one publication instead of
//! thousands of streams each chasing every event; after a quiet period a change goes out at
//! once.
//!
//! Two holds, both bounded so that the brain can never be held silently stale:
//! - publications are at least `min_interval` apart (kube-proxy's min sync period has the same
//!   purpose);
//! - and (`--publish-when-unsettled`, a tenth by default) until no more than a share of the nodes
//!   has yet to ack the last publication, never past 1 s after it (`UNSETTLED_WAIT_MAX`): a node
//!   still busy with the last one would get the next folded into its following update anyway.
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;

/// `--publish-when-unsettled`'s default: a publication waits until nine nodes in ten acked the
/// last one. Alternating benchmark runs at 5,000 and 10,000 nodes (docs/performance.md,
/// "Publications that wait for the last fan-out") put it ahead of no wait in all but one pair,
/// and far ahead where one replica serves more nodes than its CPU keeps up with; 0.5 held too
/// little to help.
pub const DEFAULT_WHEN_UNSETTLED: f64 = 0.1;
/// The longest a publication waits for the last one's fan-out.
const UNSETTLED_WAIT_MAX: Duration = Duration::from_secs(1);
/// How often that wait looks at the fan-out.
const UNSETTLED_POLL: Duration = Duration::from_millis(5);

/// How publications are spaced.
#[derive(Clone, Copy, Debug)]
pub struct Pacing {
    /// At least this long between two publications.
    pub min_interval: Duration,
    /// After `min_interval`, wait until no more than this share (0 to 1) of the nodes has yet to
    /// ack the last publication; 1 does not wait.
    pub when_unsettled: f64,
}

impl Pacing {
    /// Holds the publication that follows the one made at `last`, handing every input that
    /// arrives meanwhile to `handle`. `unsettled` is the share of the nodes yet to ack the last
    /// publication ([`crate::fanout::Fanout::newest_unsettled_share`]). Returns false when every
    /// sender of `rx` is gone (the brain stopping): nothing more will arrive to wait for.
    pub async fn hold<T>(
        &self,
        last: Instant,
        rx: &mut mpsc::Receiver<T>,
        unsettled: impl Fn() -> f64,
        mut handle: impl FnMut(T),
    ) -> bool {
        let spaced = last + self.min_interval;
        loop {
            match tokio::time::timeout_at(spaced, rx.recv()).await {
                Ok(Some(input)) => handle(input),
                Ok(None) => return false,
                Err(_) => break,
            }
        }
        let bound = last + UNSETTLED_WAIT_MAX;
        // 1 (off) is tested first: no share exceeds it, and the share takes the fan-out's lock.
        while self.when_unsettled < 1.0 && unsettled() > self.when_unsettled {
            let now = Instant::now();
            if now >= bound {
                break;
            }
            match tokio::time::timeout_at((now + UNSETTLED_POLL).min(bound), rx.recv()).await {
                Ok(Some(input)) => handle(input),
                Ok(None) => return false,
                Err(_) => {}
            }
        }
        true
    }
}

/// A share of the nodes as a flag gives it: a number from 0 to 1.
pub fn parse_share(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if (0.0..=1.0).contains(&v) => Ok(v),
        Ok(_) => Err(format!("{s:?}: a share of the nodes is from 0 to 1")),
        Err(e) => Err(format!("{s:?}: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::rc::Rc;

    use super::*;

    const MIN: Duration = Duration::from_millis(200);

    fn pacing(when_unsettled: f64) -> Pacing {
        Pacing {
            min_interval: MIN,
            when_unsettled,
        }
    }

    /// What a hold did: how long it took after the last publication, what it handled, and
    /// whether it may publish.
    async fn held(
        p: Pacing,
        rx: &mut mpsc::Receiver<u32>,
        unsettled: impl Fn() -> f64,
    ) -> (Duration, Vec<u32>, bool) {
        let last = Instant::now();
        let mut got = Vec::new();
        let go = p.hold(last, rx, unsettled, |i| got.push(i)).await;
        (last.elapsed(), got, go)
    }

    #[tokio::test(start_paused = true)]
    async fn a_publication_waits_out_the_spacing_and_takes_in_what_arrives() {
        let (tx, mut rx) = mpsc::channel(8);
        tokio::spawn(async move {
            for i in 0..3 {
                tokio::time::sleep(Duration::from_millis(50)).await;
                tx.send(i).await.unwrap();
            }
            tokio::time::sleep(Duration::from_secs(10)).await;
        });
        let (took, got, go) = held(pacing(1.0), &mut rx, || 1.0).await;
        assert_eq!(
            took, MIN,
            "1.0 never waits for the fan-out, even with none acked"
        );
        assert_eq!(got, vec![0, 1, 2]);
        assert!(go);
    }

    #[tokio::test(start_paused = true)]
    async fn a_settled_fanout_adds_no_wait() {
        let (_tx, mut rx) = mpsc::channel::<u32>(8);
        let (took, _, go) = held(pacing(0.1), &mut rx, || 0.1).await;
        assert_eq!(took, MIN, "at the share exactly: settled enough");
        assert!(go);
    }

    #[tokio::test(start_paused = true)]
    async fn an_unsettled_fanout_holds_the_publication_until_enough_nodes_acked() {
        let (tx, mut rx) = mpsc::channel(8);
        let share = Rc::new(Cell::new(1.0));
        // The nodes ack in steps: 60 % unsettled at 300 ms, 5 % at 420 ms; an event at 350 ms.
        let s = share.clone();
        let start = Instant::now();
        let unsettled = move || {
            let t = start.elapsed();
            if t >= Duration::from_millis(420) {
                s.set(0.05);
            } else if t >= Duration::from_millis(300) {
                s.set(0.6);
            }
            s.get()
        };
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(350)).await;
            tx.send(7).await.unwrap();
            tokio::time::sleep(Duration::from_secs(10)).await;
        });
        let (took, got, go) = held(pacing(0.1), &mut rx, unsettled).await;
        assert!(
            took >= Duration::from_millis(420)
                && took < Duration::from_millis(420) + UNSETTLED_POLL * 2,
            "published once 95 % acked, within a poll: {took:?}"
        );
        assert_eq!(got, vec![7], "what arrives during the wait is folded in");
        assert!(go);
        assert_eq!(share.get(), 0.05);
    }

    #[tokio::test(start_paused = true)]
    async fn a_fanout_that_never_settles_holds_no_longer_than_the_bound() {
        let (_tx, mut rx) = mpsc::channel::<u32>(8);
        let (took, _, go) = held(pacing(0.0), &mut rx, || 0.5).await;
        assert_eq!(took, UNSETTLED_WAIT_MAX);
        assert!(go, "bounded: the publication goes out stale nodes or not");
    }

    #[tokio::test(start_paused = true)]
    async fn a_closed_channel_ends_the_hold_at_once() {
        for (sleep, when_unsettled) in [(50, 1.0), (250, 0.1)] {
            let (tx, mut rx) = mpsc::channel::<u32>(8);
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(sleep)).await;
                drop(tx);
            });
            let (took, _, go) = held(pacing(when_unsettled), &mut rx, || 1.0).await;
            assert_eq!(
                took,
                Duration::from_millis(sleep),
                "no poll until the bound"
            );
            assert!(!go);
        }
    }

    #[test]
    fn a_share_is_from_zero_to_one() {
        assert_eq!(parse_share("0"), Ok(0.0));
        assert_eq!(parse_share("0.25"), Ok(0.25));
        assert_eq!(parse_share("1"), Ok(1.0));
        for bad in ["-0.1", "1.5", "NaN", "inf", "", "a tenth"] {
            assert!(parse_share(bad).is_err(), "{bad:?}");
        }
    }
}
