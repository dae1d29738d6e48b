//! `cargo xtask layers`: the modules of each library crate — every file, not only the
//! top-level ones — must import each other in one direction only (no import cycle), so that
//! every module can be read, tested and replaced with only the ones below it in mind.
//!
//! The check is textual on purpose (no rustc, no extra dependency): comments and string
//! literals are blanked, then every path that starts at `crate::`, `super::`, `self::` or a
//! child module of the file (`use codec::Frame` in `control/mod.rs`), with each leaf of a
//! `use a::{b, c::d}` group, is resolved to the deepest module it names: `crate::control::codec::
//! Frame` is an edge to `control::codec`. A name that a module re-exports (`pub use`) is
//! followed to the module that defines it, so importing `crate::Region` or
//! `super::Message` is an edge to `registry` or `control::message`, not to the facade; a
//! module's own re-exports of its descendants are its facade, not edges. `super` inside an
//! inline module is resolved from that inline module, and the imports of `#[cfg(test)]` inline
//! modules are not edges (unit tests, like integration tests, may use any layer). Doc
//! links sit in comments and are not edges: they create no compile-time dependency. The crate
//! root and binaries may import anything and are not nodes. A crate passes when its edge graph
//! has no strongly connected component of more than one module; on failure the check prints
//! one cycle of each component, edge by edge with the files that make the edge.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

/// Edges of one crate: `from → to → files that import it`, modules named `a::b`.
type Edges = BTreeMap<String, BTreeMap<String, BTreeSet<String>>>;

pub fn run(args: &[String]) -> Result<()> {
    let mut verbose = false;
    for arg in args {
        match arg.as_str() {
            "-v" | "--verbose" => verbose = true,
            "-h" | "--help" => {
                println!(
                    "cargo xtask layers [-v]\n\nFails when the modules (files) of a workspace \
                     library import each other in a loop (`use crate::`, `super::`, `self::` \
                     edges); -v prints each crate's module order."
                );
                return Ok(());
            }
            other => bail!("layers: unknown option `{other}` (try --help)"),
        }
    }
    let mut failed = Vec::new();
    for krate in library_crates(&crate::workspace_root())? {
        let name = krate
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let edges = crate_edges(&krate.join("src"))?;
        let cycles = cycles(&edges);
        if cycles.is_empty() {
            if verbose {
                println!("{name}: {}", layer_order(&edges).join(" < "));
            } else {
                println!("{name}: no module cycle ({} modules)", edges.len());
            }
            continue;
        }
        for component in &cycles {
            print!("{}", describe_cycle(&name, &edges, component));
        }
        failed.push(name);
    }
    if !failed.is_empty() {
        bail!("module cycles in {}", failed.join(", "));
    }
    Ok(())
}

/// Every library crate of the workspace (`crates/*/src/lib.rs`), so that a new crate is held
/// to the rule without being listed here.
fn library_crates(root: &Path) -> Result<Vec<PathBuf>> {
    let dir = root.join("crates");
    let mut out = Vec::new();
    for entry in std::fs::read_dir(&dir).with_context(|| format!("listing {}", dir.display()))? {
        let path = entry?.path();
        if path.join("src").join("lib.rs").is_file() {
            out.push(path);
        }
    }
    out.sort();
    Ok(out)
}

/// One cycle of the strongly connected `component`, printed edge by edge with its files.
fn describe_cycle(krate: &str, edges: &Edges, component: &[String]) -> String {
    let cycle = one_cycle(edges, component);
    let mut out = format!(
        "{krate}: modules import each other in a loop: {}\n",
        cycle.join(" -> ")
    );
    for pair in cycle.windows(2) {
        let files: Vec<_> = edges[&pair[0]][&pair[1]]
            .iter()
            .map(String::as_str)
            .collect();
        out += &format!("    {} -> {}  ({})\n", pair[0], pair[1], files.join(", "));
    }
    if component.len() + 1 > cycle.len() {
        out += &format!("    (all modules of this loop: {})\n", component.join(", "));
    }
    out
}

