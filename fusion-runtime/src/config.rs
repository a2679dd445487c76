//! The environment variables the library reads, in one place: their names, how each is
//! parsed, its default, and the error for a value it does not accept.
//!
//! Only what a user sets from outside a program is read here (which backend, how many
//! devices, the timeout, dumps, the trace directory, where a launched process sits, and the
//! launched job's token); everything a program chooses is an option in code
//! ([`crate::ExecOptions`], a [`crate::World`] setting). `docs/ENVIRONMENT.md` lists the same variables, and a test
//! checks the two against each other. No other module of the library reads a `FUSION_*`
//! variable.

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use crate::comm::remote::JobToken;
use crate::device::BackendKind;
use crate::error::{Error, Result};

/// `cpu` or `cuda`: the backend of an in-process world (unset: CUDA when GPUs are usable).
pub const BACKEND: &str = "FUSION_BACKEND";
/// How many devices an in-process world has (unset: every visible GPU, or 4 simulated).
pub const DEVICES: &str = "FUSION_DEVICES";
/// Seconds a communication or the rendezvous waits for its peers (unset: 60).
pub const TIMEOUT: &str = "FUSION_TIMEOUT";
/// What to print when a fusion is lowered: `fusion`, `host_ir`, `host_ir_passes`.
pub const DUMP: &str = "FUSION_DUMP";
/// A directory that receives a trace file of every call (unset: none).
pub const TRACE: &str = "FUSION_TRACE";
/// This process's rank among the launched processes (with [`WORLD_SIZE`]).
pub const RANK: &str = "FUSION_RANK";
/// Number of launched processes (with [`RANK`]).
pub const WORLD_SIZE: &str = "FUSION_WORLD_SIZE";
/// This process's index among the launched processes of its node.
pub const LOCAL_RANK: &str = "FUSION_LOCAL_RANK";
/// Number of launched processes on this node.
pub const LOCAL_WORLD_SIZE: &str = "FUSION_LOCAL_WORLD_SIZE";
/// Host of the rendezvous (rank 0's process); overrides `MASTER_ADDR`.
pub const MASTER_ADDR: &str = "FUSION_MASTER_ADDR";
/// Port of the rendezvous; overrides `MASTER_PORT`.
pub const MASTER_PORT: &str = "FUSION_MASTER_PORT";
/// Ranks (GPUs) per launched process: a positive number, or `all` GPUs of the node.
pub const DEVICES_PER_PROCESS: &str = "FUSION_DEVICES_PER_PROCESS";
/// The launched job's secret, the same on every rank: only connections that prove
/// knowledge of it join the world (unset: any connection that speaks the protocol).
pub const JOB_TOKEN: &str = "FUSION_JOB_TOKEN";
/// How a call's plan is chosen where its options leave it open: `off` (the default
/// plan), `model` (the cost model's pick) or `tune` (timed at the first call per shape).
pub const PLAN: &str = "FUSION_PLAN";
/// The file of tuned plans (unset: `$XDG_CACHE_HOME/fusion/plans.json`, else
/// `$HOME/.cache/fusion/plans.json`; `off`: no file).
pub const PLAN_CACHE: &str = "FUSION_PLAN_CACHE";

/// Every variable the library reads.
pub const VARIABLES: [&str; 15] = [
    BACKEND,
    DEVICES,
    TIMEOUT,
    DUMP,
    TRACE,
    RANK,
    WORLD_SIZE,
    LOCAL_RANK,
    LOCAL_WORLD_SIZE,
    MASTER_ADDR,
    MASTER_PORT,
    DEVICES_PER_PROCESS,
    JOB_TOKEN,
    PLAN,
    PLAN_CACHE,
];

