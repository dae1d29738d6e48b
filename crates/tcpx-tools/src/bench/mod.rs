//! Benchmark building blocks.

pub mod baseline;
pub mod control;
pub mod failure;
pub mod kv;
pub mod latency;
pub mod limits;
pub mod live;
pub mod onesided;
pub mod overhead;
pub mod pair;
pub mod rawtcp;
pub mod rendezvous;
pub mod report;
pub mod safe_layer;
pub mod sizes;
pub mod stack;
pub mod stats;
