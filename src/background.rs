//! Background loops off the request path.

use std::future::Future;

/// Run `loops()` on a thread of its own (named `thread_name`) with a single-threaded tokio
/// runtime, so its work never queues behind (or in front of) request handling on the main
/// runtime. If that thread or runtime cannot be started, `loops()` runs on the current runtime
/// instead, with a warning naming `what`.
pub fn spawn_on_own_thread<F, Fut>(thread_name: &str, what: &str, loops: F)
where
    F: FnOnce() -> Fut + Clone + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build();
    let started = runtime.and_then(|rt| {
        let loops = loops.clone();
        std::thread::Builder::new()
            .name(thread_name.into())
            .spawn(move || rt.block_on(async move { loops().await }))
    });
    if let Err(e) = started {
        tracing::warn!(error = %e, "no {what} thread; running it on the main runtime");
        tokio::spawn(async move { loops().await });
    }
}
