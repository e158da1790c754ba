//! Wall-clock time per model part, for `bench --profile`: off by default (one relaxed atomic
//! load per scope), and only meaningful on synchronous backends (Flex, LibTorch CPU), where an
//! op has finished when it returns.
//!
//! Scopes nest (`dsa` includes `indexer`); a report lists each scope's total and call count.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

static ENABLED: AtomicBool = AtomicBool::new(false);
static TOTALS: Mutex<BTreeMap<&'static str, (Duration, u64)>> = Mutex::new(BTreeMap::new());

/// Turn timing on or off (off: scopes cost one atomic load).
pub fn enable(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Clear the totals.
pub fn reset() {
    if let Ok(mut t) = TOTALS.lock() {
        t.clear();
    }
}

/// `(scope, total, calls)`, by scope name.
pub fn report() -> Vec<(&'static str, Duration, u64)> {
    TOTALS.lock().map(|t| t.iter().map(|(k, (d, n))| (*k, *d, *n)).collect()).unwrap_or_default()
}

/// Times its lifetime into `name` when profiling is on.
pub struct Scope {
    name: &'static str,
    start: Option<Instant>,
}

/// Start a scope: `let _t = profile::scope("kda");`.
pub fn scope(name: &'static str) -> Scope {
    Scope { name, start: ENABLED.load(Ordering::Relaxed).then(Instant::now) }
}

impl Drop for Scope {
    fn drop(&mut self) {
        if let Some(s) = self.start {
            if let Ok(mut t) = TOTALS.lock() {
                let e = t.entry(self.name).or_default();
                e.0 += s.elapsed();
                e.1 += 1;
            }
        }
    }
}
