//! What a benchmark's options ask of the process, checked before anything is opened: a
//! `--channels` that multiplies sockets past the open-file limit, or buffers past the memory
//! available, is refused with one line naming the option and the limit, instead of running
//! into `EMFILE` or the OOM killer half-way through a set-up.
//!
//! The figures are lower bounds of what a run needs, so a refusal is always right; a run that
//! passes may still need a little more than counted (the plugin's own threads and files).

/// File descriptors every run needs beyond its data sockets: stdio, control connections and
/// listeners, the loaded libraries, logging.
pub const RESERVED_FDS: u64 = 64;

/// Most data sockets a plugin comm opens (TCPX's limit, and tcpx-socket's).
const MAX_SOCKETS_PER_COMM: u64 = 8;

/// What a benchmark mode will open and allocate in this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Demand {
    /// The option that sets the channel count, as typed (`--channels 10000`).
    pub channels_option: String,
    /// Endpoints in this process: 2 when both ends run here (`stack`, `onesided`,
    /// `latency`), 1 for `server` / `client`.
    pub sides: u64,
    /// Channels per connection (`--channels`). Every connection also opens as many
    /// one-sided channels, each with a send and a receive comm.
    pub channels: u64,
    /// Raw-TCP baseline connections per endpoint in this process (0 without a baseline).
    pub baseline_streams: u64,
    /// The option that sets the memory figure, as typed (`--sizes 1GiB`).
    pub memory_option: String,
    /// Bytes of host memory the run holds at once (message buffers, staging rings).
    pub memory_bytes: u64,
}

impl Demand {
    /// `sides` endpoints in this process with `channels` channels each, the count set by
    /// `option` (as typed: `--channels 4`); no baseline and no memory counted yet.
    pub fn channels(option: impl Into<String>, sides: u64, channels: u64) -> Demand {
        Demand {
            channels_option: option.into(),
            sides,
            channels,
            baseline_streams: 0,
            memory_option: String::new(),
            memory_bytes: 0,
        }
    }

    /// With `streams` raw-TCP baseline connections per endpoint.
    pub fn baseline(self, streams: u64) -> Demand {
        Demand {
            baseline_streams: streams,
            ..self
        }
    }

    /// With `bytes` of host memory held at once, the figure set by `option` (as typed).
    pub fn memory(self, option: impl Into<String>, bytes: u64) -> Demand {
        Demand {
            memory_option: option.into(),
            memory_bytes: bytes,
            ..self
        }
    }

    /// File descriptors the run needs at least: per endpoint, 2 × channels (two-sided and
    /// one-sided) × 2 comms (send, receive) × (data sockets per comm + the channel's
    /// listener), plus the baseline's streams and [`RESERVED_FDS`].
    pub fn fds(&self, sockets_per_comm: u64) -> u64 {
        let per_comm = sockets_per_comm.saturating_add(1);
        self.sides
            .saturating_mul(self.channels)
            .saturating_mul(2 * 2)
            .saturating_mul(per_comm)
            .saturating_add(self.sides.saturating_mul(self.baseline_streams))
            .saturating_add(RESERVED_FDS)
    }

    /// Refuses a demand over `limits`, with one line naming the option and the limit.
    pub fn check_against(&self, limits: &Limits) -> Result<(), String> {
        if let Some((soft, hard)) = limits.open_files {
            let needed = self.fds(limits.sockets_per_comm);
            if needed > soft {
                return Err(format!(
                    "{}: needs at least {needed} open files ({} endpoint(s) × {} channels \
                     × 2 for one-sided × 2 comms × ({} sockets + 1 listener), plus {} baseline \
                     streams and {RESERVED_FDS} reserved), over this process's limit of {soft} \
                     (RLIMIT_NOFILE; hard limit {}: raise it with `ulimit -n`, or use fewer \
                     channels)",
                    self.channels_option,
                    self.sides,
                    self.channels,
                    limits.sockets_per_comm,
                    self.sides.saturating_mul(self.baseline_streams),
                    if hard == u64::MAX {
                        "unlimited".to_string()
                    } else {
                        hard.to_string()
                    },
                ));
            }
        }
        if let Some(available) = limits.memory_available {
            if self.memory_bytes > available {
                return Err(format!(
                    "{}: needs at least {} bytes of host memory, more than the {available} \
                     available (MemAvailable in /proc/meminfo)",
                    self.memory_option, self.memory_bytes
                ));
            }
        }
        Ok(())
    }

