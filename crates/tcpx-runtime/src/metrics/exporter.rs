//! The opt-in Prometheus exporter: `tiny_http` on a thread of its own answering
//! `GET /metrics` with a fresh snapshot. Dropping the [`Exporter`] stops the thread (the
//! server is unblocked and the thread joined), so it ends with its endpoint.

use std::net::SocketAddr;
use std::sync::Arc;
use std::thread::JoinHandle;

use tiny_http::{Header, Response, Server};

use crate::error::{Error, Result};

/// What a scrape answers: the exposition text, or `None` once the endpoint is gone.
pub(crate) type Render = Box<dyn Fn() -> Option<String> + Send>;

/// A running exporter.
pub(crate) struct Exporter {
    server: Arc<Server>,
    addr: SocketAddr,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Exporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Exporter")
            .field("addr", &self.addr)
            .finish()
    }
}

/// The content type of the OpenMetrics text `prometheus-client` writes.
const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

impl Exporter {
    /// Binds `addr` and serves `render` until dropped.
    pub(crate) fn start(addr: SocketAddr, render: Render) -> Result<Self> {
        let server = Server::http(addr).map_err(|e| {
            Error::Config(format!(
                "cannot serve metrics on {addr} (TCPX_METRICS_ADDR): {e}"
            ))
        })?;
        let bound = server
            .server_addr()
            .to_ip()
            .ok_or_else(|| Error::Internal("the metrics server has no IP address".into()))?;
        let server = Arc::new(server);
        let serving = server.clone();
        let thread = std::thread::Builder::new()
            .name("tcpx-metrics".into())
            .spawn(move || serve(&serving, &render))
            .map_err(|e| Error::Internal(format!("cannot start the metrics thread: {e}")))?;
        tracing::info!(target: "tcpx_runtime", addr = %bound, "serving Prometheus metrics at /metrics");
        Ok(Self {
            server,
            addr: bound,
            thread: Some(thread),
        })
    }

    /// The address it listens on.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }
}

fn serve(server: &Server, render: &Render) {
    // `incoming_requests` ends when the server is unblocked (drop).
    for request in server.incoming_requests() {
        let path = request.url().split('?').next().unwrap_or_default();
        let response = match (request.method(), path) {
            (tiny_http::Method::Get, "/metrics") => match render() {
                Some(text) => Response::from_string(text).with_header(header(CONTENT_TYPE)),
                None => Response::from_string("endpoint closed\n").with_status_code(503),
            },
            (tiny_http::Method::Get, "/") => {
                Response::from_string("tcpx endpoint: metrics at /metrics\n")
            }
            _ => Response::from_string("not found: metrics are at GET /metrics\n")
                .with_status_code(404),
        };
        if let Err(e) = request.respond(response) {
            tracing::debug!(target: "tcpx_runtime", error = %e, "metrics scrape: client went away");
        }
    }
}

fn header(content_type: &str) -> Header {
    Header::from_bytes("Content-Type", content_type)
        .unwrap_or_else(|()| Header::from_bytes("Content-Type", "text/plain").expect("ASCII"))
}

impl Drop for Exporter {
    fn drop(&mut self) {
        self.server.unblock();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
