//! The TCPX plugin's own core bindings (`NCCL_GPUDIRECTTCPX_TX_BINDINGS` /
//! `RX_BINDINGS`, e.g. `"eth1:8-21,112-125;eth2:8-21,112-125"`): cores the plugin pins its
//! threads to, which our progress threads must leave alone.

use std::collections::{BTreeMap, BTreeSet};

use crate::TopoError;

/// Parsed bindings: NIC name → the cores the plugin binds for it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Bindings {
    /// Cores per NIC name.
    pub per_nic: BTreeMap<String, BTreeSet<usize>>,
}

impl Bindings {
    /// Parses `nic:cpulist[;nic:cpulist…]`; `var` names the variable in errors. Empty
    /// entries (a trailing `;`) are ignored.
    pub fn parse(var: &str, input: &str) -> Result<Self, TopoError> {
        let malformed = |detail: String| TopoError::Malformed {
            var: var.to_owned(),
            input: input.to_owned(),
            detail,
        };
        let mut per_nic: BTreeMap<String, BTreeSet<usize>> = BTreeMap::new();
        for (n, entry) in input.split(';').enumerate() {
            let entry = entry.trim();
            if entry.is_empty() {
                continue;
            }
            let (nic, list) = entry.split_once(':').ok_or_else(|| {
                malformed(format!(
                    "entry {} ({entry:?}) has no ':' between NIC and cores",
                    n + 1
                ))
            })?;
            let nic = nic.trim();
            if nic.is_empty() {
                return Err(malformed(format!(
                    "entry {} ({entry:?}) has an empty NIC name",
                    n + 1
                )));
            }
            let cores = parse_cpu_list(list)
                .map_err(|e| malformed(format!("entry {} ({entry:?}): {e}", n + 1)))?;
            per_nic.entry(nic.to_owned()).or_default().extend(cores);
        }
        Ok(Self { per_nic })
    }

    /// Every core bound for any NIC.
    pub fn all_cores(&self) -> BTreeSet<usize> {
        self.per_nic.values().flatten().copied().collect()
    }
}

/// Upper bound on a core index, so that `0-99999999999` cannot make us allocate the world.
const MAX_CPU: usize = 1 << 20;

/// Parses a Linux cpu list (`8-21,112-125`, `3`, `0-3,7`).
pub(crate) fn parse_cpu_list(list: &str) -> Result<BTreeSet<usize>, String> {
    let mut cores = BTreeSet::new();
    for part in list.split(',') {
        let part = part.trim();
        if part.is_empty() {
            return Err("empty item in the core list".to_owned());
        }
        let number = |s: &str| -> Result<usize, String> {
            let v: usize = s
                .trim()
                .parse()
                .map_err(|_| format!("{s:?} is not a core number"))?;
            if v > MAX_CPU {
                return Err(format!("core {v} is beyond {MAX_CPU}"));
            }
            Ok(v)
        };
        match part.split_once('-') {
            Some((lo, hi)) => {
                let (lo, hi) = (number(lo)?, number(hi)?);
                if lo > hi {
                    return Err(format!("range {part:?} runs backwards"));
                }
                cores.extend(lo..=hi);
            }
            None => {
                cores.insert(number(part)?);
            }
        }
    }
    Ok(cores)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_googles_a3_bindings() {
        let b = Bindings::parse(
            "TX",
            "eth1:8-21,112-125;eth2:8-21,112-125;eth3:60-73,164-177;eth4:60-73,164-177",
        )
        .unwrap();
        assert_eq!(b.per_nic.len(), 4);
        assert_eq!(b.per_nic["eth1"].len(), 28);
        assert!(b.per_nic["eth3"].contains(&164));
        assert_eq!(b.all_cores().len(), 56);
    }

    #[test]
    fn malformed_bindings_name_the_variable_and_entry() {
        for bad in [
            "eth1",
            "eth1:",
            ":1-2",
            "eth1:5-2",
            "eth1:a",
            "eth1:1,,2",
            "eth1:1-99999999",
        ] {
            let err = Bindings::parse("NCCL_GPUDIRECTTCPX_TX_BINDINGS", bad)
                .unwrap_err()
                .to_string();
            assert!(err.contains("NCCL_GPUDIRECTTCPX_TX_BINDINGS"), "{err}");
            assert!(err.contains("entry 1"), "{err}");
        }
    }
}
