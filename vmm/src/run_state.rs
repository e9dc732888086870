//! A VM's run state, shared by the vCPU threads, the devices that can end the VM (the
//! i8042 reset line, the console's panic and power-off markers) and the VMM's owner: how the
//! guest ended, whether it is stopping, and the events the guest reported. Devices get this
//! small type, not the VM, so `devices` does not depend on `vm`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// How the guest ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", tag = "outcome", content = "detail")]
pub enum Outcome {
    /// The guest powered off (or halted).
    Poweroff,
    /// The guest asked for a reset (i8042 reset, triple fault).
    Reboot,
    /// The guest kernel panicked.
    Panic,
    /// The VMM stopped the guest (a stop request).
    Stopped,
    /// The VMM failed while running the guest.
    Error(String),
}

/// Shared run state: the outcome (first one wins), the stop flag and guest-reported events.
#[derive(Default)]
pub struct Control {
    outcome: Mutex<Option<Outcome>>,
    cv: Condvar,
    stopping: AtomicBool,
    events: Mutex<Vec<(String, Instant)>>,
}

impl Control {
    /// Records the outcome if none was recorded yet and wakes waiters.
    pub fn finish(&self, o: Outcome) {
        let mut g = self.outcome.lock().unwrap_or_else(|p| p.into_inner());
        if g.is_none() {
            tracing::debug!(?o, "guest outcome");
            *g = Some(o);
        }
        self.stopping.store(true, Ordering::SeqCst);
        self.cv.notify_all();
    }

    pub fn outcome(&self) -> Option<Outcome> {
        self.outcome
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub fn stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }

    /// Waits for the outcome, at most `timeout` if given.
    pub fn wait(&self, timeout: Option<Duration>) -> Option<Outcome> {
        self.wait_until(timeout.map(|t| Instant::now() + t), |o| o.clone())
    }

    /// Waits under the outcome's lock until `check` (given the outcome so far) says `Some`,
    /// or `deadline` passes (`None`). Whatever can change `check`'s answer notifies the
    /// condvar under that lock, so no wake-up is lost between a check and the wait.
    fn wait_until<T>(
        &self,
        deadline: Option<Instant>,
        mut check: impl FnMut(&Option<Outcome>) -> Option<T>,
    ) -> Option<T> {
        let mut g = self.outcome.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(v) = check(&g) {
                return Some(v);
            }
            g = match deadline {
                None => self.cv.wait(g).unwrap_or_else(|p| p.into_inner()),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return None;
                    }
                    self.cv
                        .wait_timeout(g, d - now)
                        .unwrap_or_else(|p| p.into_inner())
                        .0
                }
            };
        }
    }

    /// Records a `vessel-event: NAME` line from the guest console (the first
    /// [`MAX_EVENTS`]: the guest writes these lines, and must not grow the VMM's memory).
    pub fn event(&self, name: String, at: Instant) {
        tracing::debug!(%name, "guest event");
        {
            let mut ev = self.events.lock().unwrap_or_else(|p| p.into_inner());
            if ev.len() >= MAX_EVENTS {
                return;
            }
            ev.push((name, at));
        }
        // Through the outcome's lock, which [`Control::wait_until`] holds from its look at
        // the events to its wait: the wake-up cannot fall between the two.
        drop(self.outcome.lock().unwrap_or_else(|p| p.into_inner()));
        self.cv.notify_all();
    }

    pub fn events(&self) -> Vec<(String, Instant)> {
        self.events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Waits until the guest has reported event `name` (already or within `timeout`).
    pub fn wait_event(&self, name: &str, timeout: Duration) -> Result<(), EventWait> {
        self.wait_until(Some(Instant::now() + timeout), |outcome| {
            let seen = self
                .events
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .any(|(n, _)| n == name);
            if seen {
                Some(Ok(()))
            } else {
                outcome.clone().map(|o| Err(EventWait::Ended(o)))
            }
        })
        .unwrap_or(Err(EventWait::TimedOut))
    }
}

/// The most guest events kept (boot milestones; a handful in practice).
pub const MAX_EVENTS: usize = 64;

/// Why [`Control::wait_event`] returned without the event.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EventWait {
    #[error("the guest ended ({0:?}) before reporting it")]
    Ended(Outcome),
    #[error("the guest did not report it in time")]
    TimedOut,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn wait_event_sees_past_and_later_events_and_the_end() {
        let c = Arc::new(Control::default());
        assert_eq!(
            c.wait_event("ready", Duration::from_millis(20)),
            Err(EventWait::TimedOut)
        );
        let c2 = c.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            c2.event("ready".into(), Instant::now());
        });
        assert_eq!(c.wait_event("ready", Duration::from_secs(10)), Ok(()));
        t.join().unwrap();
        // Already seen: at once.
        assert_eq!(c.wait_event("ready", Duration::ZERO), Ok(()));
        c.finish(Outcome::Poweroff);
        assert_eq!(
            c.wait_event("other", Duration::from_secs(10)),
            Err(EventWait::Ended(Outcome::Poweroff))
        );
    }

    #[test]
    fn events_are_bounded() {
        let c = Control::default();
        for i in 0..MAX_EVENTS + 10 {
            c.event(format!("e{i}"), Instant::now());
        }
        assert_eq!(c.events().len(), MAX_EVENTS);
    }
}
