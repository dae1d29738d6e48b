//! `tracing` set-up shared by the binaries: `RUST_LOG` (or `TCPX_LOG`) filters, stderr output.

/// Installs a stderr subscriber; `default` is the filter when neither variable is set.
pub fn init(default: &str) {
    let filter = std::env::var("TCPX_LOG")
        .or_else(|_| std::env::var("RUST_LOG"))
        .unwrap_or_else(|_| default.to_string());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_writer(std::io::stderr)
        .try_init();
}
