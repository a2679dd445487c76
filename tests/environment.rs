//! The environment variables of the library against their documentation: every `FUSION_*`
//! name in the library's sources is in `docs/ENVIRONMENT.md`'s table, every name in the
//! table is one `fusion::runtime::config` reads, there are at most 13, and only
//! `config.rs` names one as a string of its own (everything else goes through it).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use fusion::runtime::config;

/// The crates whose `src/` is the library (tests, examples and scripts are not).
const LIBRARY_SOURCES: [&str; 5] = [
    "src",
    "fusion-compiler/src",
    "fusion-runtime/src",
    "fusion-macros/src",
    "fusion-candle/src",
];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every `.rs` file under `dir`.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The `FUSION_*` names in `text` (a name is `FUSION_` and upper-case letters, digits or
/// underscores, not ending in one).
fn names(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while let Some(at) = text[i..].find("FUSION_") {
        let start = i + at;
        let preceded =
            start > 0 && (bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_');
        let mut end = start + "FUSION_".len();
        while end < bytes.len()
            && (bytes[end].is_ascii_uppercase()
                || bytes[end].is_ascii_digit()
                || bytes[end] == b'_')
        {
            end += 1;
        }
        let name = text[start..end].trim_end_matches('_');
        if !preceded && name.len() > "FUSION".len() {
            found.push(name.to_string());
        }
        i = end;
    }
    found
}

/// The variables of the documentation's table: its rows' first cells.
fn documented() -> BTreeSet<String> {
    let doc = std::fs::read_to_string(root().join("docs/ENVIRONMENT.md")).unwrap();
    let mut rows = BTreeSet::new();
    for line in doc.lines() {
        let Some(rest) = line.strip_prefix("| `FUSION_") else {
            continue;
        };
        let cells: Vec<&str> = line.split(" | ").collect();
        let name = format!(
            "FUSION_{}",
            &rest[..rest.find('`').expect("a closing backtick")]
        );
        // The replaced-variables table has two columns; the variables' table four, none empty.
        if cells.len() == 2 {
            continue;
        }
        assert_eq!(
            cells.len(),
            4,
            "{name}: want what, default and values: {line}"
        );
        assert!(
            cells.iter().all(|c| !c.trim_matches(['|', ' ']).is_empty()),
            "{name}: an empty cell: {line}"
        );
        assert!(rows.insert(name.clone()), "{name} is documented twice");
    }
    rows
}

#[test]
fn every_variable_is_documented_and_read_by_config() {
    let documented = documented();
    let read: BTreeSet<String> = config::VARIABLES.iter().map(|s| s.to_string()).collect();
    assert_eq!(
        read.len(),
        config::VARIABLES.len(),
        "config lists a name twice"
    );
    assert!(read.len() <= 15, "{} variables: {read:?}", read.len());
    assert_eq!(
        documented, read,
        "docs/ENVIRONMENT.md's table and config::VARIABLES differ"
    );
    let mut files = Vec::new();
    for dir in LIBRARY_SOURCES {
        rust_files(&root().join(dir), &mut files);
    }
    assert!(files.len() > 50, "found only {} source files", files.len());
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        let is_config = file.ends_with("fusion-runtime/src/config.rs");
        for name in names(&text) {
            assert!(
                documented.contains(&name),
                "{name} (in {}) is not in docs/ENVIRONMENT.md's table",
                file.display()
            );
            // Outside config.rs a name may appear in messages and comments, never as the
            // whole of a string (a key someone would read).
            assert!(
                is_config || !text.contains(&format!("\"{name}\"")),
                "{} names \"{name}\" itself: read it through fusion_runtime::config",
                file.display()
            );
        }
        if !is_config {
            for line in text.lines().filter(|l| l.contains("env::var")) {
                assert!(
                    !line.contains("FUSION_"),
                    "{} reads a FUSION_ variable outside config.rs: {line}",
                    file.display()
                );
            }
        }
    }
}

#[test]
fn names_are_found_whole() {
    assert_eq!(
        names("FUSION_DUMP=host_ir; `FUSION_RANK`, FUSION_* and MY_FUSION_X"),
        ["FUSION_DUMP", "FUSION_RANK"]
    );
}
