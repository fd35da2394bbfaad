//! The engine thread: owns the target and the drafting plan, and decodes the running requests
//! together (continuous batching).
//!
//! Between steps, waiting requests join the running batch (up to `--max-batch`: each runs its
//! prompt's forward and emits its first token) and finished or abandoned ones leave; each step
//! drafts every running request's tree with its own drafter (over the plan's shared head
//! weights) and verifies them all in one target forward ([`step_generations`]), which gives each
//! request the tokens it would get alone. Requests beyond the batch wait in a bounded queue; a
//! full queue answers 429 instead of growing latency without bound.

use std::sync::mpsc::{Receiver, SyncSender, TryRecvError, TrySendError};
use std::sync::Arc;
use std::time::Instant;

use headway_engine::acceptance::Acceptance;
use headway_engine::drafters::Drafter;
use headway_engine::engine::{step_generations, Generating, Request, Turn};
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
    /// Loads the target and drafting plan on a new thread and waits until they are ready; the
    /// thread then decodes up to `max_batch` requests at once.
    pub fn start(
        target_args: TargetArgs,
        draft_args: DraftArgs,
        max_context: usize,
        queue: QueueLimits,
        metrics: Arc<Metrics>,
    ) -> anyhow::Result<Self> {
        let (sender, jobs) = std::sync::mpsc::sync_channel::<Job>(queue.max_queue);
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
                let capacity = max_context + 1;
                // One drafter now, so that a plan that cannot draft fails the start.
                let first_drafter = match plan.drafter(&target, capacity) {
                    Ok(drafter) => drafter,
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
                let batch = Batch {
                    target: &target,
                    plan: &plan,
                    capacity,
                    acceptance,
                    max_batch: queue.max_batch,
                    metrics: &metrics,
                };
                batch.serve(&jobs, first_drafter);
            })?;
        let (model_name, method) = ready_rx
            .recv()
            .map_err(|_| anyhow::anyhow!("the engine thread stopped while loading"))?
            .map_err(|e| anyhow::anyhow!(e))?;
        Ok(Self {
            queue: sender,
            model_name,
            method,
            thread,
        })
    }
}

/// How many requests the engine decodes at once, and how many more may wait.
#[derive(Debug, Clone, Copy)]
pub struct QueueLimits {
    pub max_batch: usize,
    pub max_queue: usize,
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

/// The engine's decoding loop over the running requests.
struct Batch<'t> {
    target: &'t Target,
    plan: &'t DraftPlan,
    /// Tokens a drafter's sequences may reach (the server's context).
    capacity: usize,
    acceptance: Acceptance,
    max_batch: usize,
    metrics: &'t Metrics,
}

/// A request in the running batch.
struct Running<'t> {
    job: Job,
    generating: Generating<'t>,
    drafter: Box<dyn Drafter + 't>,
    sampler: Sampler,
    sink: TextSink,
}

impl<'t> Batch<'t> {
    /// Runs until every sender is gone (the server has shut down) and the last request is done.
    fn serve(&self, jobs: &Receiver<Job>, drafter: Box<dyn Drafter + 't>) {
        let mut running: Vec<Running> = Vec::new();
        // Drafters of finished requests, kept for the next (a model drafter's cache is sized for
        // the whole context).
        let mut spare = vec![drafter];
        let mut open = true;
        loop {
            // Idle: wait for a request. Running: take what is waiting, up to the batch's room.
            while open && running.len() < self.max_batch {
                let next = if running.is_empty() {
                    jobs.recv().map_err(|_| TryRecvError::Disconnected)
                } else {
                    jobs.try_recv()
                };
                match next {
                    Ok(job) => {
                        self.metrics.dequeued();
                        running.extend(self.admit(job, &mut spare));
                    }
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => open = false,
                }
            }
            if running.is_empty() {
                if open {
                    continue;
                }
                return;
            }
            self.metrics.batch(running.len());
            if let Err(e) = self.step(&mut running) {
                for request in running.drain(..) {
                    let _ = request.job.events.send(Event::Failed(ApiError::from(&e)));
                    spare.push(request.drafter);
                }
            }
            let (done, rest): (Vec<_>, Vec<_>) = running
                .into_iter()
                .partition(|r| r.generating.is_done() || r.job.events.is_closed());
            running = rest;
            for request in done {
                spare.push(self.finish(request));
            }
        }
    }

