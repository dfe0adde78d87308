//! `vllm-sim` binary: parse flags, bind one port (or `--fleet N` consecutive ones), serve.

use std::process::ExitCode;

use clap::Parser;
use tokio::net::TcpListener;
use tokio::sync::watch;
use vllm_sim::SimConfig;

#[tokio::main]
async fn main() -> ExitCode {
    let config = SimConfig::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    if let Err(e) = config.validate() {
        eprintln!("vllm-sim: {e}");
        return ExitCode::from(2);
    }
    match run(config).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("vllm-sim: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Ctrl-C, or SIGTERM (what `docker stop` sends to a container's first process, which has no
/// default action for it).
async fn stop_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}

/// Port `base + i`, or 0 (any free port) when `base` is 0.
fn nth_port(base: u16, i: usize) -> std::io::Result<u16> {
    if base == 0 {
        return Ok(0);
    }
    u16::try_from(usize::from(base) + i)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "port out of range"))
}

async fn run(config: SimConfig) -> std::io::Result<()> {
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut servers = Vec::new();
    for i in 0..config.fleet {
        let mut c = config.clone();
        c.port = nth_port(config.port, i)?;
        c.admin_port = config.admin_port.map(|p| nth_port(p, i)).transpose()?;
        c.kv_events_config = config.kv_events_config.as_ref().map(|k| k.offset_ports(i));
        let listener = TcpListener::bind((c.host.as_str(), c.port)).await?;
        let addr = listener.local_addr()?;
        let admin = match c.admin_port {
            Some(p) => Some(TcpListener::bind((c.host.as_str(), p)).await?),
            None => None,
        };
        let mut line = format!("http://{addr}");
        if let Some(a) = admin.as_ref().map(TcpListener::local_addr).transpose()? {
            line.push_str(&format!(" admin=http://{a}"));
        }
        let mut rx = stop_rx.clone();
        let sim = vllm_sim::Sim::build(c, addr).await?;
        if let Some(ep) = sim.kv_events_endpoint() {
            line.push_str(&format!(" kv_events={ep}"));
        }
        println!("{line}");
        servers.push(tokio::spawn(sim.run(listener, admin, async move {
            let _ = rx.changed().await;
        })));
    }
    tracing::info!(
        servers = config.fleet,
        model = %config.model_names()[0],
        time_scale = config.time_scale,
        "vllm-sim ready; Ctrl-C stops"
    );
    stop_signal().await;
    let _ = stop_tx.send(true);
    for s in servers {
        if let Ok(Err(e)) = s.await {
            eprintln!("vllm-sim: {e}");
        }
    }
    Ok(())
}
