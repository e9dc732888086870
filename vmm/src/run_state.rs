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
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut g = self.outcome.lock().unwrap_or_else(|p| p.into_inner());
        while g.is_none() {
            match deadline {
                None => g = self.cv.wait(g).unwrap_or_else(|p| p.into_inner()),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return None;
                    }
                    g = self
                        .cv
                        .wait_timeout(g, d - now)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
            }
        }
        g.clone()
    }

    /// Records a `vessel-event: NAME` line from the guest console.
    pub fn event(&self, name: String, at: Instant) {
        tracing::debug!(%name, "guest event");
        self.events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((name, at));
        self.cv.notify_all();
    }

    pub fn events(&self) -> Vec<(String, Instant)> {
        self.events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}