/// Default time a communication (or the bootstrap) may wait for its peers before failing.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// Reads an environment variable of the process: launcher variables (those of
/// [`crate::world::launcher`], `FUSION_*` and other launchers' alike) come through here.
pub(crate) fn var(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// The error for `value` of `variable`, which takes `expected`.
pub(crate) fn bad(variable: &'static str, value: &str, expected: &'static str) -> Error {
    Error::Environment {
        variable,
        value: value.to_string(),
        expected,
    }
}

/// [`BACKEND`]: the backend asked for, if any.
pub fn backend() -> Result<Option<BackendKind>> {
    parse_backend(var(BACKEND).as_deref())
}

fn parse_backend(v: Option<&str>) -> Result<Option<BackendKind>> {
    match v {
        None => Ok(None),
        Some("cpu") => Ok(Some(BackendKind::Cpu)),
        Some("cuda") => Ok(Some(BackendKind::Cuda)),
        Some(other) => Err(bad(BACKEND, other, "`cpu` or `cuda`")),
    }
}

/// [`DEVICES`]: the number of devices asked for, if any.
pub fn devices() -> Result<Option<usize>> {
    parse_devices(var(DEVICES).as_deref())
}

fn parse_devices(v: Option<&str>) -> Result<Option<usize>> {
    match v {
        None => Ok(None),
        Some(v) => v
            .trim()
            .parse::<usize>()
            .map(Some)
            .map_err(|_| bad(DEVICES, v, "a number of devices")),
    }
}

/// [`TIMEOUT`] in seconds, else [`DEFAULT_TIMEOUT`].
pub fn timeout() -> Result<Duration> {
    parse_timeout(var(TIMEOUT).as_deref())
}

fn parse_timeout(v: Option<&str>) -> Result<Duration> {
    match v {
        None => Ok(DEFAULT_TIMEOUT),
        Some(v) => match v.trim().parse::<f64>() {
            Ok(s) if s > 0.0 && s.is_finite() => Ok(Duration::from_secs_f64(s)),
            _ => Err(bad(TIMEOUT, v, "a positive number of seconds")),
        },
    }
}

/// How many ranks a launched process holds ([`DEVICES_PER_PROCESS`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PerProcess {
    /// This many.
    Count(usize),
    /// Every GPU the process sees (`all`).
    All,
}

/// [`DEVICES_PER_PROCESS`], if set.
pub fn devices_per_process() -> Result<Option<PerProcess>> {
    parse_per_process(var(DEVICES_PER_PROCESS).as_deref())
}

fn parse_per_process(v: Option<&str>) -> Result<Option<PerProcess>> {
    match v {
        None => Ok(None),
        Some("all") => Ok(Some(PerProcess::All)),
        Some(v) => match v.trim().parse::<usize>() {
            Ok(n) if n > 0 => Ok(Some(PerProcess::Count(n))),
            _ => Err(bad(
                DEVICES_PER_PROCESS,
                v,
                "a positive number, or `all` (GPUs only)",
            )),
        },
    }
}

/// [`JOB_TOKEN`]: the job's token, if set (its value never appears in an error).
pub fn job_token() -> Result<Option<JobToken>> {
    parse_job_token(std::env::var_os(JOB_TOKEN).as_deref())
}

fn parse_job_token(v: Option<&std::ffi::OsStr>) -> Result<Option<JobToken>> {
    match v {
        None => Ok(None),
        Some(v) => JobToken::new(v.as_encoded_bytes()).map(Some).map_err(|_| {
            bad(
                JOB_TOKEN,
                "",
                "a secret of at least one byte (unset it for none)",
            )
        }),
    }
}

/// Which dumps [`DUMP`] asks for (comma-separated: `fusion`, `host_ir`, `host_ir_passes`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DumpOptions {
    /// Print the fusion when it is lowered.
    pub fusion: bool,
    /// Print the lowered host program (and, on GPUs, each rank's transports and whether
    /// its calls can be replayed).
    pub host_ir: bool,
    /// Print the host program after every pass.
    pub host_ir_passes: bool,
}

impl DumpOptions {
    /// Reads [`DUMP`] (read at every lowering, so a program may change it between).
    pub fn from_env() -> Result<Self> {
        parse_dump(var(DUMP).as_deref())
    }
}

fn parse_dump(v: Option<&str>) -> Result<DumpOptions> {
    let mut d = DumpOptions::default();
    for item in v.unwrap_or_default().split(',').map(str::trim) {
        match item {
            "" => {}
            "fusion" => d.fusion = true,
            "host_ir" => d.host_ir = true,
            "host_ir_passes" => d.host_ir_passes = true,
            _ => {
                return Err(bad(
                    DUMP,
                    v.unwrap_or_default(),
                    "a comma-separated list of `fusion`, `host_ir`, `host_ir_passes`",
                ))
            }
        }
    }
    Ok(d)
}

/// [`TRACE`]: the directory for every call's trace file, if set and not empty (read once
/// per process).
pub fn trace_dir() -> Option<PathBuf> {
    static FROM_ENV: OnceLock<Option<PathBuf>> = OnceLock::new();
    FROM_ENV
        .get_or_init(|| {
            std::env::var_os(TRACE)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        })
        .clone()
}

/// How [`PLAN`] says plans are chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlanSetting {
    /// `off`: the default plan.
    Off,
    /// `model`: the cost model's pick, nothing timed.
    Model,
    /// `tune`: candidates timed at the first call of each shape.
    Tune,
}

/// [`PLAN`], if set (read at every plan decision).
pub fn plan() -> Result<Option<PlanSetting>> {
    parse_plan(var(PLAN).as_deref())
}

