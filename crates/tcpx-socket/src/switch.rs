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