/// The shortest cycle through the first module of `component`, as `a, b, …, a`.
fn one_cycle(edges: &Edges, component: &[String]) -> Vec<String> {
    let start = &component[0];
    let mut came_from: BTreeMap<&str, &str> = BTreeMap::new();
    let mut queue = VecDeque::from([start.as_str()]);
    while let Some(v) = queue.pop_front() {
        for w in edges[v].keys().filter(|w| component.contains(w)) {
            if w == start {
                let mut back = Vec::new();
                let mut at = v;
                while at != start {
                    back.push(at.to_string());
                    at = came_from[at];
                }
                let mut cycle = vec![start.clone()];
                cycle.extend(back.into_iter().rev());
                cycle.push(start.clone());
                return cycle;
            }
            if !came_from.contains_key(w.as_str()) {
                came_from.insert(w, v);
                queue.push_back(w);
            }
        }
    }
    let mut all = component.to_vec();
    all.push(start.clone());
    all
}

/// A module's path inside its crate (`["control", "codec"]`; the root is empty).
type ModPath = Vec<String>;

/// One path found in a file, before it is resolved against the crate's modules.
#[derive(Debug, Clone, PartialEq, Eq)]
struct PathRef {
    /// The segments as written, starting at `crate`, `super`, `self` or a plain name; a glob
    /// ends in `*`.
    segments: Vec<String>,
    /// The inline modules (`mod tests { … }`) the path sits in, outermost first.
    inline: Vec<String>,
    /// The name a `use` binds (the alias, or the last segment), `None` outside `use` and for
    /// globs.
    binds: Option<String>,
    /// Whether the path is a leaf of a `pub use` (any `pub(…)` included): a re-export.
    reexport: bool,
}

/// One source file of a crate.
struct SourceFile {
    module: ModPath,
    rel: String,
    paths: Vec<PathRef>,
}

/// The import edges between the modules (files) of the crate whose source is `src`.
fn crate_edges(src: &Path) -> Result<Edges> {
    let mut found = Vec::new();
    collect_rs(src, src, &mut found)?;
    let mut files = Vec::new();
    let mut modules: BTreeSet<ModPath> = BTreeSet::new();
    for file in found {
        let rel = file.strip_prefix(src).unwrap_or(&file).to_path_buf();
        let Some(module) = module_of(&rel) else {
            continue;
        };
        let text = std::fs::read_to_string(&file)
            .with_context(|| format!("reading {}", file.display()))?;
        modules.insert(module.clone());
        files.push(SourceFile {
            module,
            rel: rel.display().to_string(),
            paths: Vec::new(),
        });
        let last = files.len() - 1;
        files[last].paths = paths_in(&strip_comments_and_strings(&text));
    }
    // What each module re-exports under which name, as absolute paths.
    let mut reexports: BTreeMap<ModPath, BTreeMap<String, ModPath>> = BTreeMap::new();
    for file in &files {
        for path in file
            .paths
            .iter()
            .filter(|p| p.reexport && p.inline.is_empty())
        {
            if let (Some(name), Some(abs)) = (&path.binds, absolute(file, path, &modules)) {
                reexports
                    .entry(file.module.clone())
                    .or_default()
                    .insert(name.clone(), abs);
            }
        }
    }
    let mut edges = Edges::new();
    for file in files.iter().filter(|f| !f.module.is_empty()) {
        let from = file.module.join("::");
        edges.entry(from.clone()).or_default();
        for path in &file.paths {
            let Some(abs) = absolute(file, path, &modules) else {
                continue;
            };
            let Some(to) = resolve(&abs, &modules, &reexports, 0) else {
                continue;
            };
            // A module re-exporting its own descendants is their facade, not their user.
            if to == file.module || (path.reexport && to.starts_with(&file.module)) {
                continue;
            }
            edges
                .entry(from.clone())
                .or_default()
                .entry(to.join("::"))
                .or_default()
                .insert(file.rel.clone());
        }
    }
    for to in edges
        .values()
        .flat_map(|t| t.keys())
        .cloned()
        .collect::<Vec<_>>()
    {
        edges.entry(to).or_default();
    }
    Ok(edges)
}

