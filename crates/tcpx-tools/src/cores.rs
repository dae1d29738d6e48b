//! Core lists in the compact form people and `taskset` use: `0-3,8,10-11`.

/// Formats sorted or unsorted core ids as ranges.
pub fn format_ranges(cores: &[usize]) -> String {
    let mut sorted = cores.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut out = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let start = sorted[i];
        let mut end = start;
        while i + 1 < sorted.len() && sorted[i + 1] == end + 1 {
            i += 1;
            end = sorted[i];
        }
        out.push(if start == end {
            start.to_string()
        } else {
            format!("{start}-{end}")
        });
        i += 1;
    }
    if out.is_empty() {
        "-".into()
    } else {
        out.join(",")
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn ranges_are_compact() {
        assert_eq!(
            super::format_ranges(&[3, 0, 1, 2, 8, 10, 11]),
            "0-3,8,10-11"
        );
        assert_eq!(super::format_ranges(&[]), "-");
    }
}
