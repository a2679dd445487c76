//! The lessons' command line: each lesson's own dimensions (`D`) followed by the flags
//! every lesson takes, and the execution options those flags choose.

use clap::{Args, Command, CommandFactory, FromArgMatches, Parser, ValueEnum};
use fusion::prelude::*;

use super::dtype::Dt;

/// A lesson's command line: its dimensions, then the common flags.
#[derive(Parser, Debug)]
pub struct Cli<D: Args> {
    #[command(flatten)]
    pub dims: D,
    #[command(flatten)]
    pub common: Common,
}

impl<D: Args> Cli<D> {
    /// Parses the process's arguments (exiting with clap's message on a mistake or after
    /// `--help`); the command's description is the lesson's, `D`'s doc comment.
    pub fn parse_lesson() -> Cli<D> {
        let mut command = Cli::<D>::command();
        if let Some(about) = D::augment_args(Command::new("")).get_about() {
            command = command.about(about.clone());
        }
        let matches = command.get_matches();
        Cli::<D>::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
    }
}

/// Options every lesson takes.
#[derive(Args, Debug)]
pub struct Common {
    /// Devices to run on [default: every GPU, else 4 simulated CPU devices]
    #[arg(long)]
    pub devices: Option<usize>,
    /// Element type of the tensors
    #[arg(long, value_enum, default_value_t = Dt::F32)]
    pub dtype: Dt,
    /// Size of the worker stream pool (`numberOfStreams`)
    #[arg(long, default_value_t = 4)]
    pub streams: usize,
    /// Timed calls, after one warm-up call that lowers the fusion
    #[arg(long, default_value_t = 10)]
    pub iters: usize,
    /// Print the host program the fusion lowers to
    #[arg(long)]
    pub dump: bool,
    /// Whether stream loops are pipelined: `auto` from 256 rows per chunk on
    /// (`LowerOptions::pipelines.pipelining`), `always` or `never`
    #[arg(long, value_enum, default_value_t = Pipe::Auto)]
    pub pipelining: Pipe,
}

/// `--pipelining` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Pipe {
    Auto,
    Always,
    Never,
}

impl Common {
    /// Execution options from `--streams` and `--pipelining`.
    pub fn options(&self) -> ExecOptions {
        ExecOptions {
            number_of_streams: self.streams,
            lower: LowerOptions {
                pipelines: fusion::PipelineOptions {
                    pipelining: match self.pipelining {
                        Pipe::Auto => Pipelining::Auto,
                        Pipe::Always => Pipelining::Always,
                        Pipe::Never => Pipelining::Never,
                    },
                    ..Default::default()
                },
                ..LowerOptions::default()
            },
            ..ExecOptions::default()
        }
    }
}
