//! PCI bus ids: how GPUs and NICs are named across CUDA, hwloc and sysfs.

use std::fmt;
use std::path::Path;
use std::str::FromStr;

use crate::TopoError;

/// A PCI bus id (`domain:bus:device.function`), ordered as the PCI bus enumerates devices.
///
/// Parses the forms CUDA (`00000000:04:00.0`), hwloc and sysfs (`0000:04:00.0`) and lspci
/// (`04:00.0`, domain 0) print, in either case; displays as `0000:04:00.0`.
///
/// ```
/// use tcpx_topo::PciBusId;
/// let cuda: PciBusId = "00000000:8A:00.0".parse()?;
/// assert_eq!(cuda.to_string(), "0000:8a:00.0");
/// # Ok::<(), tcpx_topo::TopoError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PciBusId {
    /// PCI domain (segment).
    pub domain: u32,
    /// Bus number.
    pub bus: u8,
    /// Device number (0–31).
    pub device: u8,
    /// Function number (0–7).
    pub function: u8,
}

impl PciBusId {
    /// Builds a bus id, checking the device (< 32) and function (< 8) ranges.
    pub fn new(domain: u32, bus: u8, device: u8, function: u8) -> Result<Self, TopoError> {
        let id = Self {
            domain,
            bus,
            device,
            function,
        };
        if device > 31 {
            return Err(invalid(&id.to_string(), "device number above 0x1f"));
        }
        if function > 7 {
            return Err(invalid(&id.to_string(), "function number above 7"));
        }
        Ok(id)
    }

    /// Extracts the device's bus id from a sysfs path such as the plugin's `pciPath`
    /// (`/sys/devices/pci0000:00/0000:00:02.0/…/0000:06:00.0`, possibly followed by
    /// non-PCI components like `virtio1`): the last component that is a full
    /// `domain:bus:device.function` id. `None` when there is none.
    pub fn from_sysfs_path(path: impl AsRef<Path>) -> Option<Self> {
        path.as_ref()
            .components()
            .rev()
            .filter_map(|c| c.as_os_str().to_str())
            // Only the full form: "pci0000:00" (a root complex) must not match.
            .filter(|s| s.matches(':').count() == 2)
            .find_map(|s| s.parse().ok())
    }
}

fn invalid(input: &str, detail: &str) -> TopoError {
    TopoError::InvalidPciBusId {
        input: input.to_owned(),
        detail: detail.to_owned(),
    }
}

fn hex_field<T>(
    input: &str,
    field: &str,
    what: &str,
    max_digits: usize,
    parse: impl Fn(&str) -> Result<T, std::num::ParseIntError>,
) -> Result<T, TopoError> {
    if field.is_empty() || field.len() > max_digits || !field.bytes().all(|b| b.is_ascii_hexdigit())
    {
        return Err(invalid(
            input,
            &format!("{what} {field:?} is not 1 to {max_digits} hex digits"),
        ));
    }
    parse(field).map_err(|e| invalid(input, &format!("{what} {field:?}: {e}")))
}

impl FromStr for PciBusId {
    type Err = TopoError;

    fn from_str(input: &str) -> Result<Self, Self::Err> {
        let s = input.trim();
        let (head, function) = s
            .rsplit_once('.')
            .ok_or_else(|| invalid(input, "missing '.' before the function number"))?;
        let parts: Vec<&str> = head.split(':').collect();
        let (domain, bus, device) = match parts.as_slice() {
            [domain, bus, device] => (*domain, *bus, *device),
            [bus, device] => ("0", *bus, *device),
            _ => return Err(invalid(input, "expected domain:bus:device.function")),
        };
        let domain = hex_field(input, domain, "domain", 8, |f| u32::from_str_radix(f, 16))?;
        let bus = hex_field(input, bus, "bus", 2, |f| u8::from_str_radix(f, 16))?;
        let device = hex_field(input, device, "device", 2, |f| u8::from_str_radix(f, 16))?;
        let function = hex_field(input, function, "function", 1, |f| {
            u8::from_str_radix(f, 16)
        })?;
        Self::new(domain, bus, device, function)
            .map_err(|_| invalid(input, "device must be at most 0x1f and function at most 7"))
    }
}

impl fmt::Display for PciBusId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:04x}:{:02x}:{:02x}.{:x}",
            self.domain, self.bus, self.device, self.function
        )
    }
}

impl serde::Serialize for PciBusId {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_cuda_hwloc_and_lspci_forms() {
        let want = PciBusId::new(0, 0x8a, 0, 0).unwrap();
        for s in [
            "00000000:8a:00.0",
            "0000:8A:00.0",
            "8a:00.0",
            " 0000:8a:00.0\n",
        ] {
            assert_eq!(s.parse::<PciBusId>().unwrap(), want, "{s}");
        }
        assert_eq!(want.to_string(), "0000:8a:00.0");
    }

    #[test]
    fn rejects_malformed_ids_with_the_input_in_the_message() {
        for s in [
            "",
            "04:00",
            "zz:00.0",
            "0000:04:20.0",
            "0000:04:00.8",
            "1:2:3:4.0",
            "0000:100:00.0",
        ] {
            let err = s.parse::<PciBusId>().unwrap_err().to_string();
            assert!(err.contains(&format!("{s:?}")), "{err}");
        }
    }

    #[test]
    fn sysfs_path_yields_the_last_full_bus_id() {
        let p = "/sys/devices/pci0000:00/0000:00:02.0/0000:02:00.0/0000:03:02.0/0000:06:00.0";
        assert_eq!(
            PciBusId::from_sysfs_path(p),
            Some("0000:06:00.0".parse().unwrap())
        );
        let virtio = "/sys/devices/pci0000:00/0000:00:03.0/virtio1";
        assert_eq!(
            PciBusId::from_sysfs_path(virtio),
            Some("0000:00:03.0".parse().unwrap())
        );
        assert_eq!(
            PciBusId::from_sysfs_path("/sys/devices/virtual/net/lo"),
            None
        );
    }

    #[test]
    fn orders_like_the_pci_bus() {
        let mut ids: Vec<PciBusId> = ["0000:84:00.0", "0000:04:00.0", "0000:0a:00.0"]
            .iter()
            .map(|s| s.parse().unwrap())
            .collect();
        ids.sort();
        let shown: Vec<String> = ids.iter().map(ToString::to_string).collect();
        assert_eq!(shown, ["0000:04:00.0", "0000:0a:00.0", "0000:84:00.0"]);
    }
}