/// Every `.rs` file under `dir`, sorted, leaving out the binaries (`src/main.rs`, `src/bin/`),
/// which are crates of their own.
fn collect_rs(src: &Path, dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            if dir != src || path.file_name().is_none_or(|n| n != "bin") {
                collect_rs(src, &path, out)?;
            }
        } else if path.extension().is_some_and(|e| e == "rs")
            && (dir != src || path.file_name().is_none_or(|n| n != "main.rs"))
        {
            out.push(path);
        }
    }
    out.sort();
    Ok(())
}

/// The module a source file holds (`control/codec.rs` → `control::codec`, `control/mod.rs`
/// → `control`, `lib.rs` → the root), `None` for what is not a module path.
fn module_of(rel: &Path) -> Option<ModPath> {
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_str().map(str::to_string))
        .collect::<Option<_>>()?;
    let last = parts.pop()?;
    let stem = last.strip_suffix(".rs")?;
    match (parts.is_empty(), stem) {
        (true, "lib") => {}
        (_, "mod") => {}
        _ => parts.push(stem.to_string()),
    }
    Some(parts)
}

/// The absolute segments `path` names, seen from `file`, or `None` when it leaves the crate
/// (an extern crate, `std`, a local name).
fn absolute(file: &SourceFile, path: &PathRef, modules: &BTreeSet<ModPath>) -> Option<ModPath> {
    let mut scope: ModPath = file.module.clone();
    scope.extend(path.inline.iter().cloned());
    let segs = &path.segments;
    let (mut base, rest) = match segs.first()?.as_str() {
        "crate" => (Vec::new(), &segs[1..]),
        "self" => (scope, &segs[1..]),
        "super" => {
            let supers = segs.iter().take_while(|s| *s == "super").count();
            if supers > scope.len() {
                return None;
            }
            scope.truncate(scope.len() - supers);
            (scope, &segs[supers..])
        }
        first => {
            // A plain name is a path only when it is a child module of the file's module and
            // the path is not inside an inline module (which would need its own `use`).
            let mut child = file.module.clone();
            child.push(first.to_string());
            if !path.inline.is_empty() || !modules.contains(&child) {
                return None;
            }
            (file.module.clone(), &segs[..])
        }
    };
    base.extend(rest.iter().filter(|s| *s != "*").cloned());
    Some(base)
}

/// The deepest module `abs` names, following re-exports to the module that defines the name;
/// `None` for the crate root itself (macros, items of `lib.rs`).
fn resolve(
    abs: &[String],
    modules: &BTreeSet<ModPath>,
    reexports: &BTreeMap<ModPath, BTreeMap<String, ModPath>>,
    depth: usize,
) -> Option<ModPath> {
    let mut module: ModPath = Vec::new();
    for seg in abs {
        let mut deeper = module.clone();
        deeper.push(seg.clone());
        if modules.contains(&deeper) {
            module = deeper;
        } else {
            break;
        }
    }
    let next = abs.get(module.len());
    if let Some(target) = next.and_then(|n| reexports.get(&module)?.get(n)) {
        // A bound on the hops: `pub use` chains are short, and a loop of them must not hang.
        if depth < 16 && target.as_slice() != abs {
            let mut followed = target.clone();
            followed.extend(abs[module.len() + 1..].iter().cloned());
            return resolve(&followed, modules, reexports, depth + 1);
        }
    }
    (!module.is_empty()).then_some(module)
}

