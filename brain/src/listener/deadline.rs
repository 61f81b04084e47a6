//! A deadline checked on every read of a connection, where it must cost next to nothing.
//!
//! Polling a tokio `Sleep` on each read touches its timer entry and re-registers the task's
//! waker: on a node's connection, which reads an ack for every update, that was about 1 % of
//! the brain's CPU under churn. [`Deadline`] polls its timer only to register the task (the
//! first time, or when another task polls the connection) and once the deadline has passed; in
//! between, a read costs one clock read, and the registered timer still wakes the task at the
//! deadline, so an idle connection is closed on time too.
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use tokio::time::{Instant, Sleep};

pub(super) struct Deadline {
    at: Instant,
    sleep: Pin<Box<Sleep>>,
    /// The task the timer wakes, once registered.
    registered: Option<Waker>,
}

impl Deadline {
    pub(super) fn new(at: Instant) -> Deadline {
        Deadline {
            at,
            sleep: Box::pin(tokio::time::sleep_until(at)),
            registered: None,
        }
    }

    /// Ready once the deadline has passed; otherwise the polling task is woken then.
    pub(super) fn poll(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if let Some(w) = &self.registered
            && w.will_wake(cx.waker())
            && Instant::now() < self.at
        {
            return Poll::Pending;
        }
        self.registered = Some(cx.waker().clone());
        self.sleep.as_mut().poll(cx)
    }

    /// Moves the deadline (the timer clamps far ones, which are then set again).
    pub(super) fn reset(&mut self, at: Instant) {
        self.at = at;
        self.sleep.as_mut().reset(at);
        self.registered = None;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::Wake;
    use std::time::Duration;

    use super::*;

    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Not ready before the deadline however often it is polled, the registered task woken at
    /// the deadline without another poll, and ready then.
    #[tokio::test(start_paused = true)]
    async fn a_deadline_wakes_its_task_once_passed_and_is_ready_then() {
        let woken = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(woken.clone());
        let mut cx = Context::from_waker(&waker);
        let mut d = Deadline::new(Instant::now() + Duration::from_secs(10));
        for _ in 0..3 {
            assert!(d.poll(&mut cx).is_pending());
        }
        tokio::time::sleep(Duration::from_secs(9)).await;
        assert!(d.poll(&mut cx).is_pending());
        assert_eq!(woken.0.load(Ordering::SeqCst), 0);
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(woken.0.load(Ordering::SeqCst), 1, "the timer woke the task");
        assert!(d.poll(&mut cx).is_ready());
    }

    /// Another task polling registers itself: the timer wakes the task that polls now.
    #[tokio::test(start_paused = true)]
    async fn the_task_polling_last_is_the_one_woken() {
        let first = Arc::new(Count(AtomicUsize::new(0)));
        let second = Arc::new(Count(AtomicUsize::new(0)));
        let mut d = Deadline::new(Instant::now() + Duration::from_secs(1));
        let w1 = Waker::from(first.clone());
        let w2 = Waker::from(second.clone());
        assert!(d.poll(&mut Context::from_waker(&w1)).is_pending());
        assert!(d.poll(&mut Context::from_waker(&w2)).is_pending());
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(second.0.load(Ordering::SeqCst), 1);
        assert!(d.poll(&mut Context::from_waker(&w2)).is_ready());
    }

    /// A moved deadline counts from its new instant.
    #[tokio::test(start_paused = true)]
    async fn a_reset_deadline_waits_for_its_new_instant() {
        let woken = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(woken.clone());
        let mut cx = Context::from_waker(&waker);
        let mut d = Deadline::new(Instant::now() + Duration::from_secs(1));
        assert!(d.poll(&mut cx).is_pending());
        d.reset(Instant::now() + Duration::from_secs(5));
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(d.poll(&mut cx).is_pending());
        tokio::time::sleep(Duration::from_secs(4)).await;
        assert!(d.poll(&mut cx).is_ready());
    }
}
