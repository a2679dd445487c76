//! Steps of a world's setup that every rank of this process takes at once.

use crate::error::{Error, Result};

/// Runs `f` on every item at once, one thread each (each step of a world's setup waits for
/// the other ranks, so this process's ranks must take it together); the results in order,
/// or the first error.
pub(super) fn on_each<I: Send, T: Send>(
    items: Vec<I>,
    f: impl Fn(I) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    let f = &f;
    std::thread::scope(|s| {
        let handles: Vec<_> = items
            .into_iter()
            .map(|x| {
                crate::counters::thread_spawned();
                s.spawn(move || f(x))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::World("a setup thread panicked".into())))
            })
            .collect()
    })
}
