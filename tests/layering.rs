//! The layers of the workspace's crates hold, and no library source file is too long.
//!
//! `docs/ARCHITECTURE.md` documents the layers of a crate's source folder as fenced blocks
//! with info string `layers`: the folder (from the repository root), then one line per
//! layer, top first, naming its top-level modules (file stem or folder name):
//!
//! ```text
//! fusion-compiler/src
//! lower
//! pass
//! hir builder
//! ir
//! dtype error
//! ```
//!
//! Every `crate::`, `self::` and `super::` path in the folder's `.rs` files (in `use` trees,
//! grouped ones included, and in code; not in comments or literals), and every name the
//! crate root re-exports, counts as a use of the top-level module it reaches. The test
//! fails, naming the file, line and both modules, on a use of a module of a higher layer
//! and on an import circle among the modules of one layer; and on a top-level module on no
//! layer or a layer naming no module.

#[path = "layering/check.rs"]
mod check;
#[path = "layering/scan.rs"]
mod scan;

use std::fs;
use std::path::{Path, PathBuf};

use check::{check, long_files, parse_blocks, workspace_crates};

/// The longest a library source file may be, in lines.
const MAX_FILE_LINES: usize = 800;

fn repository() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn documented_layers_hold() {
    let page = "docs/ARCHITECTURE.md";
    let md = fs::read_to_string(repository().join(page)).expect("docs/ARCHITECTURE.md");
    let blocks = parse_blocks(&md, page);
    assert!(!blocks.is_empty(), "{page} documents no `layers` block");
    let errors: Vec<String> = blocks.iter().flat_map(|b| check(repository(), b)).collect();
    assert!(
        errors.is_empty(),
        "the code breaks the layers of {page}:\n{}",
        errors.join("\n")
    );
}

#[test]
fn no_library_file_is_too_long() {
    let errors = long_files(
        repository(),
        &workspace_crates(repository()),
        MAX_FILE_LINES,
    );
    assert!(
        errors.is_empty(),
        "library source files over {MAX_FILE_LINES} lines:\n{}",
        errors.join("\n")
    );
}

/// A source tree in a fresh temporary folder, removed on drop.
struct Tree(PathBuf);

