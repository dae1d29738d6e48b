//! Ctrl-C, SIGTERM and SIGHUP while a benchmark runs.
//!
//! The handler only counts signals; every wait loop polls [`check`], unwinds with
//! [`Interrupted`], and the guards on the way out kill the children, remove the namespaces and
//! clean the remote nodes. Children run in their own process groups, so the terminal's Ctrl-C
//! reaches xtask alone and teardown stays in our hands. A third signal abandons the teardown.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Once;

use anyhow::Result;

static SIGNALS: AtomicUsize = AtomicUsize::new(0);
static INSTALL: Once = Once::new();

/// The error a wait loop returns when the user interrupted the run (exit status 130).
#[derive(Debug)]
pub struct Interrupted;

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("interrupted; everything this run started has been torn down")
    }
}

impl std::error::Error for Interrupted {}

/// Installs the handler (once per process).
pub fn install() -> Result<()> {
    let mut result = Ok(());
    INSTALL.call_once(|| {
        result = ctrlc::set_handler(|| {
            let n = SIGNALS.fetch_add(1, Ordering::SeqCst) + 1;
            if n == 1 {
                eprintln!(
                    "\nxtask: interrupted; tearing down (press Ctrl-C twice more to abandon)"
                );
            } else if n >= 3 {
                eprintln!(
                    "xtask: teardown abandoned; look for leftovers with `ip netns list | grep \
                     tcpx-` and `pgrep -a tcpx-bench` (here and on the nodes)"
                );
                std::process::exit(130);
            }
        });
    });
    result.map_err(|e| anyhow::anyhow!("cannot install the Ctrl-C handler: {e}"))
}

/// Whether a signal arrived.
pub fn requested() -> bool {
    SIGNALS.load(Ordering::SeqCst) > 0
}

/// Fails with [`Interrupted`] once a signal arrived.
pub fn check() -> Result<()> {
    if requested() {
        return Err(Interrupted.into());
    }
    Ok(())
}
