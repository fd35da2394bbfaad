//! The engine thread: owns the target and the drafter, and runs queued requests one at a time.
//!
//! Speculative decoding is a low-batch technique: it trades spare compute per forward for fewer
//! sequential forwards, which pays off when one sequence (or a few) has the device to itself. The
//! engine therefore serves requests one after another from a bounded queue; a full queue answers
//! 429 instead of growing latency without bound.

use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::Instant;

use headway_engine::acceptance::Acceptance;
use headway_engine::drafters::Drafter;
use headway_engine::engine::generate_speculative;
use headway_engine::DraftPlan;
use headway_model::{Sampler, SamplingParams, StopReason, Target, TargetArgs};
use tokio::sync::mpsc::UnboundedSender;

use super::api::ApiError;
use super::metrics::Metrics;
use super::stop::StopMatcher;
use crate::options::DraftArgs;

/// One request for the engine.
pub struct Job {
    pub prompt_ids: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    /// Where text and the final figures go; a closed channel means the client went away.
    pub events: UnboundedSender<Event>,
    pub arrived: Instant,
}

/// What the engine reports about a job.
#[derive(Debug)]
pub enum Event {
    Text(String),
    Done(Finished),
    Failed(ApiError),
}

#[derive(Debug, Clone)]
pub struct Finished {
    /// `stop` (end of turn or stop string) or `length`.
    pub finish_reason: &'static str,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub target_forwards: usize,
    pub accepted_tokens: usize,
}

/// A running engine: its queue and the facts the HTTP layer needs.
pub struct Engine {
    pub queue: SyncSender<Job>,
    pub model_name: String,
    pub method: String,
    pub thread: std::thread::JoinHandle<()>,
}

/// Why a job was not queued.
pub enum Refused {
    Full,
    Closed,
}

impl Engine {
    /// Loads the target and drafter on a new thread and waits until they are ready.
    pub fn start(
        target_args: TargetArgs,
        draft_args: DraftArgs,
        max_context: usize,
        max_queue: usize,
        metrics: Arc<Metrics>,
    ) -> anyhow::Result<Self> {
        let (queue, jobs) = std::sync::mpsc::sync_channel::<Job>(max_queue);
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<(String, String), String>>();
        let acceptance = draft_args.acceptance();
        let thread = std::thread::Builder::new()
            .name("headway-engine".into())
            .spawn(move || {
                let setup = || -> anyhow::Result<(Target, DraftPlan)> {
                    let target = headway_gguf::load_target(&target_args)?;
                    let warm_up = target.tokenizer.encode(WARM_UP_PROMPT, true)?;
                    let (plan, tuning) = draft_args.plan(&target, &[warm_up])?;
                    if let Some(tuning) = &tuning {
                        tracing::info!("{}", tuning.describe());
                    }
                    Ok((target, plan))
                };
                let (target, plan) = match setup() {
                    Ok(loaded) => loaded,
                    Err(e) => {
                        let _ = ready_tx.send(Err(format!("{e:#}")));
                        return;
                    }
                };
                let mut drafter = match plan.drafter(&target, max_context + 1) {
                    Ok(d) => d,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e.to_string()));
                        return;
                    }
                };
                let name = target
                    .path
                    .file_name()
                    .map_or("target".into(), |n| n.to_string_lossy().into_owned());
                let _ = ready_tx.send(Ok((name, plan.label())));
                serve_jobs(&target, drafter.as_mut(), acceptance, &jobs, &metrics);
            })?;
        let (model_name, method) = ready_rx
            .recv()
            .map_err(|_| anyhow::anyhow!("the engine thread stopped while loading"))?
            .map_err(|e| anyhow::anyhow!(e))?;
        Ok(Self {
            queue,
            model_name,
            method,
            thread,
        })
    }
}

/// Queues `job` without waiting.
pub fn submit(queue: &SyncSender<Job>, job: Job, metrics: &Metrics) -> Result<(), Refused> {
    metrics.enqueued();
    queue.try_send(job).map_err(|e| {
        metrics.dequeued();
        match e {
            TrySendError::Full(_) => Refused::Full,
            TrySendError::Disconnected(_) => Refused::Closed,
        }
    })
}

/// A prompt for `--tree-tokens auto`'s warm-up.
const WARM_UP_PROMPT: &str = "Explain in a few sentences how a hash map works and when to use one.";

fn serve_jobs(
    target: &Target,
    drafter: &mut dyn Drafter,
    acceptance: Acceptance,
    jobs: &Receiver<Job>,
    metrics: &Metrics,
) {
    // Ends when every sender is gone: the server has shut down and the queue is drained.
    while let Ok(job) = jobs.recv() {
        metrics.dequeued();
        if job.events.is_closed() {
            metrics.cancelled();
            continue;
        }
        run_job(target, drafter, acceptance, job, metrics);
    }
}

fn run_job(
    target: &Target,
    drafter: &mut dyn Drafter,
    acceptance: Acceptance,
    job: Job,
    metrics: &Metrics,
) {
    let mut stops = StopMatcher::new(job.stop.clone());
    let mut first_text = true;
    let mut on_text = |piece: &str| {
        let text = stops.push(piece);
        if !text.is_empty() {
            if first_text {
                metrics.first_token(job.arrived.elapsed().as_secs_f64());
                first_text = false;
            }
            if job.events.send(Event::Text(text)).is_err() {
                return false;
            }
        }
        !stops.stopped() && !job.events.is_closed()
    };
    let mut sampler = Sampler::new(job.sampling);
    let result = generate_speculative(
        target,
        drafter,
        &job.prompt_ids,
        job.max_tokens,
        acceptance,
        &mut sampler,
        &mut on_text,
    );
    let out = match result {
        Ok(out) => out,
        Err(e) => {
            let _ = job.events.send(Event::Failed(ApiError::from(&e)));
            return;
        }
    };
    let generation = &out.generation;
    if generation.stop_reason == StopReason::Cancelled && !stops.stopped() {
        metrics.cancelled();
        return;
    }
    let rest = stops.finish();
    if !rest.is_empty() {
        let _ = job.events.send(Event::Text(rest));
    }
    let finish_reason = match generation.stop_reason {
        StopReason::Length => "length",
        StopReason::Eos | StopReason::Cancelled => "stop",
    };
    metrics.finished(
        job.prompt_ids.len(),
        generation.tokens.len(),
        out.tau(),
        job.arrived.elapsed().as_secs_f64(),
    );
    let _ = job.events.send(Event::Done(Finished {
        finish_reason,
        prompt_tokens: job.prompt_ids.len(),
        completion_tokens: generation.tokens.len(),
        target_forwards: out.steps.len() + 1,
        accepted_tokens: out.accepted_tokens(),
    }));
}
