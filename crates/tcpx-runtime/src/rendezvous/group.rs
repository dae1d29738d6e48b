//! The group form: `world` endpoints meet under a job key, and each gets a connection to
//! every other.
//!
//! Keys, relative to the store's prefix:
//! - `<job>/rank/<r>`: rank r's metadata, put first, deleted by rank r once every lower rank
//!   has connected (they are the only readers);
//! - `<job>/link/<s>/<addr>`: put by the rank that connected to rank s from control address
//!   `addr`, holding its rank; read and deleted by rank s, which sees `addr` as the accepted
//!   connection's peer.
//!
//! Deadlock-free by construction: each rank connects only to higher ranks (in increasing
//! order) and accepts only from lower ones, on a thread of its own, so no cycle of waits can
//! form; rank 0 accepts nothing and rank world-1 connects to nothing.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::Store;
use crate::endpoint::{Connection, Endpoint};
use crate::error::{Error, Result};

/// How long one accept waits before checking whether the connecting side gave up.
const ACCEPT_SLICE: Duration = Duration::from_millis(200);

/// Largest group: ranks are announced as text and connections held per rank.
pub const MAX_WORLD: usize = 4096;

/// The outcome of [`Endpoint::rendezvous`]: a connection to every other rank of the job.
#[derive(Debug)]
pub struct Group {
    rank: usize,
    connections: Vec<Option<Connection>>,
}

impl Group {
    /// This endpoint's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn world(&self) -> usize {
        self.connections.len()
    }

    /// The connection to `rank` (`None` for this rank itself, for a rank out of range, or
    /// one already [taken](Self::take)).
    pub fn connection(&self, rank: usize) -> Option<&Connection> {
        self.connections.get(rank).and_then(Option::as_ref)
    }

    /// The rank at the other end of `connection` (by its peer address), if it is one of the
    /// group's.
    pub fn rank_of(&self, connection: &Connection) -> Option<usize> {
        let peer = connection.peer();
        self.connections
            .iter()
            .position(|c| c.as_ref().is_some_and(|c| c.peer() == peer))
    }

    /// Takes the connection to `rank` out of the group.
    pub fn take(&mut self, rank: usize) -> Option<Connection> {
        self.connections.get_mut(rank).and_then(Option::take)
    }

    /// Every connection, indexed by rank (`None` at this rank's own index).
    pub fn into_connections(self) -> Vec<Option<Connection>> {
        self.connections
    }
}

fn rank_key(job: &str, rank: usize) -> String {
    format!("{job}/rank/{rank}")
}

fn link_key(job: &str, to: usize, from: SocketAddr) -> String {
    format!("{job}/link/{to}/{from}")
}