/// Every path of `code` (comments and strings blanked) that may name a module of this crate:
/// each leaf of every `use` tree, and every other path starting with `crate::`, `super::`,
/// `self::` or a plain name followed by `::`.
fn paths_in(code: &str) -> Vec<PathRef> {
    let b = code.as_bytes();
    let mut out = Vec::new();
    // Inline modules open at the brace depth they were opened at, and whether they are
    // `#[cfg(test)]`.
    let mut inline: Vec<(String, usize, bool)> = Vec::new();
    let mut pending_mod: Option<(String, bool)> = None;
    let mut depth = 0usize;
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'{' => {
                depth += 1;
                if let Some((name, test)) = pending_mod.take() {
                    inline.push((name, depth, test));
                }
                i += 1;
                continue;
            }
            b'}' => {
                if inline.last().is_some_and(|(_, d, _)| *d == depth) {
                    inline.pop();
                }
                depth = depth.saturating_sub(1);
                i += 1;
                continue;
            }
            b';' => {
                pending_mod = None;
                i += 1;
                continue;
            }
            c if is_ident_start(c) && (i == 0 || !is_ident_byte(b[i - 1])) => {}
            _ => {
                i += 1;
                continue;
            }
        }
        let word = ident_at(&code[i..]);
        let after = i + word.len();
        // `$crate::`, `.field::`, and the tail of `a::b` are not path starts.
        let prev = code[..i].trim_end();
        if (i > 0 && b[i - 1] == b'$') || prev.ends_with("::") || prev.ends_with('.') {
            i = after;
            continue;
        }
        let scope: Vec<String> = inline.iter().map(|(n, _, _)| n.clone()).collect();
        // Unit tests may use any layer, like integration tests and binaries: their imports
        // are not edges (a test of `driver` that opens a `CudaDevice` puts nothing below it).
        let in_test = inline.iter().any(|(_, _, test)| *test);
        match word {
            "mod" => {
                let name = ident_at(code[after..].trim_start());
                if !name.is_empty() {
                    let attrs = prev.strip_suffix("pub").unwrap_or(prev).trim_end();
                    let test = attrs.ends_with("#[cfg(test)]");
                    pending_mod = Some((name.to_string(), test));
                }
                i = after;
            }
            _ if in_test => i = after,
            "use" => {
                let reexport = is_pub_before(prev);
                let mut leaves = Vec::new();
                let end = use_tree(code, after, &mut Vec::new(), &mut leaves);
                out.extend(leaves.into_iter().map(|(segments, binds)| PathRef {
                    segments,
                    inline: scope.clone(),
                    binds,
                    reexport,
                }));
                i = end.max(after);
            }
            _ if code[after..].starts_with("::") => {
                let mut segments = vec![word.to_string()];
                let mut j = after;
                while code[j..].starts_with("::") {
                    let next = ident_at(&code[j + 2..]);
                    if next.is_empty() {
                        break;
                    }
                    segments.push(next.to_string());
                    j += 2 + next.len();
                }
                out.push(PathRef {
                    segments,
                    inline: scope,
                    binds: None,
                    reexport: false,
                });
                i = j;
            }
            _ => i = after,
        }
    }
    out
}

/// Whether the code just before a `use` (trimmed) ends in `pub` or `pub(…)`.
fn is_pub_before(prev: &str) -> bool {
    let ends_with_word = |s: &str, w: &str| {
        s.ends_with(w)
            && !s[..s.len() - w.len()]
                .bytes()
                .last()
                .is_some_and(is_ident_byte)
    };
    if ends_with_word(prev, "pub") {
        return true;
    }
    if let Some(inner) = prev.strip_suffix(')') {
        if let Some(open) = inner.rfind('(') {
            return ends_with_word(inner[..open].trim_end(), "pub");
        }
    }
    false
}

/// Parses the `use` tree starting at `at` (after `use` or a `::`) under `prefix`, pushing each
/// leaf as (segments, bound name); returns where the tree ends.
fn use_tree(
    code: &str,
    at: usize,
    prefix: &mut Vec<String>,
    leaves: &mut Vec<(Vec<String>, Option<String>)>,
) -> usize {
    let skip_ws = |mut j: usize| {
        while code.as_bytes().get(j).is_some_and(u8::is_ascii_whitespace) {
            j += 1;
        }
        j
    };
    let mut j = skip_ws(at);
    if code[j..].starts_with("::") && prefix.is_empty() {
        // `use ::extern_crate::…` leaves the crate.
        return code[j..].find(';').map_or(code.len(), |p| j + p);
    }
    match code.as_bytes().get(j) {
        Some(b'{') => {
            j += 1;
            loop {
                j = skip_ws(j);
                match code.as_bytes().get(j) {
                    Some(b'}') => return j + 1,
                    Some(b',') => j += 1,
                    None => return j,
                    _ => {
                        let before = j;
                        j = use_tree(code, j, &mut prefix.clone(), leaves);
                        if j == before {
                            j += 1;
                        }
                    }
                }
            }
        }
        Some(b'*') => {
            let mut segs = prefix.clone();
            segs.push("*".to_string());
            leaves.push((segs, None));
            j + 1
        }
        _ => {
            let word = ident_at(&code[j..]);
            if word.is_empty() {
                return j;
            }
            j += word.len();
            let k = skip_ws(j);
            if code[k..].starts_with("::") {
                prefix.push(word.to_string());
                return use_tree(code, k + 2, prefix, leaves);
            }
            // `self` in a group names the group's prefix itself.
            let (segs, mut name) = if word == "self" && !prefix.is_empty() {
                (prefix.clone(), prefix.last().cloned())
            } else {
                let mut segs = prefix.clone();
                segs.push(word.to_string());
                (segs, Some(word.to_string()))
            };
            if ident_at(&code[k..]) == "as" {
                let m = skip_ws(k + 2);
                let alias = ident_at(&code[m..]);
                name = (alias != "_").then(|| alias.to_string());
                j = m + alias.len();
            }
            leaves.push((segs, name));
            j
        }
    }
}

