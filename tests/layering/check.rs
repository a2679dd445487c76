//! The documented layers (fenced `layers` blocks of a Markdown page) and the checks of a
//! source folder against them: no use of a module on a higher line, no import circle
//! among the modules of one line, every top-level module on exactly one line; and the
//! length of library source files.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::fs;
use std::path::{Path, PathBuf};

use super::scan::{lex, root_names, root_uses};

/// One `layers` block: a source folder and its top-level modules, top layer first.
#[derive(Debug)]
pub struct Layers {
    /// The folder, relative to the repository root (`fusion-runtime/src`).
    pub folder: String,
    /// One entry per layer, top first: its module names.
    pub lines: Vec<Vec<String>>,
    /// Where the block starts in the page (`docs/ARCHITECTURE.md:12`).
    pub at: String,
}

/// Every fenced block with info string `layers` in `md` (the page `page`): its first line
/// the folder, then one line per layer, top first.
pub fn parse_blocks(md: &str, page: &str) -> Vec<Layers> {
    let mut blocks = Vec::new();
    let mut lines = md.lines().enumerate();
    while let Some((n, line)) = lines.next() {
        let fence = line.trim_start();
        if !(fence.starts_with("```") && fence.trim_start_matches('`').trim() == "layers") {
            continue;
        }
        let body: Vec<&str> = lines
            .by_ref()
            .map(|(_, l)| l)
            .take_while(|l| !l.trim_start().starts_with("```"))
            .filter(|l| !l.trim().is_empty())
            .collect();
        blocks.push(Layers {
            folder: body.first().map_or(String::new(), |f| f.trim().to_string()),
            lines: body
                .iter()
                .skip(1)
                .map(|l| l.split_whitespace().map(str::to_string).collect())
                .collect(),
            at: format!("{page}:{}", n + 1),
        });
    }
    blocks
}

/// The `.rs` files under `dir`, sorted.
pub fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// The top-level modules of a crate's source folder: its `.rs` files but the crate root,
/// and its folders.
fn top_modules(dir: &Path) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for e in fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        let Some(stem) = p.file_stem().and_then(|s| s.to_str()) else {
            continue;
        };
        if p.is_dir()
            || (p.extension().is_some_and(|x| x == "rs") && stem != "lib" && stem != "main")
        {
            out.insert(stem.to_string());
        }
    }
    out
}

/// The module path of `file` under the source folder `dir`: `world/rank.rs` is
/// `[world, rank]`, `eval/mod.rs` is `[eval]`, `lib.rs` is `[]`.
fn module_path(dir: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(dir).unwrap_or(file).with_extension("");
    let mut parts: Vec<String> = rel
        .iter()
        .map(|s| s.to_string_lossy().into_owned())
        .collect();
    let root = parts.len() == 1 && matches!(parts[0].as_str(), "lib" | "main");
    if root || parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    parts
}

/// A file and line where one module uses another.
type Witness = (String, usize);

/// Everything wrong with `layers.folder` (under `root`) against `layers`, one message each.
pub fn check(root: &Path, layers: &Layers) -> Vec<String> {
    let dir = root.join(&layers.folder);
    if layers.folder.is_empty() || !dir.is_dir() {
        return vec![format!("{}: `{}` is no folder", layers.at, layers.folder)];
    }
    let modules = top_modules(&dir);
    let mut errors = Vec::new();
    let mut layer_of: HashMap<&str, usize> = HashMap::new();
    for (k, line) in layers.lines.iter().enumerate() {
        for m in line {
            if !modules.contains(m) {
                errors.push(format!(
                    "{}: layer {} names `{m}`, which is no module of {}",
                    layers.at,
                    k + 1,
                    layers.folder
                ));
            } else if layer_of.insert(m, k).is_some() {
                errors.push(format!("{}: `{m}` is on more than one layer", layers.at));
            }
        }
    }
    for m in &modules {
        if !layer_of.contains_key(m.as_str()) {
            errors.push(format!(
                "{}/{m}: module `{m}` is on no layer of {}",
                layers.folder, layers.at
            ));
        }
    }
    // Names the crate root re-exports, by the module they come from.
    let root_file = dir.join("lib.rs");
    let reexports: HashMap<String, String> = fs::read_to_string(&root_file)
        .map(|src| root_uses(&lex(&src)).into_iter().collect())
        .unwrap_or_default();
    let mut same_layer: BTreeMap<(String, String), Witness> = BTreeMap::new();
    for file in rust_files(&dir) {
        let path = module_path(&dir, &file);
        let Some(from) = path.first() else {
            continue;
        };
        let shown = file
            .strip_prefix(root)
            .unwrap_or(&file)
            .display()
            .to_string();
        let src = fs::read_to_string(&file).unwrap_or_default();
        for (name, line) in root_names(&lex(&src), &path) {
            let to = if modules.contains(&name) {
                name
            } else if let Some(m) = reexports.get(&name) {
                m.clone()
            } else {
                continue;
            };
            let (Some(&lf), Some(&lt)) = (layer_of.get(from.as_str()), layer_of.get(to.as_str()))
            else {
                continue;
            };
            if to == *from {
                continue;
            }
            if lt < lf {
                errors.push(format!(
                    "{shown}:{line}: `{from}` (layer {}) uses `{to}`, which is on a higher layer ({})",
                    lf + 1,
                    lt + 1
                ));
            } else if lt == lf {
                same_layer
                    .entry((from.clone(), to))
                    .or_insert((shown.clone(), line));
            }
        }
    }
    errors.extend(circles(&same_layer));
    errors
}