fn parse_plan(v: Option<&str>) -> Result<Option<PlanSetting>> {
    match v.map(str::trim) {
        None | Some("") => Ok(None),
        Some("off") => Ok(Some(PlanSetting::Off)),
        Some("model") => Ok(Some(PlanSetting::Model)),
        Some("tune") => Ok(Some(PlanSetting::Tune)),
        Some(other) => Err(bad(PLAN, other, "`off`, `model` or `tune`")),
    }
}

/// Where tuned plans are kept ([`PLAN_CACHE`]): `None` when set to `off`, or when no
/// cache directory is known.
pub fn plan_cache() -> Option<PathBuf> {
    let home = |v: &str| {
        std::env::var_os(v)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    match var(PLAN_CACHE).as_deref().map(str::trim) {
        Some("off") => None,
        Some(p) if !p.is_empty() => Some(PathBuf::from(p)),
        _ => home("XDG_CACHE_HOME")
            .or_else(|| home("HOME").map(|h| h.join(".cache")))
            .map(|d| d.join("fusion").join("plans.json")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The message of an error for a bad value names the variable, the value and what is
    /// accepted.
    fn says(e: Error, var: &str, value: &str, accepted: &str) {
        let text = e.to_string();
        for part in [var, value, accepted] {
            assert!(text.contains(part), "`{text}` does not name `{part}`");
        }
    }

    #[test]
    fn unset_variables_give_the_defaults() {
        assert_eq!(parse_backend(None).unwrap(), None);
        assert_eq!(parse_devices(None).unwrap(), None);
        assert_eq!(parse_timeout(None).unwrap(), DEFAULT_TIMEOUT);
        assert_eq!(parse_per_process(None).unwrap(), None);
        assert_eq!(parse_dump(None).unwrap(), DumpOptions::default());
        assert!(parse_job_token(None).unwrap().is_none());
    }

    #[test]
    fn accepted_values_parse() {
        assert_eq!(parse_backend(Some("cpu")).unwrap(), Some(BackendKind::Cpu));
        assert_eq!(
            parse_backend(Some("cuda")).unwrap(),
            Some(BackendKind::Cuda)
        );
        assert_eq!(parse_devices(Some(" 3 ")).unwrap(), Some(3));
        assert_eq!(
            parse_timeout(Some("2.5")).unwrap(),
            Duration::from_millis(2500)
        );
        assert_eq!(
            parse_per_process(Some("2")).unwrap(),
            Some(PerProcess::Count(2))
        );
        assert_eq!(
            parse_per_process(Some("all")).unwrap(),
            Some(PerProcess::All)
        );
        assert_eq!(
            parse_dump(Some("host_ir, fusion,")).unwrap(),
            DumpOptions {
                fusion: true,
                host_ir: true,
                host_ir_passes: false
            }
        );
        assert_eq!(parse_dump(Some("")).unwrap(), DumpOptions::default());
        let token = parse_job_token(Some("s3cret".as_ref())).unwrap().unwrap();
        assert_eq!(format!("{token:?}"), "JobToken(..)", "never printed");
    }

    #[test]
    fn bad_values_name_the_variable_the_value_and_what_is_accepted() {
        says(
            parse_backend(Some("gpu")).unwrap_err(),
            "FUSION_BACKEND",
            "gpu",
            "`cpu` or `cuda`",
        );
        says(
            parse_devices(Some("four")).unwrap_err(),
            "FUSION_DEVICES",
            "four",
            "a number of devices",
        );
        for v in ["0", "-1", "inf", "soon"] {
            says(
                parse_timeout(Some(v)).unwrap_err(),
                "FUSION_TIMEOUT",
                v,
                "a positive number of seconds",
            );
        }
        for v in ["0", "many"] {
            says(
                parse_per_process(Some(v)).unwrap_err(),
                "FUSION_DEVICES_PER_PROCESS",
                v,
                "a positive number, or `all`",
            );
        }
        says(
            parse_dump(Some("host_ir,graphs")).unwrap_err(),
            "FUSION_DUMP",
            "host_ir,graphs",
            "`fusion`, `host_ir`, `host_ir_passes`",
        );
        says(
            parse_plan(Some("fast")).unwrap_err(),
            "FUSION_PLAN",
            "fast",
            "`off`, `model` or `tune`",
        );
        assert_eq!(parse_plan(Some("tune")).unwrap(), Some(PlanSetting::Tune));
        assert_eq!(parse_plan(None).unwrap(), None);
        says(
            parse_job_token(Some("".as_ref())).unwrap_err(),
            "FUSION_JOB_TOKEN",
            "=",
            "at least one byte",
        );
    }
}
