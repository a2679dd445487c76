//! The plan file: tuned plans kept across processes, so that a second process with the
//! same fusion, shapes, build, GPU and world runs the tuned plan without timing anything.
//!
//! One JSON object (`FUSION_PLAN_CACHE`, else `$XDG_CACHE_HOME/fusion/plans.json`, else
//! `$HOME/.cache/fusion/plans.json`):
//!
//! ```text
//! {"format": "fusion-plans", "version": 1,
//!  "entries": {"<key>": {"plan": "rs_ring4", "ms": 0.912, "default_ms": 0.981,
//!                        "fusion": "gemm_rs", "what": "<readable key>"}}}
//! ```
//!
//! The key is a 64-bit FNV-1a hash (hex) of everything that makes a plan valid: the
//! library version and plan-space revision, the fusion's text, dtypes and shapes, the
//! world (size, backend, how ranks reach each other), the GPU model, and the text of every
//! distinct candidate program (so a build that lowers differently misses). A file that is
//! not JSON, has another format or version, or an entry naming a plan that is not a
//! candidate, is ignored with a warning and never trusted. Writes go to a temporary file
//! renamed over the old one; deleting the file loses nothing but tuning time.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde_json::{json, Map, Value};

const FORMAT: &str = "fusion-plans";
const VERSION: u64 = 1;

/// A tuned plan as the file keeps it.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct FileEntry {
    /// The candidate's name.
    pub(super) plan: String,
    /// Its tuned time, ms (slowest rank's median).
    pub(super) ms: f64,
}

/// A stable 64-bit hash of `parts` (FNV-1a over each part and a separator).
pub(super) fn stable_key(parts: &[&str]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for b in part.bytes().chain([0xff]) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    format!("{h:016x}")
}

/// Serializes writers of this process (ranks of one process share the file).
static WRITE: Mutex<()> = Mutex::new(());

/// The entries of the file at `path`; `Err` with the warning to give when the file exists
/// but cannot be trusted. A missing file is empty.
pub(super) fn load(path: &Path) -> Result<Map<String, Value>, String> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Map::new()),
        Err(e) => return Err(format!("plan file {} ignored: {e}", path.display())),
    };
    let v: Value = serde_json::from_str(&text)
        .map_err(|e| format!("plan file {} ignored: not JSON ({e})", path.display()))?;
    let format = v.get("format").and_then(Value::as_str);
    let version = v.get("version").and_then(Value::as_u64);
    if format != Some(FORMAT) || version != Some(VERSION) {
        return Err(format!(
            "plan file {} ignored: format {:?} version {:?}, this build reads {FORMAT:?} \
             version {VERSION}; delete it or set FUSION_PLAN_CACHE elsewhere",
            path.display(),
            format,
            version
        ));
    }
    match v.get("entries") {
        Some(Value::Object(m)) => Ok(m.clone()),
        _ => Err(format!(
            "plan file {} ignored: no `entries` object",
            path.display()
        )),
    }
}

/// The entry under `key` in `entries`, if it is well formed (`Err`: the warning).
pub(super) fn entry(entries: &Map<String, Value>, key: &str) -> Result<Option<FileEntry>, String> {
    let Some(e) = entries.get(key) else {
        return Ok(None);
    };
    let plan = e.get("plan").and_then(Value::as_str);
    let ms = e.get("ms").and_then(Value::as_f64);
    match (plan, ms) {
        (Some(plan), Some(ms)) if ms.is_finite() && ms >= 0.0 => Ok(Some(FileEntry {
            plan: plan.to_string(),
            ms,
        })),
        _ => Err(format!(
            "plan file entry {key} ignored: no plan name and time"
        )),
    }
}

/// Adds (or replaces) `key`'s entry in the file at `path`, keeping the others; a file that
/// cannot be trusted is replaced.
pub(super) fn store(
    path: &Path,
    key: &str,
    entry: &FileEntry,
    extra: &[(&str, Value)],
) -> std::io::Result<()> {
    let _one_writer = WRITE.lock().unwrap_or_else(|p| p.into_inner());
    let mut entries = load(path).unwrap_or_default();
    let mut e = Map::new();
    e.insert("plan".into(), json!(entry.plan));
    e.insert("ms".into(), json!(entry.ms));
    for (k, v) in extra {
        e.insert((*k).into(), v.clone());
    }
    entries.insert(key.into(), Value::Object(e));
    let doc = json!({"format": FORMAT, "version": VERSION, "entries": entries});
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = temporary(path);
    std::fs::write(&tmp, serde_json::to_string_pretty(&doc)?)?;
    std::fs::rename(&tmp, path)
}

fn temporary(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".{}.tmp", std::process::id()));
    path.with_file_name(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "fusion-plan-file-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn entries_round_trip_and_keep_each_other() {
        let path = dir().join("plans.json");
        let _ = std::fs::remove_file(&path);
        assert!(load(&path).unwrap().is_empty(), "a missing file is empty");
        let a = FileEntry {
            plan: "rs_ring4".into(),
            ms: 0.5,
        };
        store(&path, "aa", &a, &[("fusion", json!("f"))]).unwrap();
        let b = FileEntry {
            plan: "default".into(),
            ms: 1.25,
        };
        store(&path, "bb", &b, &[]).unwrap();
        let entries = load(&path).unwrap();
        assert_eq!(entry(&entries, "aa").unwrap(), Some(a));
        assert_eq!(entry(&entries, "bb").unwrap(), Some(b));
        assert_eq!(entry(&entries, "cc").unwrap(), None);
    }

    #[test]
    fn untrusted_files_are_warned_about() {
        let path = dir().join("bad.json");
        std::fs::write(&path, "{ not json").unwrap();
        assert!(load(&path).unwrap_err().contains("not JSON"));
        std::fs::write(
            &path,
            r#"{"format": "fusion-plans", "version": 99, "entries": {}}"#,
        )
        .unwrap();
        assert!(load(&path).unwrap_err().contains("version"));
        std::fs::write(
            &path,
            r#"{"format": "fusion-plans", "version": 1, "entries": {"k": {"plan": 3}}}"#,
        )
        .unwrap();
        let entries = load(&path).unwrap();
        assert!(entry(&entries, "k").unwrap_err().contains("ignored"));
        // Storing over an untrusted file replaces it.
        std::fs::write(&path, "garbage").unwrap();
        let e = FileEntry {
            plan: "default".into(),
            ms: 1.0,
        };
        store(&path, "k", &e, &[]).unwrap();
        assert_eq!(entry(&load(&path).unwrap(), "k").unwrap(), Some(e));
    }

    #[test]
    fn keys_are_stable_and_separate_their_parts() {
        assert_eq!(stable_key(&["a", "b"]), stable_key(&["a", "b"]));
        assert_ne!(stable_key(&["ab", ""]), stable_key(&["a", "b"]));
        assert_eq!(stable_key(&[]).len(), 16);
    }
}
