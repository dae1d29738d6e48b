//! `cargo xtask layers`: the top-level modules of each library crate must import each other
//! in one direction only (no `use crate::` cycle), so that every module can be read, tested and
//! replaced with only the ones below it in mind.
//!
//! The check is textual on purpose (no rustc, no extra dependency): comments and string
//! literals are blanked, then every `crate::name` path — including each name of a
//! `crate::{a, b::c}` group — is an edge from the file's top-level module to `name`. Doc links
//! sit in comments and are not edges: they create no compile-time dependency. A crate passes
//! when its edge graph has no strongly connected component of more than one module; on failure
//! the check prints each cycle's modules and the files that make its edges.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

/// The crates held to the rule: every library of the workspace.
const CRATES: &[&str] = &[
    "crates/tcpx-sys",
    "crates/tcpx-socket",
    "crates/tcpx",
    "crates/tcpx-topo",
    "crates/tcpx-runtime",
    "crates/tcpx-tools",
    "crates/tcpx-capi",
    "crates/tcpx-py",
];

/// Edges of one crate: `from → to → files that import it`.
type Edges = BTreeMap<String, BTreeMap<String, BTreeSet<String>>>;

pub fn run(args: &[String]) -> Result<()> {
    let mut verbose = false;
    for arg in args {
        match arg.as_str() {
            "-v" | "--verbose" => verbose = true,
            "-h" | "--help" => {
                println!(
                    "cargo xtask layers [-v]\n\nFails when the top-level modules of a workspace \
                     library import each other in a loop (`use crate::` edges); -v prints each \
                     crate's module order."
                );
                return Ok(());
            }
            other => bail!("layers: unknown option `{other}` (try --help)"),
        }
    }
    let root = crate::workspace_root();
    let mut failed = Vec::new();
    for krate in CRATES {
        let src = root.join(krate).join("src");
        if !src.is_dir() {
            continue;
        }
        let edges = crate_edges(&src)?;
        let cycles = cycles(&edges);
        if cycles.is_empty() {
            if verbose {
                println!("{krate}: {}", layer_order(&edges).join(" < "));
            } else {
                println!("{krate}: no module cycle");
            }
            continue;
        }
        for cycle in &cycles {
            println!(
                "{krate}: modules import each other in a loop: {}",
                cycle.join(", ")
            );
            for from in cycle {
                for (to, files) in &edges[from] {
                    if cycle.contains(to) {
                        let files: Vec<_> = files.iter().map(String::as_str).collect();
                        println!("    {from} -> {to}  ({})", files.join(", "));
                    }
                }
            }
        }
        failed.push(*krate);
    }
    if !failed.is_empty() {
        bail!("module cycles in {}", failed.join(", "));
    }
    Ok(())
}

/// The `use crate::` edges between top-level modules of the crate whose source is `src`.
fn crate_edges(src: &Path) -> Result<Edges> {
    let mut edges = Edges::new();
    let mut files = Vec::new();
    collect_rs(src, &mut files)?;
    for file in files {
        let rel = file.strip_prefix(src).unwrap_or(&file);
        let Some(module) = top_module(rel) else {
            continue;
        };
        let text = std::fs::read_to_string(&file)
            .with_context(|| format!("reading {}", file.display()))?;
        let node = edges.entry(module.clone()).or_default();
        for target in crate_paths(&strip_comments_and_strings(&text)) {
            if target != module {
                node.entry(target)
                    .or_default()
                    .insert(rel.display().to_string());
            }
        }
    }
    // Edges to names that are not modules of this crate (re-exported items at the root,
    // macros) say nothing about layering.
    let modules: BTreeSet<String> = edges.keys().cloned().collect();
    for targets in edges.values_mut() {
        targets.retain(|to, _| modules.contains(to));
    }
    Ok(edges)
}