    /// Refuses a demand over what this process can open and allocate now
    /// ([`Limits::current`]).
    pub fn check(&self) -> Result<(), String> {
        self.check_against(&Limits::current())
    }
}

/// Pinned host staging the engines hold when GPU memory goes through a host-memory plugin:
/// per endpoint and two-sided channel, a send ring of 2 × window chunks and a receive ring of
/// window chunks (one-sided channels not counted: a lower bound).
pub fn staging_bytes(sides: u64, channels: u64, window: u64, chunk: u64) -> u64 {
    sides
        .saturating_mul(channels)
        .saturating_mul(3)
        .saturating_mul(window)
        .saturating_mul(chunk)
}

/// What the process may open and allocate; `None` where it cannot be read (then that part is
/// not checked).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// `RLIMIT_NOFILE` as (soft, hard); `u64::MAX` for unlimited.
    pub open_files: Option<(u64, u64)>,
    /// `MemAvailable` from `/proc/meminfo`, in bytes.
    pub memory_available: Option<u64>,
    /// Data sockets per plugin comm this process's environment asks for.
    pub sockets_per_comm: u64,
}

impl Limits {
    /// The limits of this process now.
    pub fn current() -> Limits {
        Limits {
            open_files: open_file_limit(),
            memory_available: std::fs::read_to_string("/proc/meminfo")
                .ok()
                .and_then(|text| mem_available(&text)),
            sockets_per_comm: sockets_per_comm(|name| std::env::var(name).ok()),
        }
    }
}

/// `RLIMIT_NOFILE` as (soft, hard).
fn open_file_limit() -> Option<(u64, u64)> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `limit` is a valid, writable `rlimit` for the call's duration; getrlimit only
    // writes it.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) };
    let as_u64 = |v: libc::rlim_t| {
        if v == libc::RLIM_INFINITY {
            u64::MAX
        } else {
            v
        }
    };
    (rc == 0).then(|| (as_u64(limit.rlim_cur), as_u64(limit.rlim_max)))
}

/// `MemAvailable` of a `/proc/meminfo` text, in bytes.
fn mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?;
    let kib: u64 = line.trim().strip_suffix("kB")?.trim().parse().ok()?;
    kib.checked_mul(1024)
}

