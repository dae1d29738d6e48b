//! The operator's GPU → NIC override, `TCPX_GPU_NIC_MAP="0,1:eth1;2,3:eth2;4,5:eth3;6,7:eth4"`.

use std::collections::BTreeMap;

use crate::TopoError;

/// The environment variable the override is read from.
pub const GPU_NIC_MAP_VAR: &str = "TCPX_GPU_NIC_MAP";

/// Largest GPU index accepted, so that a range like `0-4000000000` is an error, not an
/// allocation of billions of entries.
const MAX_GPU_INDEX: usize = 4095;

/// A parsed GPU → NIC(s) override.
///
/// Grammar: entries separated by `;`, each `GPUS:NICS`; `GPUS` is a comma list of indices or
/// ranges (`0,1`, `0-3`), `NICS` a comma list of interface names (`eth1` or `eth1,eth2`).
/// Whitespace around items is ignored, and so is an empty entry (a trailing `;`).
///
/// ```
/// use tcpx_topo::GpuNicMap;
/// let map = GpuNicMap::parse("TCPX_GPU_NIC_MAP", "0,1:eth1;2-3:eth2,eth3")?;
/// assert_eq!(map.nics_for(1), Some(&["eth1".to_owned()][..]));
/// assert_eq!(map.nics_for(3).map(<[String]>::len), Some(2));
/// # Ok::<(), tcpx_topo::TopoError>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GpuNicMap {
    /// GPU index → NIC names, closest-first as the operator wrote them.
    pub by_gpu: BTreeMap<usize, Vec<String>>,
}

impl GpuNicMap {
    /// Parses the override; `var` names its source in errors.
    pub fn parse(var: &str, input: &str) -> Result<Self, TopoError> {
        let malformed = |detail: String| TopoError::Malformed {
            var: var.to_owned(),
            input: input.to_owned(),
            detail,
        };
        let mut by_gpu: BTreeMap<usize, Vec<String>> = BTreeMap::new();
        for (n, entry) in input.split(';').enumerate() {
            let entry = entry.trim();
            if entry.is_empty() {
                continue;
            }
            let at = |detail: String| malformed(format!("entry {} ({entry:?}): {detail}", n + 1));
            let (gpus, nics) = entry
                .split_once(':')
                .ok_or_else(|| at("no ':' between GPU indices and NIC names".to_owned()))?;
            let gpus = parse_gpu_list(gpus).map_err(&at)?;
            let mut names: Vec<String> = Vec::new();
            for name in nics.split(',').map(str::trim) {
                if name.is_empty() {
                    return Err(at("empty NIC name".to_owned()));
                }
                if name.contains(':') || name.chars().any(char::is_whitespace) {
                    return Err(at(format!("{name:?} is not an interface name")));
                }
                if !names.iter().any(|n| n == name) {
                    names.push(name.to_owned());
                }
            }
            for gpu in gpus {
                if by_gpu.insert(gpu, names.clone()).is_some() {
                    return Err(at(format!("GPU {gpu} is mapped more than once")));
                }
            }
        }
        if by_gpu.is_empty() {
            return Err(malformed("no GPU:NIC entry".to_owned()));
        }
        Ok(Self { by_gpu })
    }

    /// The NICs the override gives GPU `gpu`, if it names that GPU.
    pub fn nics_for(&self, gpu: usize) -> Option<&[String]> {
        self.by_gpu.get(&gpu).map(Vec::as_slice)
    }
}

fn parse_gpu_list(list: &str) -> Result<Vec<usize>, String> {
    let mut gpus = Vec::new();
    for item in list.split(',').map(str::trim) {
        let index = |s: &str| -> Result<usize, String> {
            let s = s.trim();
            let v: usize = s.parse().map_err(|_| format!("{s:?} is not a GPU index"))?;
            if v > MAX_GPU_INDEX {
                return Err(format!("GPU index {v} is beyond {MAX_GPU_INDEX}"));
            }
            Ok(v)
        };
        match item.split_once('-') {
            Some((lo, hi)) => {
                let (lo, hi) = (index(lo)?, index(hi)?);
                if lo > hi {
                    return Err(format!("GPU range {item:?} runs backwards"));
                }
                gpus.extend(lo..=hi);
            }
            None => gpus.push(index(item)?),
        }
    }
    Ok(gpus)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_a3_layout() {
        let m = GpuNicMap::parse(GPU_NIC_MAP_VAR, "0,1:eth1;2,3:eth2;4,5:eth3;6,7:eth4;").unwrap();
        assert_eq!(m.by_gpu.len(), 8);
        assert_eq!(m.nics_for(5), Some(&["eth3".to_owned()][..]));
        assert_eq!(m.nics_for(8), None);
    }

    #[test]
    fn malformed_maps_say_what_and_where() {
        let cases = [
            ("", "no GPU:NIC entry"),
            ("0,1", "no ':'"),
            ("x:eth1", "not a GPU index"),
            ("0:", "empty NIC name"),
            (":eth1", "not a GPU index"),
            ("0:eth1;0:eth2", "mapped more than once"),
            ("3-1:eth1", "runs backwards"),
            ("0-99999:eth1", "beyond"),
            ("0:eth 1", "not an interface name"),
        ];
        for (input, want) in cases {
            let err = GpuNicMap::parse(GPU_NIC_MAP_VAR, input)
                .unwrap_err()
                .to_string();
            assert!(err.contains(want), "{input:?}: {err}");
            assert!(err.contains(GPU_NIC_MAP_VAR), "{input:?}: {err}");
        }
    }
}