fn collect_rs(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            collect_rs(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    out.sort();
    Ok(())
}

/// The top-level module a source file belongs to (`engine/lane.rs` → `engine`), or `None` for
/// the crate root and binaries, which may import anything.
fn top_module(rel: &Path) -> Option<String> {
    let first = rel.components().next()?.as_os_str().to_str()?;
    let name = first.strip_suffix(".rs").unwrap_or(first);
    match name {
        "lib" | "main" | "bin" => None,
        _ => Some(name.to_string()),
    }
}

/// `text` with comments and the contents of string and char literals replaced by spaces, so
/// that only code is searched for paths.
fn strip_comments_and_strings(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let rest = &bytes[i..];
        if rest.starts_with(b"//") {
            while i < bytes.len() && bytes[i] != b'\n' {
                out.push(b' ');
                i += 1;
            }
        } else if rest.starts_with(b"/*") {
            let mut depth = 0usize;
            while i < bytes.len() {
                if bytes[i..].starts_with(b"/*") {
                    depth += 1;
                    out.extend_from_slice(b"  ");
                    i += 2;
                } else if bytes[i..].starts_with(b"*/") {
                    depth -= 1;
                    out.extend_from_slice(b"  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    out.push(if bytes[i] == b'\n' { b'\n' } else { b' ' });
                    i += 1;
                }
            }
        } else if let Some(len) = raw_string_len(rest) {
            out.extend(
                rest[..len]
                    .iter()
                    .map(|&b| if b == b'\n' { b'\n' } else { b' ' }),
            );
            i += len;
        } else if rest[0] == b'"' {
            out.push(b' ');
            i += 1;
            while i < bytes.len() && bytes[i] != b'"' {
                let step = if bytes[i] == b'\\' { 2 } else { 1 };
                for _ in 0..step.min(bytes.len() - i) {
                    out.push(if bytes[i] == b'\n' { b'\n' } else { b' ' });
                    i += 1;
                }
            }
            if i < bytes.len() {
                out.push(b' ');
                i += 1;
            }
        } else if let Some(len) = char_literal_len(rest) {
            out.extend(std::iter::repeat_n(b' ', len));
            i += len;
        } else {
            out.push(rest[0]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Length of a raw string literal (`r"…"`, `r#"…"#`, `br"…"`) starting at `s`, if one does.
fn raw_string_len(s: &[u8]) -> Option<usize> {
    let start = match s {
        [b'r', b'"' | b'#', ..] => 1,
        [b'b', b'r', b'"' | b'#', ..] => 2,
        _ => return None,
    };
    let hashes = s[start..].iter().take_while(|&&b| b == b'#').count();
    let open = start + hashes;
    if s.get(open) != Some(&b'"') {
        return None;
    }
    let mut close = vec![b'"'];
    close.extend(std::iter::repeat_n(b'#', hashes));
    let body = &s[open + 1..];
    let end = body
        .windows(close.len())
        .position(|w| w == close.as_slice())?;
    Some(open + 1 + end + close.len())
}

/// Length of a char literal (`'a'`, `'\n'`, `'\''`) starting at `s`; `None` for lifetimes.
fn char_literal_len(s: &[u8]) -> Option<usize> {
    match s {
        [b'\'', b'\\', _, ..] => s[3..].iter().position(|&b| b == b'\'').map(|p| p + 4),
        [b'\'', c, b'\'', ..] if *c != b'\\' => Some(3),
        _ => {
            // A multi-byte UTF-8 char: up to 4 bytes then the closing quote.
            let close = s.iter().skip(2).take(4).position(|&b| b == b'\'')?;
            (s[1] >= 0x80).then_some(close + 3)
        }
    }
}

/// The first segment of every `crate::` path in `code`, expanding `crate::{a, b::c}` groups.
fn crate_paths(code: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let bytes = code.as_bytes();
    let mut from = 0;
    while let Some(pos) = code[from..].find("crate::") {
        let at = from + pos;
        from = at + "crate::".len();
        // `$crate::` in macros and identifiers ending in "crate" are not paths into this one.
        if at > 0 && (bytes[at - 1] == b'$' || is_ident_byte(bytes[at - 1])) {
            continue;
        }
        let rest = code[from..].trim_start();
        if let Some(group) = rest.strip_prefix('{') {
            let mut depth = 1usize;
            let mut item_start = true;
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => {
                        depth -= 1;
                        if depth == 0 {
                            break;
                        }
                    }
                    ',' if depth == 1 => item_start = true,
                    c if item_start && depth == 1 && !c.is_whitespace() => {
                        item_start = false;
                        let name = ident_at(&group[i..]);
                        if !name.is_empty() && name != "self" {
                            out.insert(name.to_string());
                        }
                    }
                    _ => {}
                }
            }
        } else {
            let name = ident_at(rest);
            if !name.is_empty() {
                out.insert(name.to_string());
            }
        }
    }
    out
}

fn is_ident_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

fn ident_at(s: &str) -> &str {
    let end = s.bytes().position(|b| !is_ident_byte(b)).unwrap_or(s.len());
    &s[..end]
}

/// The strongly connected components of more than one module (Tarjan), each sorted.
fn cycles(edges: &Edges) -> Vec<Vec<String>> {
    struct Tarjan<'a> {
        edges: &'a Edges,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        next: usize,
        found: Vec<Vec<String>>,
    }
    impl<'a> Tarjan<'a> {
        fn visit(&mut self, v: &'a str) {
            self.index.insert(v, self.next);
            self.low.insert(v, self.next);
            self.next += 1;
            self.stack.push(v);
            self.on_stack.insert(v);
            for w in self.edges.get(v).into_iter().flat_map(|t| t.keys()) {
                let w = w.as_str();
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let low = self.low[v].min(self.low[w]);
                    self.low.insert(v, low);
                } else if self.on_stack.contains(w) {
                    let low = self.low[v].min(self.index[w]);
                    self.low.insert(v, low);
                }
            }
            if self.low[v] == self.index[v] {
                let mut component = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on_stack.remove(w);
                    component.push(w.to_string());
                    if w == v {
                        break;
                    }
                }
                if component.len() > 1 {
                    component.sort();
                    self.found.push(component);
                }
            }
        }
    }
    let mut t = Tarjan {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        next: 0,
        found: Vec::new(),
    };
    for v in edges.keys() {
        if !t.index.contains_key(v.as_str()) {
            t.visit(v);
        }
    }
    t.found
}