impl Tree {
    /// Writes `files` (path, text) under a new folder named after `name`.
    fn new(name: &str, files: &[(&str, &str)]) -> Self {
        let root =
            std::env::temp_dir().join(format!("fusion-layering-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        for (path, text) in files {
            let p = root.join(path);
            fs::create_dir_all(p.parent().expect("a parent")).expect("a folder");
            fs::write(p, text).expect("a file");
        }
        Tree(root)
    }

    /// The errors of the tree against the `layers` blocks of its `LAYERS.md`.
    fn errors(&self) -> Vec<String> {
        let md = fs::read_to_string(self.0.join("LAYERS.md")).expect("LAYERS.md");
        parse_blocks(&md, "LAYERS.md")
            .iter()
            .flat_map(|b| check(&self.0, b))
            .collect()
    }
}

impl Drop for Tree {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// Layers `top`, `mid`, `low a b`, `base` of the crate `c/src`.
const LAYERS: (&str, &str) = (
    "LAYERS.md",
    "# Layers\n\n```layers\nc/src\ntop\nmid\nlow a b\nbase\n```\n",
);

/// A crate root declaring the layers' modules, re-exporting one name of `top`.
const ROOT: (&str, &str) = (
    "c/src/lib.rs",
    "mod top; mod mid; mod low; mod a; mod b; mod base;\npub use top::{Top, self as t};\n",
);

/// `c/src` obeying `LAYERS`, with uses of every form, and mentions in comments and
/// literals that are no uses.
const CLEAN: [(&str, &str); 9] = [
    LAYERS,
    ROOT,
    ("c/src/top.rs", "use crate::{mid::Mid, low::{self, x}};\npub struct Top;\nfn f() { crate::base::g(); }\n"),
    ("c/src/mid/mod.rs", "mod inner;\npub struct Mid;\nuse self::inner::X;\n"),
    (
        "c/src/mid/inner.rs",
        "use super::super::low::L;\nuse super::Mid;\nfn f() -> &'static str { let c = '\"'; \"crate::top\" }\n",
    ),
    (
        "c/src/low.rs",
        "// crate::top::Top\n/* crate::mid /* nested */ crate::top */\n/// [`crate::Top`]\nfn f<'a>(x: &'a str) -> &'a str { let _ = r#\"crate::mid\"#; let _ = b'c'; x }\nuse crate::a::A;\n",
    ),
    ("c/src/a.rs", "use crate::base::B;\nmod tests { use super::super::b::B; }\n"),
    ("c/src/b.rs", "use crate::base::B;\npub(crate) struct B;\nfn f(r#use: u8) { let _ = 1_u8..2; }\n"),
    ("c/src/base.rs", "pub struct B;\n"),
];

#[test]
fn a_tree_that_keeps_its_layers_passes() {
    assert_eq!(Tree::new("clean", &CLEAN).errors(), Vec::<String>::new());
}

/// The errors of `CLEAN` with `changes` (path, text) written over it.
fn with(name: &str, changes: &[(&'static str, &'static str)]) -> Vec<String> {
    let mut files: Vec<(&str, &str)> = CLEAN.to_vec();
    for change in changes {
        files.retain(|(p, _)| *p != change.0);
        files.push(*change);
    }
    Tree::new(name, &files).errors()
}

#[test]
fn a_use_of_a_higher_layer_fails() {
    let errors = with(
        "up",
        &[
            // A path in code, a grouped use, a `super::` path and a re-exported name.
            (
                "c/src/base.rs",
                "pub struct B;\nfn f() {\n    crate::low::g();\n}\nuse crate::{a::A, mid};\n",
            ),
            ("c/src/low.rs", "use crate::Top;\n"),
            ("c/src/mid/inner.rs", "fn f() { super::super::top::g() }\n"),
        ],
    );
    assert_eq!(
        errors,
        [
            "c/src/base.rs:3: `base` (layer 4) uses `low`, which is on a higher layer (3)",
            "c/src/base.rs:5: `base` (layer 4) uses `a`, which is on a higher layer (3)",
            "c/src/base.rs:5: `base` (layer 4) uses `mid`, which is on a higher layer (2)",
            "c/src/low.rs:1: `low` (layer 3) uses `top`, which is on a higher layer (1)",
            "c/src/mid/inner.rs:1: `mid` (layer 2) uses `top`, which is on a higher layer (1)",
        ]
    );
}

#[test]
fn an_import_circle_within_a_layer_fails() {
    let errors = with("circle", &[("c/src/b.rs", "\nuse crate::low::L;\n")]);
    assert_eq!(
        errors,
        ["import circle a -> b -> low -> a (c/src/a.rs:2: `a` uses `b`; c/src/b.rs:2: `b` uses `low`; c/src/low.rs:5: `low` uses `a`)"]
    );
}

#[test]
fn a_module_on_no_layer_or_a_layer_naming_no_module_fails() {
    let errors = with(
        "missing",
        &[
            ("c/src/stray/mod.rs", "pub struct S;\n"),
            (
                "LAYERS.md",
                "```layers\nc/src\ntop ghost\nmid\nlow a b\nbase\n```\n",
            ),
        ],
    );
    assert_eq!(
        errors,
        [
            "LAYERS.md:1: layer 1 names `ghost`, which is no module of c/src",
            "c/src/stray: module `stray` is on no layer of LAYERS.md:1",
        ]
    );
}

#[test]
fn a_long_library_file_fails() {
    let long = "fn f() {}\n".repeat(MAX_FILE_LINES + 1);
    let tree = Tree::new(
        "long",
        &[
            ("Cargo.toml", "[workspace]\nmembers = [\"m\"]\n"),
            ("src/lib.rs", ""),
            ("m/src/x/y.rs", &long),
        ],
    );
    assert_eq!(
        long_files(&tree.0, &workspace_crates(&tree.0), MAX_FILE_LINES),
        [format!(
            "m/src/x/y.rs: {} lines, more than {MAX_FILE_LINES}",
            MAX_FILE_LINES + 1
        )]
    );
}
