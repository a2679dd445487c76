//! What a program sets in code about the launched world it joins, beyond the launcher's
//! variables: the job token ([`LaunchOptions::job_token`]).

use crate::comm::remote::JobToken;
use crate::config;
use crate::error::Result;

/// Settings of a launched world made in code, for [`crate::World::from_env_with`]; what
/// is left unset comes from the environment, as for [`crate::World::from_env`].
///
/// ```no_run
/// # use fusion_runtime::world::{JobToken, LaunchOptions};
/// # use fusion_runtime::World;
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let secret = std::fs::read("/run/secrets/job-token")?; // the same on every rank
/// let options = LaunchOptions::default().job_token(JobToken::new(secret)?);
/// let world = World::from_env_with(&options)?;
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, Default)]
pub struct LaunchOptions {
    job_token: Option<JobToken>,
}

impl LaunchOptions {
    /// Only connections that prove knowledge of `token` join the world (every rank must be
    /// given the same). Wins over `FUSION_JOB_TOKEN`.
    pub fn job_token(mut self, token: JobToken) -> Self {
        self.job_token = Some(token);
        self
    }

    /// The world's token: the one set here, else `FUSION_JOB_TOKEN`'s, else none.
    pub(crate) fn token(&self) -> Result<Option<JobToken>> {
        match &self.job_token {
            Some(t) => Ok(Some(t.clone())),
            None => config::job_token(),
        }
    }
}