/// Data sockets per comm as the socket plugin reads them: `TCPX_SOCKET_NSOCKS`, else
/// `NCCL_NSOCKS_PERTHREAD × NCCL_SOCKET_NTHREADS` when either is set (the other counting as
/// 1), else 1; clamped to 1..=8. Unparsable values count as unset, as in the plugin.
fn sockets_per_comm(var: impl Fn(&str) -> Option<String>) -> u64 {
    let num = |name: &str| var(name).and_then(|v| v.trim().parse::<u64>().ok());
    let n = num("TCPX_SOCKET_NSOCKS").unwrap_or_else(|| {
        match (num("NCCL_NSOCKS_PERTHREAD"), num("NCCL_SOCKET_NTHREADS")) {
            (None, None) => 1,
            (p, t) => p.unwrap_or(1).saturating_mul(t.unwrap_or(1)),
        }
    });
    n.clamp(1, MAX_SOCKETS_PER_COMM)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn demand(sides: u64, channels: u64, baseline: u64, memory: u64) -> Demand {
        Demand {
            channels_option: format!("--channels {channels}"),
            sides,
            channels,
            baseline_streams: baseline,
            memory_option: "--sizes 1GiB".into(),
            memory_bytes: memory,
        }
    }

    fn limits(soft: u64, memory: u64) -> Limits {
        Limits {
            open_files: Some((soft, u64::MAX)),
            memory_available: Some(memory),
            sockets_per_comm: 1,
        }
    }

    #[test]
    fn file_count_multiplies_sides_channels_comms_and_sockets() {
        // 2 endpoints × 4 channels × 2 (one-sided) × 2 comms × (2 sockets + 1) + 2 × 4 + 64.
        assert_eq!(demand(2, 4, 4, 0).fds(2), 96 + 8 + 64);
        assert_eq!(demand(1, 1, 0, 0).fds(1), 8 + 64);
        assert_eq!(demand(u64::MAX, u64::MAX, 1, 0).fds(8), u64::MAX);
    }

    #[test]
    fn over_the_file_limit_is_one_line_naming_option_and_limit() {
        let d = demand(2, 10_000, 10_000, 0);
        let err = d.check_against(&limits(1024, u64::MAX)).unwrap_err();
        assert!(err.starts_with("--channels 10000: "), "{err}");
        assert!(
            err.contains("RLIMIT_NOFILE") && err.contains("1024"),
            "{err}"
        );
        assert!(err.contains(&d.fds(1).to_string()), "{err}");
        assert!(!err.contains('\n'), "{err}");
        assert!(demand(2, 4, 4, 0)
            .check_against(&limits(1024, u64::MAX))
            .is_ok());
    }

    #[test]
    fn over_available_memory_names_the_memory_option() {
        let err = demand(1, 1, 0, 2 << 30)
            .check_against(&limits(1024, 1 << 30))
            .unwrap_err();
        assert!(err.starts_with("--sizes 1GiB: "), "{err}");
        assert!(err.contains("MemAvailable"), "{err}");
        assert!(!err.contains('\n'), "{err}");
    }

    #[test]
    fn the_builder_and_staging_say_the_same_as_the_fields() {
        let d = Demand::channels("--channels 4", 2, 4)
            .baseline(4)
            .memory("--sizes 1GiB", 7);
        assert_eq!(
            d,
            Demand {
                channels_option: "--channels 4".into(),
                sides: 2,
                channels: 4,
                baseline_streams: 4,
                memory_option: "--sizes 1GiB".into(),
                memory_bytes: 7,
            }
        );
        assert_eq!(
            staging_bytes(2, 4, 16, 512 << 10),
            2 * 4 * 3 * 16 * (512 << 10)
        );
        assert_eq!(staging_bytes(2, u64::MAX, 16, 1), u64::MAX);
    }

    #[test]
    fn unreadable_limits_are_not_checked() {
        let none = Limits {
            open_files: None,
            memory_available: None,
            sockets_per_comm: 8,
        };
        assert!(demand(2, 60_000, 0, u64::MAX).check_against(&none).is_ok());
    }

    #[test]
    fn meminfo_and_socket_counts_parse_as_the_plugin_reads_them() {
        let text = "MemTotal:       16 kB\nMemAvailable:    1234 kB\n";
        assert_eq!(mem_available(text), Some(1234 * 1024));
        assert_eq!(mem_available("MemTotal: 1 kB\n"), None);
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| v.to_string())
            }
        };
        assert_eq!(sockets_per_comm(env(&[])), 1);
        assert_eq!(sockets_per_comm(env(&[("TCPX_SOCKET_NSOCKS", "4")])), 4);
        assert_eq!(sockets_per_comm(env(&[("TCPX_SOCKET_NSOCKS", "99")])), 8);
        assert_eq!(sockets_per_comm(env(&[("NCCL_NSOCKS_PERTHREAD", "2")])), 2);
        assert_eq!(
            sockets_per_comm(env(&[
                ("NCCL_NSOCKS_PERTHREAD", "2"),
                ("NCCL_SOCKET_NTHREADS", "3")
            ])),
            6
        );
        assert_eq!(sockets_per_comm(env(&[("TCPX_SOCKET_NSOCKS", "x")])), 1);
    }

    #[test]
    fn this_process_has_readable_limits() {
        let l = Limits::current();
        let (soft, hard) = l.open_files.expect("getrlimit works on Linux");
        assert!(soft >= 1 && soft <= hard, "{l:?}");
        assert!((1..=8).contains(&l.sockets_per_comm));
    }
}
