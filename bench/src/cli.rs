//! What the tools' command lines share: comma-separated lists of sizes, the input seed
//! (fresh each run unless given, printed for a rerun), and writing a results file.

/// The numbers of a comma-separated list (`"2,4,8"`); what does not parse is skipped.
pub fn list(s: &str) -> Vec<usize> {
    s.split(',').filter_map(|x| x.trim().parse().ok()).collect()
}

/// `seed`, or one drawn from the clock so that every run gets fresh inputs.
pub fn seed_or_clock(seed: Option<u64>) -> u64 {
    seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |t| t.as_nanos() as u64)
    })
}

/// Writes `text` to `path`; a failure names the file.
pub fn write_file(path: &str, text: impl AsRef<[u8]>) -> fusion::Result<()> {
    std::fs::write(path, text).map_err(|e| fusion::Error::World(format!("writing {path}: {e}")))
}
