//! Device time per fusion call on a CUDA stream of the caller's: calls back to back (each
//! replaying the fusion's own graph where it can), or recorded into one CUDA graph of the
//! caller's and launched whole (the device's time alone, whatever the host's pace). Events
//! on the stream around each sample, every rank starting together, medians.

use std::sync::Arc;

use fusion::runtime::cudarc::driver::{sys, CudaStream, DriverError};
use fusion::runtime::{OnStream, Rank};
use fusion::Result;

use crate::measure::{barrier, median};

/// How many calls a sample times and how many samples the median takes.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    pub calls: usize,
    pub iters: usize,
}

impl Timing {
    /// Median microseconds per call of `call`: back to back, and (where `graph`) recorded
    /// into one graph of the caller's (else `Err` saying it was not asked for). Three
    /// untimed calls first.
    pub fn both_modes(
        &self,
        rank: &Rank,
        graph: bool,
        call: &dyn Fn(&OnStream<'_>) -> Result<()>,
    ) -> Result<(f64, std::result::Result<f64, String>)> {
        let stream = rank.cuda_context()?.new_stream().map_err(driver)?;
        let on = rank.on(&stream);
        for _ in 0..3 {
            call(&on)?;
        }
        let replay = self.per_call_us(rank, &stream, &|| {
            (0..self.calls).try_for_each(|_| call(&on))
        })?;
        let graph = if graph {
            self.captured(rank, &stream, call)
                .map_err(|e| e.to_string())
        } else {
            Err("not asked for (--graph)".to_string())
        };
        Ok((replay, graph))
    }

    /// Median device microseconds per call with `calls` calls recorded into one graph of
    /// the caller's (three untimed calls first).
    pub fn graph_us(&self, rank: &Rank, call: &dyn Fn(&OnStream<'_>) -> Result<()>) -> Result<f64> {
        let stream = rank.cuda_context()?.new_stream().map_err(driver)?;
        let on = rank.on(&stream);
        for _ in 0..3 {
            call(&on)?;
        }
        self.captured(rank, &stream, call)
    }

    fn captured(
        &self,
        rank: &Rank,
        stream: &Arc<CudaStream>,
        call: &dyn Fn(&OnStream<'_>) -> Result<()>,
    ) -> Result<f64> {
        let on = rank.on(stream);
        stream.synchronize().map_err(driver)?;
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(driver)?;
        let recorded: Result<()> = (0..self.calls).try_for_each(|_| call(&on));
        let graph = stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .map_err(driver);
        recorded?;
        let graph =
            graph?.ok_or_else(|| fusion::Error::World("the capture recorded nothing".into()))?;
        graph.launch().map_err(driver)?;
        self.per_call_us(rank, stream, &|| graph.launch().map_err(driver))
    }

    /// Median microseconds per call over `iters` samples of `run` (`calls` calls).
    fn per_call_us(
        &self,
        rank: &Rank,
        stream: &Arc<CudaStream>,
        run: &dyn Fn() -> Result<()>,
    ) -> Result<f64> {
        let event = || {
            stream
                .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(driver)
        };
        let mut samples = Vec::new();
        for _ in 0..self.iters {
            barrier(rank)?;
            stream.synchronize().map_err(driver)?;
            let start = event()?;
            run()?;
            let end = event()?;
            end.synchronize().map_err(driver)?;
            let ms = start.elapsed_ms(&end).map_err(driver)?;
            samples.push(f64::from(ms) * 1e3 / self.calls as f64);
        }
        Ok(median(samples))
    }
}

/// A CUDA driver error as the library's error.
pub fn driver(e: DriverError) -> fusion::Error {
    fusion::Error::World(format!("CUDA: {e:?}"))
}