impl Endpoint {
    /// Meets the other `world - 1` ranks of `job` through `store` and returns a connection
    /// to each ([`Group::connection`]`(rank)`), waiting at most `wait` in all for the others
    /// to arrive (each connection's set-up also has the configured timeout).
    ///
    /// Every rank calls this with the same `job` and `world` and its own `rank`. Rank r
    /// publishes itself under `<job>/rank/<r>`, connects to every higher rank and accepts
    /// from every lower one (concurrently); the keys it wrote are removed when it is done
    /// (and with the store's lease if it dies).
    pub fn rendezvous(
        &self,
        store: &dyn Store,
        job: &str,
        rank: usize,
        world: usize,
        wait: Duration,
    ) -> Result<Group> {
        if world == 0 || world > MAX_WORLD || rank >= world {
            return Err(Error::InvalidArgument(format!(
                "rendezvous of job {job:?}: rank {rank} of world {world} (need rank < world \
                 <= {MAX_WORLD})"
            )));
        }
        let deadline = Instant::now() + wait;
        let left = || deadline.saturating_duration_since(Instant::now());
        self.publish(store, &rank_key(job, rank))?;
        let span =
            tracing::info_span!(target: "tcpx_runtime::rendezvous", "rendezvous", job, rank, world);
        let _entered = span.enter();

        let give_up = AtomicBool::new(false);
        let (accepted, connected) = std::thread::scope(|scope| {
            let acceptor = std::thread::Builder::new()
                .name(format!("tcpx-rdv-accept-{rank}"))
                .spawn_scoped(scope, || {
                    let result = self.accept_lower(store, job, rank, deadline, &give_up);
                    if result.is_err() {
                        give_up.store(true, Ordering::Relaxed);
                    }
                    result
                });
            let connected = (|| {
                let mut out = Vec::with_capacity(world - rank - 1);
                for peer in rank + 1..world {
                    if give_up.load(Ordering::Relaxed) {
                        return Err(Error::Internal(format!(
                            "rendezvous of job {job:?}: rank {rank} stopped connecting: \
                             accepting from lower ranks failed"
                        )));
                    }
                    let conn = self.connect_by_name(store, &rank_key(job, peer), left())?;
                    let from = conn.local_control_addr()?;
                    store.put(&link_key(job, peer, from), rank.to_string().as_bytes())?;
                    tracing::debug!(target: "tcpx_runtime::rendezvous", job, rank, peer, "connected");
                    out.push(conn);
                }
                Ok(out)
            })();
            if connected.is_err() {
                give_up.store(true, Ordering::Relaxed);
            }
            let accepted = match acceptor {
                Ok(handle) => handle.join().unwrap_or_else(|_| {
                    Err(Error::Internal(
                        "the rendezvous accept thread panicked".into(),
                    ))
                }),
                Err(e) => Err(Error::Internal(format!(
                    "cannot start the rendezvous accept thread: {e}"
                ))),
            };
            (accepted, connected)
        });
        let outcome = match (accepted, connected) {
            (Ok(lower), Ok(higher)) => {
                let mut connections: Vec<Option<Connection>> = lower;
                connections.push(None);
                connections.extend(higher.into_iter().map(Some));
                Ok(Group { rank, connections })
            }
            // The first real cause: a connect phase that stopped because the accept phase
            // failed reports the accept phase's error.
            (Err(e), _) | (Ok(_), Err(e)) => {
                tracing::warn!(target: "tcpx_runtime::rendezvous", job, rank, world, error = %e, "rendezvous failed");
                Err(e)
            }
        };
        // Every lower rank has read our key (or the rendezvous failed): it is no use now.
        if let Err(e) = store.delete(&rank_key(job, rank)) {
            tracing::warn!(target: "tcpx_runtime::rendezvous", job, rank, error = %e, "cannot remove the rank's key; it expires with the store's lease");
        }
        outcome
    }

    /// Accepts one connection from each rank below `rank`, telling them apart by the link
    /// keys their connecting side writes. Returns them indexed by rank.
    fn accept_lower(
        &self,
        store: &dyn Store,
        job: &str,
        rank: usize,
        deadline: Instant,
        give_up: &AtomicBool,
    ) -> Result<Vec<Option<Connection>>> {
        let mut lower: Vec<Option<Connection>> = (0..rank).map(|_| None).collect();
        let mut missing = rank;
        while missing > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if give_up.load(Ordering::Relaxed) || left.is_zero() {
                let absent: Vec<usize> = (0..rank).filter(|&r| lower[r].is_none()).collect();
                let message = format!(
                    "rendezvous of job {job:?}: rank {rank} still waits for ranks {absent:?} \
                     to connect"
                );
                // The deadline passing is a timeout (bindings map it to their timeout
                // error); giving up because the connect phase failed is not.
                return Err(if left.is_zero() {
                    Error::Rendezvous {
                        message,
                        timed_out: true,
                    }
                } else {
                    Error::Internal(message)
                });
            }
            let conn = match self.accept_timeout(left.min(ACCEPT_SLICE)) {
                Ok(c) => c,
                Err(e) if e.is_timeout() => continue,
                Err(e) => return Err(e),
            };
            let key = link_key(job, rank, conn.peer());
            let left = deadline.saturating_duration_since(Instant::now());
            let value = store.get(&key, left)?;
            let _ = store.delete(&key);
            let from = std::str::from_utf8(&value)
                .ok()
                .and_then(|t| t.parse::<usize>().ok())
                .filter(|&r| r < rank && lower[r].is_none())
                .ok_or_else(|| {
                    Error::Internal(format!(
                        "rendezvous of job {job:?}: {key} holds {:?}, not a lower rank still \
                         expected",
                        String::from_utf8_lossy(&value)
                    ))
                })?;
            tracing::debug!(target: "tcpx_runtime::rendezvous", job, rank, peer = from, "accepted");
            lower[from] = Some(conn);
            missing -= 1;
        }
        Ok(lower)
    }
}
