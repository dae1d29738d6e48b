//! Benchmark building blocks.

pub mod baseline;
pub mod latency;
pub mod limits;
pub mod onesided;
pub mod overhead;
pub mod pair;
pub mod report;
pub mod safe_layer;
pub mod sizes;
pub mod stack;
pub mod stats;
