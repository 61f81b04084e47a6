//! What the writer of the brain's Secret does next, decided from validity windows alone: a pure
//! function of the time and of what the Secret and the ConfigMap hold ([`Facts`]), so that every
//! renewal decision is tested without an API server or a clock.
//!
//! The order of the steps is what keeps clients verifying through a rotation: a new CA is added
//! to the bundle next to the previous one, the bundle is published, and only a
//! [`publish_grace`] after that is a serving certificate issued from the new CA; the previous
//! CA leaves the bundle when it expires, by which time nothing it signed is served any more.
use std::time::{Duration, SystemTime};

/// The longest wait between publishing a new CA and serving a certificate from it: time for
/// every node to see the new bundle (a kubelet refreshes a mounted ConfigMap within about a
/// minute or two). Shorter for short-lived CAs ([`publish_grace`]).
pub const MAX_PUBLISH_GRACE: Duration = Duration::from_secs(15 * 60);

/// A certificate's validity window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    pub not_before: SystemTime,
    pub not_after: SystemTime,
}

impl Window {
    pub fn lifetime(&self) -> Duration {
        self.not_after
            .duration_since(self.not_before)
            .unwrap_or_default()
    }

    /// When it is renewed: two thirds of the way through its life, which leaves a third of it
    /// to retry in (a writer that cannot write, a lost Lease).
    pub fn renew_at(&self) -> SystemTime {
        self.not_before + self.lifetime() * 2 / 3
    }

    pub fn expired(&self, now: SystemTime) -> bool {
        now >= self.not_after
    }
}

/// How long after a CA's notBefore a serving certificate from it may replace one from the
/// previous CA (see [`next`]; when nothing usable is served, one is issued at once):
/// [`MAX_PUBLISH_GRACE`], or a sixth of the CA's life when that is shorter.
pub fn publish_grace(ca: &Window) -> Duration {
    MAX_PUBLISH_GRACE.min(ca.lifetime() / 6)
}

/// Who signed the serving certificate, as far as the bundle tells.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Issuer {
    /// The current CA (whose key the Secret holds).
    Current,
    /// Another CA of the bundle: the previous one, before a rotation completes.
    Previous,
    /// No CA of the bundle: clients would not verify it.
    Unknown,
}

/// The serving certificate in the Secret, with its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Leaf {
    pub window: Window,
    pub issuer: Issuer,
    /// It names exactly the configured server names.
    pub names_match: bool,
}

/// What the Secret and the ConfigMap hold, reduced to what the decision needs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Facts {
    /// The current CA: the certificate of `ca.key`, if the key is there and matches one.
    pub ca: Option<Window>,
    /// Every CA of the Secret's `ca.crt` bundle (the current one among them).
    pub bundle: Vec<Window>,
    /// The ConfigMap's `ca.crt` is exactly the Secret's bundle.
    pub published: bool,
    /// The serving certificate, if `tls.crt` holds one whose key is `tls.key`.
    pub leaf: Option<Leaf>,
}

/// One step of the writer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Make a new CA, current from now, and put it at the head of the bundle (which keeps the
    /// previous CAs until they expire).
    NewCa,
    /// Drop expired CAs from the bundle.
    Prune,
    /// Write the Secret's bundle to the ConfigMap.
    Publish,
    /// Issue a serving certificate from the current CA.
    Issue,
    /// Nothing until then.
    Wait(SystemTime),
}

