//! Where a step's time goes (`--sections`): the layer marks the start of each of its parts
//! (norm and column-parallel GEMMs, attention, each row-parallel projection and its sum,
//! ...) and, after the step, each part's time is the time from its mark to the next. On a
//! GPU the marks are events on candle's stream, so a part's time is the stream's: its
//! kernels and any wait for the host to launch them (a host-bound part shows as a long
//! one); beside it, the host's time from the part's mark to the next (how long the host
//! took to issue the part: when it is as long as the stream's, the host is what the part
//! waits for). On the CPU both are the host's clock (candle's CPU ops run as they are
//! called).
//! A recorded step (`--graph`) keeps the marks it made while it was recorded: on a GPU each
//! is an event-record node of the step's graph (`CU_EVENT_RECORD_EXTERNAL`), so every replay
//! records the same events again and a part's time is the replayed graph's from node to
//! node (the nodes themselves can cost the graph a little: compare the step's total with a
//! run without `--sections`). There is no host time per part in a replay (one launch).

use std::time::Instant;

use candle_core::Device;

/// One mark.
enum Mark {
    Host(Instant),
    #[cfg(feature = "candle-cuda")]
    Event(fusion::runtime::cudarc::driver::CudaEvent),
}

/// The marks of the step under way and every finished step's part times.
pub struct Sections {
    #[cfg(feature = "candle-cuda")]
    stream: Option<std::sync::Arc<fusion::runtime::cudarc::driver::CudaStream>>,
    marks: Vec<(&'static str, Mark, Instant)>,
    /// While a step is recorded: marks become nodes of the recorded graph.
    recording: bool,
    /// The marks of the recorded step, read again after every replay.
    kept: Vec<(&'static str, Mark)>,
    /// Per part, in the order parts first appeared: milliseconds per step on the mark's
    /// clock, and on the host's.
    times: Vec<(&'static str, Vec<f64>, Vec<f64>)>,
}

/// One part's median milliseconds per step: on the marks' clock (the stream's on a GPU)
/// and on the host's.
pub struct PartTime {
    pub name: &'static str,
    pub ms: f64,
    pub host_ms: f64,
}

impl Sections {
    /// Marks on `device`'s stream (a CUDA device's) or the host's clock.
    pub fn new(device: &Device) -> Self {
        #[cfg(not(feature = "candle-cuda"))]
        let _ = device;
        Sections {
            #[cfg(feature = "candle-cuda")]
            stream: fusion_candle::stream_of(device),
            marks: Vec::new(),
            recording: false,
            kept: Vec::new(),
            times: Vec::new(),
        }
    }

    /// The marks from here to [`Sections::end_recording`] go into the step being recorded
    /// on the marks' stream (a CUDA graph capture; on the CPU, host marks as usual).
    pub fn begin_recording(&mut self) {
        self.marks.clear();
        self.recording = true;
    }

    /// Closes the recorded step's marks: they are read after each replay
    /// ([`Sections::finish_replay`]).
    pub fn end_recording(&mut self) -> candle_core::Result<()> {
        self.mark("end")?;
        self.recording = false;
        self.kept = std::mem::take(&mut self.marks)
            .into_iter()
            .map(|(name, mark, _)| (name, mark))
            .collect();
        Ok(())
    }

    /// After a replay of the recorded step (its work done): each part's time between the
    /// kept marks, as recorded again by the replay. On the CPU a replay runs the body again
    /// and marks as an eager step does: this closes that step.
    pub fn finish_replay(&mut self) -> candle_core::Result<()> {
        if !self.marks.is_empty() {
            return self.finish_step();
        }
        let mut parts = Vec::new();
        for pair in self.kept.windows(2) {
            parts.push((pair[0].0, between(&pair[0].1, &pair[1].1)?));
        }
        for (name, ms) in parts {
            self.push(name, ms, f64::NAN);
        }
        Ok(())
    }

    /// Adds one part's times of one step.
    fn push(&mut self, name: &'static str, ms: f64, host_ms: f64) {
        match self.times.iter_mut().find(|(n, _, _)| *n == name) {
            Some((_, v, h)) => {
                v.push(ms);
                h.push(host_ms);
            }
            None => self.times.push((name, vec![ms], vec![host_ms])),
        }
    }

    /// Part `name` starts here (and the one before ends).
    pub fn mark(&mut self, name: &'static str) -> candle_core::Result<()> {
        #[cfg(feature = "candle-cuda")]
        if let Some(stream) = &self.stream {
            use fusion::runtime::cudarc::driver::sys;
            let flags = sys::CUevent_flags::CU_EVENT_DEFAULT;
            let failed = |e| candle_core::Error::msg(format!("recording a mark: {e:?}"));
            let event = if self.recording {
                let event = stream.context().new_event(Some(flags)).map_err(failed)?;
                let external = sys::CUevent_record_flags::CU_EVENT_RECORD_EXTERNAL as u32;
                // SAFETY: a live event and stream of one context (the event was made in the
                // stream's); the record is a node of the stream's capture.
                let rc = unsafe {
                    sys::cuEventRecordWithFlags(event.cu_event(), stream.cu_stream(), external)
                };
                rc.result().map_err(failed)?;
                event
            } else {
                stream.record_event(Some(flags)).map_err(failed)?
            };
            self.marks.push((name, Mark::Event(event), Instant::now()));
            return Ok(());
        }
        let now = Instant::now();
        self.marks.push((name, Mark::Host(now), now));
        Ok(())
    }

    /// Closes the step (its work done: the caller synchronized): each part's time, from
    /// its mark to the next mark or `end`.
    pub fn finish_step(&mut self) -> candle_core::Result<()> {
        self.mark("end")?;
        let marks = std::mem::take(&mut self.marks);
        for pair in marks.windows(2) {
            let ms = between(&pair[0].1, &pair[1].1)?;
            let host_ms = pair[1].2.duration_since(pair[0].2).as_secs_f64() * 1e3;
            self.push(pair[0].0, ms, host_ms);
        }
        Ok(())
    }

    /// Each part's median milliseconds per step, in the order of the step.
    pub fn medians(&self) -> Vec<PartTime> {
        self.times
            .iter()
            .map(|(name, v, h)| PartTime {
                name,
                ms: median(v),
                host_ms: median(h),
            })
            .collect()
    }
}

/// The median of `v` (0 when empty; NaN when its values are, as a replay's host times).
fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// Milliseconds from mark `a` to mark `b`.
fn between(a: &Mark, b: &Mark) -> candle_core::Result<f64> {
    match (a, b) {
        (Mark::Host(a), Mark::Host(b)) => Ok(b.duration_since(*a).as_secs_f64() * 1e3),
        #[cfg(feature = "candle-cuda")]
        (Mark::Event(a), Mark::Event(b)) => a
            .elapsed_ms(b)
            .map(f64::from)
            .map_err(|e| candle_core::Error::msg(format!("timing a mark: {e:?}"))),
        #[cfg(feature = "candle-cuda")]
        _ => Err(candle_core::Error::msg("marks of a step on two clocks")),
    }
}

/// One line per kind of step: its parts' medians, `name ms (host ms)`, for the report (the
/// last part's host time includes the wait for the step's end).
pub fn describe(kind: &str, medians: &[PartTime]) -> String {
    let parts: Vec<String> = medians
        .iter()
        .map(|p| match p.host_ms.is_nan() {
            true => format!("{} {:.3}", p.name, p.ms),
            false => format!("{} {:.3} (host {:.3})", p.name, p.ms, p.host_ms),
        })
        .collect();
    let total: f64 = medians.iter().map(|p| p.ms).sum();
    format!(
        "  {kind} sections, median ms per step (sum {total:.3}): {}",
        parts.join(" | ")
    )
}