/// One message per import circle among the modules of one layer (`edges`: who uses whom,
/// and where), naming each use on it.
fn circles(edges: &BTreeMap<(String, String), Witness>) -> Vec<String> {
    let nodes: BTreeSet<&str> = edges.keys().map(|(f, _)| f.as_str()).collect();
    let mut seen: BTreeSet<&str> = BTreeSet::new();
    let mut out = Vec::new();
    for &a in &nodes {
        if seen.contains(a) {
            continue;
        }
        let Some(circle) = shortest_path(edges, a, a) else {
            continue;
        };
        // Every module on a circle through `a` is reported with this one.
        seen.extend(nodes.iter().filter(|&&b| {
            shortest_path(edges, a, b).is_some() && shortest_path(edges, b, a).is_some()
        }));
        let uses: Vec<String> = circle
            .windows(2)
            .map(|w| {
                let (file, line) = &edges[&(w[0].to_string(), w[1].to_string())];
                format!("{file}:{line}: `{}` uses `{}`", w[0], w[1])
            })
            .collect();
        out.push(format!(
            "import circle {} ({})",
            circle.join(" -> "),
            uses.join("; ")
        ));
    }
    out
}

/// The shortest path from `a` to `b` along `edges`, both ends included (`a -> .. -> a`
/// for a circle).
fn shortest_path<'e>(
    edges: &'e BTreeMap<(String, String), Witness>,
    a: &'e str,
    b: &str,
) -> Option<Vec<&'e str>> {
    let mut prev: HashMap<&str, &str> = HashMap::new();
    let mut queue = VecDeque::from([a]);
    while let Some(n) = queue.pop_front() {
        for (_, m) in edges.keys().filter(|(f, _)| f == n) {
            if m == b {
                let mut path = vec![m.as_str(), n];
                let mut at = n;
                while at != a {
                    at = prev[at];
                    path.push(at);
                }
                path.reverse();
                return Some(path);
            }
            if m != a && !prev.contains_key(m.as_str()) {
                prev.insert(m, n);
                queue.push_back(m);
            }
        }
    }
    None
}

/// The crate folders of the workspace at `root`: `.` and its `members`.
pub fn workspace_crates(root: &Path) -> Vec<String> {
    let manifest = fs::read_to_string(root.join("Cargo.toml")).unwrap_or_default();
    let mut crates = vec![".".to_string()];
    if let Some(start) = manifest.find("members") {
        let list = &manifest[start..];
        if let (Some(open), Some(close)) = (list.find('['), list.find(']')) {
            crates.extend(
                list[open + 1..close]
                    .split(',')
                    .map(|m| m.trim().trim_matches('"').to_string())
                    .filter(|m| !m.is_empty()),
            );
        }
    }
    crates
}

/// The library source files (`<crate>/src/**/*.rs`) of the crates `crates` under `root`
/// longer than `limit` lines, one message each.
pub fn long_files(root: &Path, crates: &[String], limit: usize) -> Vec<String> {
    let mut out = Vec::new();
    for c in crates {
        for file in rust_files(&root.join(c).join("src")) {
            let lines = fs::read_to_string(&file).map_or(0, |s| s.lines().count());
            if lines > limit {
                let shown = file.strip_prefix(root).unwrap_or(&file);
                out.push(format!(
                    "{}: {lines} lines, more than {limit}",
                    shown.display()
                ));
            }
        }
    }
    out
}