/// The modules of an acyclic crate, each after everything it imports.
fn layer_order(edges: &Edges) -> Vec<String> {
    let mut placed: Vec<String> = Vec::new();
    let mut left: BTreeSet<&String> = edges.keys().collect();
    while !left.is_empty() {
        let ready: Vec<&String> = left
            .iter()
            .filter(|m| edges[**m].keys().all(|d| placed.contains(d)))
            .copied()
            .collect();
        if ready.is_empty() {
            // Only reached with a cycle, which `cycles` reports.
            placed.extend(left.iter().map(|m| (*m).clone()));
            break;
        }
        for m in ready {
            left.remove(m);
            placed.push(m.clone());
        }
    }
    placed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn graph(pairs: &[(&str, &str)]) -> Edges {
        let mut edges = Edges::new();
        for (from, to) in pairs {
            edges
                .entry(from.to_string())
                .or_default()
                .entry(to.to_string())
                .or_default()
                .insert(format!("{from}.rs"));
            edges.entry(to.to_string()).or_default();
        }
        edges
    }

    #[test]
    fn paths_groups_and_nested_groups_are_edges_and_comments_are_not() {
        let code = strip_comments_and_strings(
            "use crate::link::Link;\n\
             use crate::{engine::{job::Job, Command}, registry,\n    schedule::Schedule};\n\
             /// see [`crate::endpoint::Connection`]\n\
             // crate::onesided is mentioned here\n\
             /* and crate::control /* nested */ here */\n\
             let s = \"crate::config\"; let r = r#\"crate::error\"#; let c = '\"';\n\
             let x = crate::transfer::Transfer::new(); macro!($crate::stats);\n\
             fn f<'a>(x: &'a str) -> u8 { crate::window::MAX }\n",
        );
        let got: Vec<String> = crate_paths(&code).into_iter().collect();
        assert_eq!(
            got,
            ["engine", "link", "registry", "schedule", "transfer", "window"]
        );
    }

    #[test]
    fn a_loop_is_found_with_its_members_and_a_chain_is_ordered() {
        let looped = graph(&[("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")]);
        assert_eq!(cycles(&looped), vec![vec!["a", "b", "c"]]);
        let chain = graph(&[
            ("endpoint", "onesided"),
            ("onesided", "carrier"),
            ("carrier", "link"),
        ]);
        assert!(cycles(&chain).is_empty());
        assert_eq!(
            layer_order(&chain),
            ["link", "carrier", "onesided", "endpoint"]
        );
    }

    #[test]
    fn the_crates_held_to_the_rule_have_no_module_cycle() {
        let root = crate::workspace_root();
        for krate in CRATES {
            let src = root.join(krate).join("src");
            if src.is_dir() {
                let edges = crate_edges(&src).unwrap();
                assert_eq!(cycles(&edges), Vec::<Vec<String>>::new(), "{krate}");
            }
        }
    }
}
