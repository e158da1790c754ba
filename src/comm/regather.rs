//! What one FSDP parameter gather carries besides its tensors: the site ([`ParamGather`]: rows,
//! group, whether to reshard) and the forward's re-gather store ([`Regather`]) through which
//! the backward hands re-gathered weights to the ops that need them. The collective itself and
//! its adjoint are [`Glm5Backend::gather_param`](crate::ops::backend::Glm5Backend::gather_param);
//! the sharding of modules that uses them is [`crate::distributed::fsdp`].

use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use super::group::Group;

/// The re-gather bookkeeping of one forward/backward, shared by the gather ops (module docs).
/// Entries are backend-typed and stored type-erased: `open` holds the resharded parameters of
/// the units gathered since the last anchored gather, `ready` the tensors re-gathered in
/// backward until their view node takes them.
#[derive(Default)]
pub struct Regather {
    next_key: AtomicU64,
    /// Re-gathered tensors taken by their view (tests, diagnostics).
    used: AtomicU64,
    open: Mutex<Vec<Box<dyn Any + Send>>>,
    /// Re-gathers of resharded module constants (an FSDP-sharded FP8 base), run by the next
    /// anchored gather's backward after its parameters' re-gathers.
    open_tasks: Mutex<Vec<RegatherTask>>,
    ready: Mutex<HashMap<u64, Box<dyn Any + Send>>>,
}

/// A re-gather of something that is not a parameter (a resharded FP8 base's codes and
/// scales): it runs its collective and puts the result under its key ([`Regather::put_ready`]).
pub type RegatherTask = Box<dyn FnOnce() + Send>;

impl std::fmt::Debug for Regather {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Regather {{ open: {}, tasks: {}, ready: {} }}", lock(&self.open).len(), lock(&self.open_tasks).len(), lock(&self.ready).len())
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Regather {
    /// A key for a resharded parameter's view.
    pub fn key(&self) -> u64 {
        self.next_key.fetch_add(1, Ordering::Relaxed)
    }

    /// Record a resharded parameter of the unit being gathered.
    pub fn push_open<T: Any + Send>(&self, item: T) {
        lock(&self.open).push(Box::new(item));
    }

    /// The resharded parameters recorded since the last call, in forward order.
    pub fn take_open<T: Any + Send>(&self) -> Vec<T> {
        std::mem::take(&mut *lock(&self.open)).into_iter().filter_map(|b| b.downcast::<T>().ok().map(|b| *b)).collect()
    }

    /// Record the re-gather of a resharded constant of the unit being gathered (run in forward
    /// order by the next anchored gather's backward, like [`Self::push_open`]'s parameters).
    pub fn push_task(&self, task: RegatherTask) {
        lock(&self.open_tasks).push(task);
    }

    /// The constants' re-gathers recorded since the last call, in forward order.
    pub fn take_tasks(&self) -> Vec<RegatherTask> {
        std::mem::take(&mut *lock(&self.open_tasks))
    }

    /// Put a re-gathered tensor where its view will find it.
    pub fn put_ready<T: Any + Send>(&self, key: u64, tensor: T) {
        lock(&self.ready).insert(key, Box::new(tensor));
    }

    /// Take a re-gathered tensor for its view (`None`: not re-gathered yet, or already taken).
    pub fn take_ready<T: Any + Send>(&self, key: u64) -> Option<T> {
        let t = self.drop_ready(key);
        if t.is_some() {
            self.used.fetch_add(1, Ordering::Relaxed);
        }
        t
    }

    /// Remove a re-gathered tensor no view asked for.
    pub fn drop_ready<T: Any + Send>(&self, key: u64) -> Option<T> {
        lock(&self.ready).remove(&key).and_then(|b| b.downcast::<T>().ok()).map(|b| *b)
    }

    /// How many re-gathered tensors backward ops have used so far.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    /// Forget everything (a new forward).
    pub(crate) fn clear(&self) {
        lock(&self.open).clear();
        lock(&self.open_tasks).clear();
        lock(&self.ready).clear();
    }

    /// Number of re-gathered tensors waiting for their view (tests: 0 after a backward).
    pub fn pending(&self) -> usize {
        lock(&self.ready).len() + lock(&self.open).len() + lock(&self.open_tasks).len()
    }
}

/// What one parameter's gather needs besides its tensors ([`Glm5Backend::gather_param`](crate::ops::backend::Glm5Backend::gather_param)).
#[derive(Debug, Clone, Copy)]
pub struct ParamGather<'a> {
    /// The parameter's full dim-0 size (the gathered rows beyond it are padding).
    pub full_rows: usize,
    /// The group the parameter is sharded over.
    pub group: &'a Group,
    /// Free after the unit's forward and re-gather before its backward.
    pub reshard: bool,
    /// This gather is anchored on the unit's input activation: its backward re-gathers the
    /// resharded parameters of the units gathered before it.
    pub regather_before: bool,
    /// The forward's re-gather bookkeeping.
    pub regather: &'a Arc<Regather>,
}
