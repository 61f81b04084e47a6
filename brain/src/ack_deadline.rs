//! How long a session waits for a node's ack, on one timer per session instead of one per
//! update.
//!
//! A session sends an update and waits for its ack at most [`AckDeadline`]'s timeout. Wrapping
//! each wait in `tokio::time::timeout` put a timer into the runtime's wheel and took it out
//! again for every update of every node (5,000 nodes times several updates a second); the
//! profile showed that as 4 % of the brain's CPU. Here the session keeps one timer: each wait
//! leaves it where it is when it is due no later than the wait's own deadline, and when it
//! fires before that deadline (it was set for an older update) it is moved once. So the timer
//! is moved about once per timeout period, and an ack is still never waited for longer than
//! the timeout after its update was sent.
use std::pin::Pin;
use std::time::Duration;

use tokio::time::{Instant, Sleep};

/// The wait for an ack did not end within the timeout.
#[derive(Debug, PartialEq, Eq)]
pub struct AckTimedOut;

/// One session's ack timer.
pub struct AckDeadline {
    timeout: Duration,
    timer: Pin<Box<Sleep>>,
}

impl AckDeadline {
    pub fn new(timeout: Duration) -> AckDeadline {
        AckDeadline {
            timeout,
            timer: Box::pin(tokio::time::sleep(timeout)),
        }
    }

    /// Waits for `ack`, the answer to an update sent at `sent`; [`AckTimedOut`] once the
    /// timeout has passed since `sent`.
    pub async fn wait<F: Future>(
        &mut self,
        sent: Instant,
        ack: F,
    ) -> Result<F::Output, AckTimedOut> {
        let deadline = sent + self.timeout;
        if self.timer.deadline() > deadline {
            self.timer.as_mut().reset(deadline);
        }
        tokio::pin!(ack);
        loop {
            tokio::select! {
                biased;
                out = &mut ack => return Ok(out),
                () = self.timer.as_mut() => {
                    if Instant::now() >= deadline {
                        return Err(AckTimedOut);
                    }
                    self.timer.as_mut().reset(deadline);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TIMEOUT: Duration = Duration::from_secs(60);

    #[tokio::test(start_paused = true)]
    async fn an_ack_in_time_is_returned() {
        let mut d = AckDeadline::new(TIMEOUT);
        let sent = Instant::now();
        let ack = async {
            tokio::time::sleep(Duration::from_secs(59)).await;
            7
        };
        assert_eq!(d.wait(sent, ack).await, Ok(7));
    }

    #[tokio::test(start_paused = true)]
    async fn a_missing_ack_times_out_exactly_the_timeout_after_its_update_was_sent() {
        let mut d = AckDeadline::new(TIMEOUT);
        let start = Instant::now();
        // An earlier update, answered after 10 s: the timer stays set for its deadline (60 s).
        d.wait(start, tokio::time::sleep(Duration::from_secs(10)))
            .await
            .unwrap();
        // The next update goes out at 50 s and is never answered: not given up at 60 s (the
        // older deadline), but at 110 s.
        tokio::time::sleep_until(start + Duration::from_secs(50)).await;
        let r = d.wait(Instant::now(), std::future::pending::<()>()).await;
        assert_eq!(r, Err(AckTimedOut));
        assert_eq!(Instant::now() - start, Duration::from_secs(110));
    }

    #[tokio::test(start_paused = true)]
    async fn many_answered_updates_do_not_shorten_or_stretch_the_wait() {
        let mut d = AckDeadline::new(TIMEOUT);
        let start = Instant::now();
        for _ in 0..1000 {
            d.wait(
                Instant::now(),
                tokio::time::sleep(Duration::from_millis(100)),
            )
            .await
            .unwrap();
        }
        let sent = Instant::now();
        assert_eq!(sent - start, Duration::from_secs(100));
        let r = d.wait(sent, std::future::pending::<()>()).await;
        assert_eq!(r, Err(AckTimedOut));
        assert_eq!(Instant::now() - sent, TIMEOUT);
    }
}