    /// Starts `job`: its prompt's forward and first token. `None` when it is already over (the
    /// client left, it failed, or one token ended it).
    fn admit(&self, job: Job, spare: &mut Vec<Box<dyn Drafter + 't>>) -> Option<Running<'t>> {
        if job.events.is_closed() {
            self.metrics.cancelled();
            return None;
        }
        let drafter = match spare.pop() {
            Some(drafter) => drafter,
            None => match self.plan.drafter(self.target, self.capacity) {
                Ok(drafter) => drafter,
                Err(e) => {
                    let _ = job.events.send(Event::Failed(ApiError::from(&e)));
                    return None;
                }
            },
        };
        let (mut drafter, mut sampler, mut sink) =
            (drafter, Sampler::new(job.sampling), TextSink::new(&job));
        let request = Request {
            prompt_ids: &job.prompt_ids,
            max_new_tokens: job.max_tokens,
            acceptance: self.acceptance,
        };
        let started = Generating::start(
            self.target,
            drafter.as_mut(),
            request,
            &mut sampler,
            &mut |piece| sink.push(piece, self.metrics),
        );
        match started {
            Ok(generating) => Some(Running {
                job,
                generating,
                drafter,
                sampler,
                sink,
            }),
            Err(e) => {
                let _ = job.events.send(Event::Failed(ApiError::from(&e)));
                spare.push(drafter);
                None
            }
        }
    }

    /// One step of every running request.
    fn step(&self, running: &mut [Running<'t>]) -> headway_engine::Result<()> {
        let metrics = self.metrics;
        let (mut seats, mut on_texts) = (Vec::new(), Vec::new());
        for request in running.iter_mut() {
            let Running {
                generating,
                drafter,
                sampler,
                sink,
                ..
            } = request;
            seats.push((generating, drafter, sampler));
            on_texts.push(move |piece: &str| sink.push(piece, metrics));
        }
        let mut turns: Vec<Turn> = seats
            .into_iter()
            .zip(&mut on_texts)
            .map(|((generating, drafter, sampler), on_text)| Turn {
                generating,
                drafter: drafter.as_mut(),
                sampler,
                on_text,
            })
            .collect();
        step_generations(&mut turns)
    }

    /// Reports a request that left the batch; returns its drafter.
    fn finish(&self, request: Running<'t>) -> Box<dyn Drafter + 't> {
        let Running {
            job,
            generating,
            drafter,
            mut sink,
            ..
        } = request;
        let out = generating.finish();
        let generation = &out.generation;
        let abandoned = generation.stop_reason == StopReason::Cancelled && !sink.stops.stopped();
        if abandoned || job.events.is_closed() {
            self.metrics.cancelled();
            return drafter;
        }
        let rest = sink.stops.finish();
        if !rest.is_empty() {
            let _ = job.events.send(Event::Text(rest));
        }
        let finish_reason = match generation.stop_reason {
            StopReason::Length => "length",
            StopReason::Eos | StopReason::Cancelled => "stop",
        };
        self.metrics.finished(
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
        drafter
    }
}

/// Where a request's text goes: through its stop strings to its client; the first text is its
/// time to first token.
struct TextSink {
    stops: StopMatcher,
    events: UnboundedSender<Event>,
    arrived: Instant,
    first_text: bool,
}

impl TextSink {
    fn new(job: &Job) -> Self {
        Self {
            stops: StopMatcher::new(job.stop.clone()),
            events: job.events.clone(),
            arrived: job.arrived,
            first_text: true,
        }
    }

    /// Passes `piece` on; `false` once a stop string matched or the client went away.
    fn push(&mut self, piece: &str, metrics: &Metrics) -> bool {
        let text = self.stops.push(piece);
        if !text.is_empty() {
            if self.first_text {
                metrics.first_token(self.arrived.elapsed().as_secs_f64());
                self.first_text = false;
            }
            if self.events.send(Event::Text(text)).is_err() {
                return false;
            }
        }
        !self.stops.stopped() && !self.events.is_closed()
    }
}
