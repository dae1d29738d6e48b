//! Shared code of the `tcpx-bench` and `tcpx-info` binaries: size parsing, the raw-TCP baseline,
//! the measured paths and the report (table for people, JSON lines for machines).

pub mod bench;
pub mod cores;
pub mod logging;