/// The next step at `now`.
pub fn next(now: SystemTime, facts: &Facts) -> Action {
    let ca = match facts.ca {
        Some(ca) if !ca.expired(now) && now < ca.renew_at() => ca,
        _ => return Action::NewCa,
    };
    if facts.bundle.iter().any(|w| w.expired(now)) {
        return Action::Prune;
    }
    if !facts.published {
        return Action::Publish;
    }
    // The CA's renewal, and the expiry of the bundle's CAs (to prune them).
    let mut wake = facts
        .bundle
        .iter()
        .map(|w| w.not_after)
        .fold(ca.renew_at(), SystemTime::min);
    match facts.leaf {
        // Nothing a client would verify is served: issue now, whatever the grace.
        None => return Action::Issue,
        Some(leaf)
            if leaf.window.expired(now) || leaf.issuer == Issuer::Unknown || !leaf.names_match =>
        {
            return Action::Issue;
        }
        // From the current CA: clients that verify it hold that CA, so the renewal is due at
        // two thirds of its life, with no grace.
        Some(leaf) if leaf.issuer == Issuer::Current => {
            if now >= leaf.window.renew_at() {
                return Action::Issue;
            }
            wake = wake.min(leaf.window.renew_at());
        }
        // From the previous CA: replaced by one from the current CA once the bundle that holds
        // it has had time to reach every node.
        Some(leaf) => {
            let grace_end = ca.not_before + publish_grace(&ca);
            if now >= grace_end {
                return Action::Issue;
            }
            wake = wake.min(grace_end).min(leaf.window.not_after);
        }
    }
    Action::Wait(wake)
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: SystemTime = SystemTime::UNIX_EPOCH;

    fn at(secs: u64) -> SystemTime {
        T0 + Duration::from_secs(secs)
    }

    fn window(from: u64, to: u64) -> Window {
        Window {
            not_before: at(from),
            not_after: at(to),
        }
    }

    /// A CA from 0 to 900 s and a leaf from it, 0 to 90 s: all published.
    fn settled() -> Facts {
        Facts {
            ca: Some(window(0, 900)),
            bundle: vec![window(0, 900)],
            published: true,
            leaf: Some(Leaf {
                window: window(0, 90),
                issuer: Issuer::Current,
                names_match: true,
            }),
        }
    }

    #[test]
    fn renewal_is_due_after_two_thirds_of_the_life() {
        let w = window(30, 120);
        assert_eq!(w.lifetime(), Duration::from_secs(90));
        assert_eq!(w.renew_at(), at(90));
        assert!(!w.expired(at(119)) && w.expired(at(120)));
        assert_eq!(publish_grace(&window(0, 600)), Duration::from_secs(100));
        assert_eq!(
            publish_grace(&window(0, 5 * 365 * 86_400)),
            MAX_PUBLISH_GRACE
        );
    }

    #[test]
    fn an_empty_secret_gets_a_ca_then_a_published_bundle_then_a_certificate() {
        let mut facts = Facts::default();
        assert_eq!(next(at(0), &facts), Action::NewCa);
        facts.ca = Some(window(0, 900));
        facts.bundle = vec![window(0, 900)];
        assert_eq!(next(at(1), &facts), Action::Publish, "published first");
        facts.published = true;
        // No certificate at all: issued at once, without waiting for the grace.
        assert_eq!(next(at(1), &facts), Action::Issue);
        assert_eq!(next(at(1), &settled()), Action::Wait(at(60)));
    }

    #[test]
    fn a_settled_secret_waits_for_the_first_renewal() {
        let facts = settled();
        assert_eq!(next(at(10), &facts), Action::Wait(at(60)));
        assert_eq!(next(at(60), &facts), Action::Issue, "leaf at 2/3");
        // The CA is renewed at 2/3 of its own life, whatever the leaf.
        let mut late = facts.clone();
        late.leaf = Some(Leaf {
            window: window(590, 680),
            issuer: Issuer::Current,
            names_match: true,
        });
        assert_eq!(next(at(599), &late), Action::Wait(at(600)));
        assert_eq!(next(at(600), &late), Action::NewCa);
        assert_eq!(next(at(950), &late), Action::NewCa, "expired CA");
    }

    #[test]
    fn a_missing_or_unusable_ca_is_replaced() {
        let mut facts = settled();
        facts.ca = None; // ca.key missing, or matching no certificate of the bundle
        assert_eq!(next(at(10), &facts), Action::NewCa);
    }

    #[test]
    fn after_a_ca_rotation_the_new_ca_is_published_before_it_signs_anything() {
        // The old CA (0-900) was rotated at 600: the new one (600-1500) heads the bundle.
        let rotated = Facts {
            ca: Some(window(600, 1500)),
            bundle: vec![window(600, 1500), window(0, 900)],
            published: false,
            leaf: Some(Leaf {
                window: window(590, 680),
                issuer: Issuer::Previous,
                names_match: true,
            }),
        };
        assert_eq!(next(at(601), &rotated), Action::Publish);
        let published = Facts {
            published: true,
            ..rotated.clone()
        };
        // Grace: min(15 min, 900 s / 6) = 150 s after the new CA's notBefore, so until 750;
        // but the previous leaf runs out at 680, and is then replaced at once.
        assert_eq!(next(at(601), &published), Action::Wait(at(680)));
        assert_eq!(next(at(680), &published), Action::Issue);
        let long_leaf = Facts {
            leaf: Some(Leaf {
                window: window(590, 890),
                issuer: Issuer::Previous,
                names_match: true,
            }),
            ..published.clone()
        };
        assert_eq!(next(at(700), &long_leaf), Action::Wait(at(750)));
        assert_eq!(next(at(750), &long_leaf), Action::Issue, "after the grace");
        // The previous CA stays in the bundle until it expires, then goes.
        let mut settled_again = long_leaf.clone();
        settled_again.leaf = Some(Leaf {
            window: window(750, 840),
            issuer: Issuer::Current,
            names_match: true,
        });
        assert_eq!(next(at(800), &settled_again), Action::Wait(at(810)));
        settled_again.leaf.as_mut().unwrap().window = window(800, 890);
        assert_eq!(next(at(801), &settled_again), Action::Wait(at(860)));
        settled_again.leaf.as_mut().unwrap().window = window(880, 970);
        assert_eq!(next(at(881), &settled_again), Action::Wait(at(900)));
        assert_eq!(next(at(900), &settled_again), Action::Prune);
    }

    #[test]
    fn a_certificate_clients_cannot_verify_or_for_other_names_is_replaced_at_once() {
        for leaf in [
            Leaf {
                window: window(0, 90),
                issuer: Issuer::Unknown,
                names_match: true,
            },
            Leaf {
                window: window(0, 90),
                issuer: Issuer::Current,
                names_match: false,
            },
            Leaf {
                window: window(0, 9),
                issuer: Issuer::Current,
                names_match: true,
            },
        ] {
            let facts = Facts {
                leaf: Some(leaf),
                ..settled()
            };
            assert_eq!(next(at(10), &facts), Action::Issue, "{leaf:?}");
        }
    }

    #[test]
    fn nothing_is_issued_from_an_unpublished_bundle() {
        for leaf in [None, settled().leaf] {
            let facts = Facts {
                published: false,
                leaf,
                ..settled()
            };
            assert_eq!(next(at(70), &facts), Action::Publish);
        }
    }
}
