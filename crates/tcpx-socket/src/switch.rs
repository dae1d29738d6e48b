//! The plugin's on/off environment switches (`TCPX_SOCKET_DEVMEM`, `TCPX_SOCKET_NO_SIZES`), read
//! one way everywhere.

/// Whether a switch's value turns it on: `1`, `true`, `yes` or `on`, in any case, surrounding
/// spaces ignored; unset or anything else is off.
pub(crate) fn is_on(value: Option<&str>) -> bool {
    value.is_some_and(|v| {
        matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "1" | "true" | "yes" | "on"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::is_on;

    #[test]
    fn devmem_switch_values() {
        assert!(!is_on(None));
        assert!(!is_on(Some("")));
        assert!(!is_on(Some("0")));
        assert!(!is_on(Some("off")));
        assert!(is_on(Some("1")));
        assert!(is_on(Some(" ON ")));
        assert!(is_on(Some("true")));
    }
}
