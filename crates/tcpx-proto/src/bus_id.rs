//! PCI bus ids as peers and users spell them (UCCL's metadata carries one; the same-host
//! rendezvous is named after one).

/// A PCI bus id in the form `dddd:bb:dd.f` (lowercase hex, 4-digit domain), from the
/// spellings in use: sysfs / hwloc (`0000:8a:00.0`), the driver's (`00000000:8A:00.0`), and
/// without a domain (`8a:00.0`). `None` when it is not one.
pub fn normalize_bus_id(text: &str) -> Option<String> {
    let text = text.trim();
    let (rest, function) = text.rsplit_once('.')?;
    let parts: Vec<&str> = rest.split(':').collect();
    let (domain, bus, device) = match parts.as_slice() {
        [d, b, v] => (*d, *b, *v),
        [b, v] => ("0", *b, *v),
        _ => return None,
    };
    let hex = |s: &str, max_len: usize| {
        (!s.is_empty() && s.len() <= max_len && s.bytes().all(|c| c.is_ascii_hexdigit()))
            .then(|| u32::from_str_radix(s, 16).ok())
            .flatten()
    };
    let domain = hex(domain, 8)?;
    let bus = hex(bus, 2)?;
    let device = hex(device, 2)?;
    let function = hex(function, 1)?;
    if domain > 0xffff || device > 0x1f || function > 7 {
        return None;
    }
    Some(format!("{domain:04x}:{bus:02x}:{device:02x}.{function:x}"))
}