fn is_ident_start(b: u8) -> bool {
    b.is_ascii_alphabetic() || b == b'_'
}

fn is_ident_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

fn ident_at(s: &str) -> &str {
    let end = s.bytes().position(|b| !is_ident_byte(b)).unwrap_or(s.len());
    &s[..end]
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

    /// A crate source tree under the temp dir, removed on drop.
    struct Fixture(PathBuf);

    impl Fixture {
        fn new(name: &str, files: &[(&str, &str)]) -> Fixture {
            let dir =
                std::env::temp_dir().join(format!("xtask-layers-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            for (rel, text) in files {
                let path = dir.join("src").join(rel);
                std::fs::create_dir_all(path.parent().unwrap()).unwrap();
                std::fs::write(path, text).unwrap();
            }
            Fixture(dir)
        }

        fn edges(&self) -> Edges {
            crate_edges(&self.0.join("src")).unwrap()
        }
    }

    impl Drop for Fixture {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn crate_paths_first(code: &str) -> Vec<String> {
        let set: BTreeSet<String> = paths_in(&strip_comments_and_strings(code))
            .into_iter()
            .filter(|p| p.segments[0] == "crate" && p.segments.len() > 1)
            .map(|p| p.segments[1].clone())
            .collect();
        set.into_iter().collect()
    }

    #[test]
    fn paths_groups_and_nested_groups_are_edges_and_comments_are_not() {
        let got = crate_paths_first(
            "use crate::link::Link;\n\
             use crate::{engine::{job::Job, Command}, registry,\n    schedule::Schedule};\n\
             /// see [`crate::endpoint::Connection`]\n\
             // crate::onesided is mentioned here\n\
             /* and crate::control /* nested */ here */\n\
             let s = \"crate::config\"; let r = r#\"crate::error\"#; let c = '\"';\n\
             let x = crate::transfer::Transfer::new(); macro!($crate::stats);\n\
             fn f<'a>(x: &'a str) -> u8 { crate::window::MAX }\n",
        );
        assert_eq!(
            got,
            ["engine", "link", "registry", "schedule", "transfer", "window"]
        );
    }

    #[test]
    fn use_trees_give_full_paths_aliases_and_reexports() {
        let paths = paths_in(&strip_comments_and_strings(
            "pub(crate) use super::{codec::{self, Frame as F}, *};\n\
             mod tests { use super::*; fn t() { self::x::y(); } }\n\
             use ::ext::thing; let v = a.b::<u8>();\n",
        ));
        let seen: Vec<(String, Vec<String>, Option<String>, bool)> = paths
            .iter()
            .map(|p| {
                (
                    p.segments.join("::"),
                    p.inline.clone(),
                    p.binds.clone(),
                    p.reexport,
                )
            })
            .collect();
        let s = |x: &str| x.to_string();
        assert_eq!(
            seen,
            [
                (s("super::codec"), vec![], Some(s("codec")), true),
                (s("super::codec::Frame"), vec![], Some(s("F")), true),
                (s("super::*"), vec![], None, true),
                (s("super::*"), vec![s("tests")], None, false),
                (s("self::x::y"), vec![s("tests")], None, false),
            ]
        );
    }

    #[test]
    fn a_loop_is_found_with_its_members_and_a_chain_is_ordered() {
        let looped = graph(&[("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")]);
        assert_eq!(cycles(&looped), vec![vec!["a", "b", "c"]]);
        assert_eq!(
            one_cycle(&looped, &cycles(&looped)[0]),
            ["a", "b", "c", "a"]
        );
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
    fn a_cycle_between_two_files_of_one_module_fails_and_names_the_files() {
        let fixture = Fixture::new(
            "cycle",
            &[
                ("lib.rs", "pub mod control;\npub mod error;\n"),
                ("error.rs", "pub struct Error;\n"),
                (
                    "control/mod.rs",
                    "mod codec;\nmod message;\npub use codec::Frame;\npub use message::Message;\n",
                ),
                (
                    "control/codec.rs",
                    "use super::Message;\nuse crate::error::Error;\npub struct Frame;\n",
                ),
                (
                    "control/message.rs",
                    "pub struct Message(crate::control::codec::Frame);\n\
                     #[cfg(test)]\nmod tests { use super::*; }\n",
                ),
            ],
        );
        let edges = fixture.edges();
        let found = cycles(&edges);
        assert_eq!(found, vec![vec!["control::codec", "control::message"]]);
        let text = describe_cycle("fixture", &edges, &found[0]);
        assert!(
            text.contains("control::codec -> control::message -> control::codec"),
            "{text}"
        );
        assert!(text.contains("(control/codec.rs)"), "{text}");
        assert!(text.contains("(control/message.rs)"), "{text}");
    }

    #[test]
    fn an_acyclic_tree_passes_through_facades_and_inline_tests() {
        let fixture = Fixture::new(
            "acyclic",
            &[
                (
                    "lib.rs",
                    "pub mod control;\npub mod endpoint;\npub use control::Message;\n",
                ),
                (
                    "control/mod.rs",
                    "mod codec;\nmod message;\npub use codec::Frame;\npub use message::Message;\n\
                     pub struct Limits;\n",
                ),
                (
                    "control/codec.rs",
                    "use super::Limits;\npub struct Frame;\n\
                     #[cfg(test)]\nmod tests { use crate::control::message::Message; }\n",
                ),
                (
                    "control/message.rs",
                    "use super::{Frame, Limits};\npub struct Message(Frame);\n\
                     #[cfg(test)]\nmod tests { use super::*; use super::super::codec; }\n",
                ),
                (
                    "endpoint/mod.rs",
                    "mod setup;\nuse crate::Message;\npub fn connect() { setup::run() }\n",
                ),
                (
                    "endpoint/setup.rs",
                    "use crate::control::Frame;\npub fn run() {}\n",
                ),
            ],
        );
        let edges = fixture.edges();
        assert!(cycles(&edges).is_empty(), "{edges:?}");
        let e = |from: &str, to: &str| edges[from].contains_key(to);
        // Re-exports lead to the defining file; a unit test's imports are not edges.
        assert!(e("control::message", "control::codec"));
        assert!(e("control::codec", "control"));
        assert!(e("endpoint", "control::message"));
        assert!(e("endpoint", "endpoint::setup"));
        assert!(e("endpoint::setup", "control::codec"));
        assert!(!e("control", "control::codec"), "a facade is not an edge");
        assert!(
            !e("control::codec", "control::message"),
            "a test is not an edge"
        );
        assert_eq!(
            layer_order(&edges),
            [
                "control",
                "control::codec",
                "control::message",
                "endpoint::setup",
                "endpoint"
            ]
        );
    }

    #[test]
    fn the_library_crates_have_no_module_cycle() {
        let root = crate::workspace_root();
        let crates = library_crates(&root).unwrap();
        assert!(crates.iter().any(|c| c.ends_with("tcpx-runtime")));
        for krate in crates {
            let edges = crate_edges(&krate.join("src")).unwrap();
            let found = cycles(&edges);
            let text: String = found
                .iter()
                .map(|c| describe_cycle(&krate.display().to_string(), &edges, c))
                .collect();
            assert!(found.is_empty(), "{text}");
        }
    }
}
