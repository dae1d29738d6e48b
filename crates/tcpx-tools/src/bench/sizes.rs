//! Byte sizes as people write them (`4KiB`, `1MiB`, `512k`, `1000`) and ranges (`4KiB..256MiB`,
//! doubling each step).

use anyhow::{bail, Context, Result};

/// Parses one size: a number with an optional binary unit (K/KiB, M/MiB, G/GiB; case-insensitive).
pub fn parse_size(text: &str) -> Result<usize> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, unit) = t.split_at(split);
    if digits.is_empty() {
        bail!("`{text}` is not a size (e.g. 4096, 4KiB, 1MiB)");
    }
    let Ok(n) = digits.parse::<usize>() else {
        bail!("`{text}` is too large");
    };
    let mult: usize = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        other => bail!("unknown unit `{other}` in `{text}` (use KiB, MiB or GiB)"),
    };
    n.checked_mul(mult)
        .with_context(|| format!("`{text}` is too large"))
}

/// Parses `A..B` (A, 2A, 4A, … up to B) or a comma list of sizes.
pub fn parse_sizes(text: &str) -> Result<Vec<usize>> {
    if let Some((lo, hi)) = text.split_once("..") {
        let (lo, hi) = (parse_size(lo)?, parse_size(hi)?);
        if lo == 0 || lo > hi {
            bail!("size range `{text}` must go from a positive size up to a larger one");
        }
        let mut sizes = Vec::new();
        let mut s = lo;
        while s <= hi {
            sizes.push(s);
            s = match s.checked_mul(2) {
                Some(next) => next,
                None => break,
            };
        }
        Ok(sizes)
    } else {
        text.split(',').map(parse_size).collect()
    }
}

/// Formats a size with a binary unit when it divides evenly.
pub fn format_size(n: usize) -> String {
    for (unit, shift) in [("GiB", 30), ("MiB", 20), ("KiB", 10)] {
        if n >= 1 << shift && n % (1 << shift) == 0 {
            return format!("{}{unit}", n >> shift);
        }
    }
    format!("{n}B")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_double() {
        assert_eq!(
            parse_sizes("4KiB..32KiB").unwrap(),
            vec![4096, 8192, 16384, 32768]
        );
        assert_eq!(parse_sizes("1,2k").unwrap(), vec![1, 2048]);
        assert!(parse_sizes("8KiB..4KiB").is_err());
        assert!(parse_size("12parsecs").is_err());
        assert_eq!(format_size(256 << 20), "256MiB");
        assert_eq!(format_size(1000), "1000B");
    }
}
