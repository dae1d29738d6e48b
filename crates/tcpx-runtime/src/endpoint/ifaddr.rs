//! The IP address of a network interface, by name (`getifaddrs`), for the address an endpoint
//! advertises when its control listener binds to the unspecified address.

use std::ffi::CStr;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// The first IPv4 address of `interface`, else its first non-link-local IPv6 address.
pub(crate) fn interface_ip(interface: &str) -> Option<IpAddr> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: `head` is a valid out pointer; on success it points at a list we free below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return None;
    }
    let mut v4 = None;
    let mut v6 = None;
    let mut cursor = head;
    while !cursor.is_null() {
        // SAFETY: `cursor` is a node of the list getifaddrs returned, alive until freeifaddrs.
        let entry = unsafe { &*cursor };
        cursor = entry.ifa_next;
        if entry.ifa_name.is_null() || entry.ifa_addr.is_null() {
            continue;
        }
        // SAFETY: getifaddrs fills `ifa_name` with a NUL-terminated string.
        let name = unsafe { CStr::from_ptr(entry.ifa_name) };
        if name.to_bytes() != interface.as_bytes() {
            continue;
        }
        // SAFETY: `ifa_addr` is non-NULL and points at a sockaddr of the family it names.
        let family = i32::from(unsafe { (*entry.ifa_addr).sa_family });
        match family {
            libc::AF_INET if v4.is_none() => {
                // SAFETY: the family is AF_INET, so the sockaddr is a sockaddr_in.
                let sin = unsafe { &*entry.ifa_addr.cast::<libc::sockaddr_in>() };
                v4 = Some(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)));
            }
            libc::AF_INET6 if v6.is_none() => {
                // SAFETY: the family is AF_INET6, so the sockaddr is a sockaddr_in6.
                let sin6 = unsafe { &*entry.ifa_addr.cast::<libc::sockaddr_in6>() };
                let ip = Ipv6Addr::from(sin6.sin6_addr.s6_addr);
                // Link-local addresses need a scope id the metadata does not carry.
                if ip.segments()[0] & 0xffc0 != 0xfe80 {
                    v6 = Some(ip);
                }
            }
            _ => {}
        }
    }
    // SAFETY: `head` came from a successful getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    v4.map(IpAddr::V4).or(v6.map(IpAddr::V6))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_has_its_address_and_unknown_interfaces_have_none() {
        assert_eq!(interface_ip("lo"), Some(IpAddr::V4(Ipv4Addr::LOCALHOST)));
        assert_eq!(interface_ip("no-such-interface0"), None);
    }
}
