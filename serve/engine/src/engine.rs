//! The speculative decoding loop: draft a tree, verify it in one target forward, keep the
//! accepted path.
//!
//! Each step feeds `[root, tree nodes…]` after the cached prefix, with a tree mask and
//! depth-based positions; acceptance ([`crate::acceptance`]) picks the longest accepted path plus
//! the target's bonus token; the KV cache is then compacted so it holds exactly the root and the
//! accepted nodes, in order — what plain decoding would have cached — and nothing is re-run.

use std::time::Instant;

use headway_model::tokenizer::TokenStream;
use headway_model::{
    check_request, greedy_tokens, CpuPolicy, ForwardInput, Generation, KvCache, Sampler,
    SamplingParams, SequenceForward, StopReason, Target, TreeInput, ROW_KERNEL_MAX_ROWS,
};
use tch::{Kind, Tensor};

use crate::acceptance::{accept_greedy, accept_sampled, accept_typical, Acceptance, Accepted};
use crate::drafters::{Drafter, Verified};
use crate::error::Result;
use crate::tree::DraftTree;

/// One verification step's outcome.
#[derive(Debug, Clone)]
pub struct Step {
    /// Tokens emitted: the accepted draft tokens, then the bonus token.
    pub emitted: Vec<u32>,
    /// Nodes in the verified tree.
    pub tree_tokens: usize,
    /// Depth of the verified tree.
    pub tree_depth: usize,
    /// Seconds drafting, verifying (the target's forward over the tree and its LM head), and
    /// accepting (choosing the path, compacting the cache onto it).
    pub draft_seconds: f64,
    pub verify_seconds: f64,
    pub accept_seconds: f64,
}

impl Step {
    /// Accepted draft tokens (the bonus token is not a draft).
    pub fn accepted(&self) -> usize {
        self.emitted.len() - 1
    }
}

/// A sequence being decoded speculatively: the target's KV cache and every token so far.
pub struct Session<'t> {
    target: &'t Target,
    cache: KvCache,
    /// Prompt and emitted tokens; the last one is emitted but not yet cached.
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Final hidden states of the positions cached by the last forward.
    fresh_hidden: Tensor,
    /// Target layers whose residual stream the drafter reads.
    taps: Vec<usize>,
    /// Those taps at the positions cached by the last forward.
    fresh_taps: Vec<Tensor>,
    acceptance: Acceptance,
    /// Decoding's CPU policy, for the prompt and every verification alike.
    cpu: CpuPolicy,
}

impl<'t> Session<'t> {
    /// Runs the prompt through the target and picks the first token. `room` is how many new
    /// tokens the session may emit (the cache also reserves room for `drafter`'s largest tree,
    /// and every forward returns the target taps `drafter` reads).
    pub fn start(
        target: &'t Target,
        prompt_ids: &[u32],
        room: usize,
        drafter: &dyn Drafter,
        acceptance: Acceptance,
        sampler: &mut Sampler,
    ) -> Result<Self> {
        check_request(target, prompt_ids.len(), room)?;
        let capacity = prompt_ids.len() + room + drafter.max_tree_tokens() + 1;
        let cache = target.new_cache(1, capacity)?;
        let mut session = Self {
            target,
            cache,
            tokens: prompt_ids.to_vec(),
            prompt_len: prompt_ids.len(),
            fresh_hidden: Tensor::new(),
            taps: drafter.taps().to_vec(),
            fresh_taps: Vec::new(),
            acceptance,
            cpu: target.cpu.decode(),
        };
        let prompt = TreeInput::causal(0, prompt_ids, target.device);
        let (hidden, taps) = session.forward(&prompt)?;
        let last = hidden.get(prompt_ids.len() as i64 - 1);
        let logits = target.model.lm_head.forward(&last, &session.cpu);
        session.tokens.push(sampler.next_token(&logits));
        session.fresh_hidden = hidden;
        session.fresh_taps = taps;
        Ok(session)
    }

    /// Prompt and emitted tokens.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Emitted tokens.
    pub fn generated(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }

    /// The target's KV cache: every token but the last.
    pub fn cache(&self) -> &KvCache {
        &self.cache
    }

    /// What the target verified since the drafter last saw the sequence.
    fn verified(&self) -> Verified<'_> {
        Verified {
            context: &self.tokens,
            hidden: &self.fresh_hidden,
            taps: &self.fresh_taps,
        }
    }

    /// Hands the prompt's rows to `drafter` ([`Drafter::prefill`]) before the first step; returns
    /// the seconds it took.
    pub fn prefill_drafter(&self, drafter: &mut dyn Drafter) -> Result<f64> {
        let started = Instant::now();
        drafter.prefill(&self.verified())?;
        Ok(started.elapsed().as_secs_f64())
    }

    /// One draft + verify step: [`step_sessions`] of this session alone.
    pub fn step(&mut self, drafter: &mut dyn Drafter, sampler: &mut Sampler) -> Result<Step> {
        let seat = Seat {
            session: self,
            drafter,
            sampler,
        };
        let mut steps = step_sessions(&mut [seat])?;
        Ok(steps.pop().expect("one step a session"))
    }

    /// Drafts this step's tree.
    fn draft(&mut self, drafter: &mut dyn Drafter, sampler: &mut Sampler) -> Result<Drafted> {
        let started = Instant::now();
        let tree = drafter.draft(&self.verified(), sampler)?;
        // Tree positions must stay inside the model's context (the root sits at `prefix`).
        let prefix = self.cache.len();
        let context = self.target.model.config().max_position_embeddings;
        let tree = tree.truncated(context.saturating_sub(prefix + 1));
        Ok(Drafted {
            tree,
            prefix,
            draft_seconds: started.elapsed().as_secs_f64(),
        })
    }

    /// The target's input for `tree`: the root (the last token), then the tree's nodes.
    fn verification_input(&self, drafted: &Drafted) -> Result<TreeInput> {
        let root = *self.tokens.last().expect("a session has tokens");
        drafted
            .tree
            .verification_input(root, drafted.prefix, self.target.device)
    }

    /// Accepts the longest path of `drafted`'s tree that the target's rows (`rows`) verify, plus
    /// the bonus token; compacts the cache onto it.
    fn accept(&mut self, drafted: Drafted, rows: TreeRows, sampler: &mut Sampler) -> Result<Step> {
        let started = Instant::now();
        let Drafted { tree, prefix, .. } = drafted;
        let TreeRows {
            hidden,
            taps,
            logits,
            verify_seconds,
        } = rows;
        // Greedy decoding reads the target's choice at every row as part of verifying: a pass
        // over every row's logits, which grows with the tree as the forward does (the rows curve
        // the tuner prices trees by times the same).
        let greedy_started = Instant::now();
        let choices = sampler.params().is_greedy().then(|| greedy_tokens(&logits));
        let greedy_seconds = greedy_started.elapsed().as_secs_f64();
        let Accepted { path, bonus } = if let Some(choices) = &choices {
            accept_greedy(&tree, choices)
        } else {
            let params = *sampler.params();
            let mut distribution = |entry: usize| {
                let q = params.distribution(&logits.get(entry as i64));
                Vec::<f32>::try_from(q.to_device(tch::Device::Cpu)).expect("f32 distribution")
            };
            match self.acceptance {
                Acceptance::Lossless => accept_sampled(&tree, &mut distribution, sampler),
                Acceptance::Typical { threshold, alpha } => {
                    accept_typical(&tree, &mut distribution, sampler, threshold, alpha)
                }
            }
        };
        let entries: Vec<usize> = std::iter::once(0)
            .chain(path.iter().map(|&n| n + 1))
            .collect();
        let keep: Vec<usize> = entries.iter().map(|&e| prefix + e).collect();
        self.cache.compact(prefix, &keep)?;
        let index = Tensor::from_slice(&entries.iter().map(|&e| e as i64).collect::<Vec<_>>())
            .to_device(hidden.device());
        self.fresh_hidden = hidden.index_select(0, &index);
        self.fresh_taps = taps.iter().map(|t| t.index_select(0, &index)).collect();
        let emitted: Vec<u32> = path
            .iter()
            .map(|&n| tree.nodes()[n].token)
            .chain(std::iter::once(bonus))
            .collect();
        self.tokens.extend_from_slice(&emitted);
        Ok(Step {
            emitted,
            tree_tokens: tree.len(),
            tree_depth: tree.max_depth(),
            draft_seconds: drafted.draft_seconds,
            verify_seconds: verify_seconds + greedy_seconds,
            accept_seconds: started.elapsed().as_secs_f64() - greedy_seconds,
        })
    }

    /// Runs `input` after the cache and returns the final hidden states `[n, hidden]` and the
    /// drafter's taps (each `[n, hidden]`).
    fn forward(&mut self, input: &TreeInput) -> Result<(Tensor, Vec<Tensor>)> {
        let _no_grad = tch::no_grad_guard();
        let output = self.target.model.model.forward(
            &ForwardInput::new(input, &self.taps, &self.cpu),
            Some(&mut self.cache),
        )?;
        let taps = output.taps.iter().map(|t| t.get(0)).collect();
        Ok((output.hidden.get(0), taps))
    }
}

/// A step's tree, drafted and waiting for the target's verification.
struct Drafted {
    tree: DraftTree,
    prefix: usize,
    draft_seconds: f64,
}

/// The target's rows over one session's tree (root first): final hidden states `[n, hidden]`,
/// the drafter's taps, logits `[n, vocab]`, and the seconds the verification took.
struct TreeRows {
    hidden: Tensor,
    taps: Vec<Tensor>,
    logits: Tensor,
    verify_seconds: f64,
}

/// Trims the trees of several sequences so that their rows (each tree and its root) fit
/// `budget`, the rows one pass of the exact few-row kernels takes: past it a step would stream
/// every weight again. Each tree keeps its first nodes, up to a cap shared by all (the largest
/// that fits; what is left over goes to the first sequences); where even the roots fill the
/// budget, every sequence decodes plainly. One sequence keeps its tree (its plan bounds it).
fn share_rows(drafted: &mut [Drafted], budget: usize) {
    let rows = |cap: usize| -> usize { drafted.iter().map(|d| d.tree.len().min(cap)).sum() };
    let room = budget.saturating_sub(drafted.len());
    let longest = drafted.iter().map(|d| d.tree.len()).max().unwrap_or(0);
    if drafted.len() < 2 || rows(longest) <= room {
        return;
    }
    let cap = (0..longest)
        .rev()
        .find(|&cap| rows(cap) <= room)
        .unwrap_or(0);
    let mut spare = room - rows(cap);
    for d in drafted.iter_mut() {
        let extra = usize::from(spare > 0 && d.tree.len() > cap);
        spare -= extra;
        d.tree = d.tree.first(cap + extra);
    }
}

/// One session's place in a step of several ([`step_sessions`]): its drafter and its sampler.
pub struct Seat<'a, 't> {
    pub session: &'a mut Session<'t>,
    pub drafter: &'a mut dyn Drafter,
    pub sampler: &'a mut Sampler,
}

/// One step of every session in `seats`, all of one target: each drafts its tree, one target
/// forward verifies every tree (their rows side by side, each over its own cache:
/// [`headway_model::Llama::forward_sequences`], then one LM-head product), each accepts its own
/// path. A session's rows get the bits its step alone would give them, so a batch changes no
/// one's output; a batch of one is [`Session::step`]. Each step's `verify_seconds` is the shared
/// forward's.
pub fn step_sessions(seats: &mut [Seat]) -> Result<Vec<Step>> {
    let Some(target) = seats.first().map(|seat| seat.session.target) else {
        return Ok(Vec::new());
    };
    let mut drafted = seats
        .iter_mut()
        .map(|seat| seat.session.draft(seat.drafter, seat.sampler))
        .collect::<Result<Vec<_>>>()?;
    share_rows(&mut drafted, ROW_KERNEL_MAX_ROWS);
    let inputs = seats
        .iter()
        .zip(&drafted)
        .map(|(seat, drafted)| seat.session.verification_input(drafted))
        .collect::<Result<Vec<_>>>()?;
    let started = Instant::now();
    let outputs = {
        let _no_grad = tch::no_grad_guard();
        let mut sequences: Vec<SequenceForward> = seats
            .iter_mut()
            .zip(&inputs)
            .map(|(seat, input)| {
                let session = &mut *seat.session;
                SequenceForward {
                    input: ForwardInput::new(input, &session.taps, &session.cpu),
                    cache: &mut session.cache,
                }
            })
            .collect();
        target.model.model.forward_sequences(&mut sequences)?
    };
    let hidden: Vec<Tensor> = outputs.iter().map(|out| out.hidden.get(0)).collect();
    let logits = target
        .model
        .lm_head
        .forward_sequences(&hidden, &seats[0].session.cpu);
    let verify_seconds = started.elapsed().as_secs_f64();
    let verified = outputs.into_iter().zip(hidden).zip(logits);
    seats
        .iter_mut()
        .zip(drafted)
        .zip(verified)
        .map(|((seat, drafted), ((output, hidden), logits))| {
            let rows = TreeRows {
                hidden,
                taps: output.taps.iter().map(|t| t.get(0)).collect(),
                logits: logits.to_kind(Kind::Float),
                verify_seconds,
            };
            seat.session.accept(drafted, rows, seat.sampler)
        })
        .collect()
}

/// A finished speculative generation.
#[derive(Debug, Clone)]
pub struct SpecGeneration {
    pub generation: Generation,
    /// The drafter's own pass over the prompt ([`Drafter::prefill`]), after the first token was
    /// emitted and before the first step: paid once a sequence, so in no step's drafting.
    pub drafter_prefill_seconds: f64,
    /// Target forwards after the prompt's (one per step).
    pub steps: Vec<Step>,
}

impl SpecGeneration {
    /// τ: new tokens per target forward, the prompt forward's first token included (plain
    /// decoding: 1.0).
    pub fn tau(&self) -> f64 {
        self.generation.tokens.len() as f64 / (self.steps.len() + 1) as f64
    }

    /// Accepted draft tokens that were emitted. Only the last step can be cut short (by a stop
    /// token, a cancelling stop string or `max_new_tokens`); its accepted drafts past the cut were
    /// never emitted and do not count.
    pub fn accepted_tokens(&self) -> usize {
        // Tokens emitted after the prompt forward's first one, handed out to the steps in order.
        let mut unclaimed = self.generation.tokens.len().saturating_sub(1);
        self.steps
            .iter()
            .map(|step| {
                let emitted = step.emitted.len().min(unclaimed);
                unclaimed -= emitted;
                // A step emits its accepted drafts first, its bonus token last.
                step.accepted().min(emitted)
            })
            .sum()
    }
}

/// Generates up to `max_new_tokens` after `prompt_ids` with `drafter`, streaming text through
/// `on_text`, which returns `false` to stop generation (ends with [`StopReason::Cancelled`]).
/// Output is exactly plain decoding's: tokens past a stop token or `max_new_tokens` in the last
/// step are dropped. A batch of one: [`Generating`] stepped by [`step_generations`].
pub fn generate_speculative(
    target: &Target,
    drafter: &mut dyn Drafter,
    prompt_ids: &[u32],
    max_new_tokens: usize,
    acceptance: Acceptance,
    sampler: &mut Sampler,
    on_text: &mut dyn FnMut(&str) -> bool,
) -> Result<SpecGeneration> {
    let request = Request {
        prompt_ids,
        max_new_tokens,
        acceptance,
    };
    let mut generating = Generating::start(target, drafter, request, sampler, on_text)?;
    while !generating.is_done() {
        let turn = Turn {
            generating: &mut generating,
            drafter: &mut *drafter,
            sampler: &mut *sampler,
            on_text: &mut *on_text,
        };
        step_generations(&mut [turn])?;
    }
    Ok(generating.finish())
}

/// What one generation asks for.
#[derive(Clone, Copy)]
pub struct Request<'p> {
    pub prompt_ids: &'p [u32],
    pub max_new_tokens: usize,
    pub acceptance: Acceptance,
}

/// A generation under way: its session, the text streamed so far under plain decoding's stop
/// rules, and its steps. Many are stepped together by [`step_generations`] (continuous
/// batching: one joins after its prompt's forward, [`Generating::start`], and leaves once done).
pub struct Generating<'t> {
    session: Session<'t>,
    stream: TokenStream<'t>,
    out: Emitter<'t>,
    steps: Vec<Step>,
    started: Instant,
    prefill_seconds: f64,
    drafter_prefill_seconds: f64,
}

impl<'t> Generating<'t> {
    /// Runs the prompt through the target, emits the first token through `on_text` and hands
    /// the prompt to `drafter` (reset first: it drafts for this generation alone until it ends).
    pub fn start(
        target: &'t Target,
        drafter: &mut dyn Drafter,
        request: Request,
        sampler: &mut Sampler,
        on_text: &mut dyn FnMut(&str) -> bool,
    ) -> Result<Self> {
        let started = Instant::now();
        drafter.reset();
        let session = Session::start(
            target,
            request.prompt_ids,
            request.max_new_tokens,
            drafter,
            request.acceptance,
            sampler,
        )?;
        let mut generating = Self {
            session,
            stream: target.tokenizer.stream(true),
            out: Emitter {
                target,
                tokens: Vec::new(),
                text: String::new(),
                max_new_tokens: request.max_new_tokens,
                stop_reason: None,
            },
            steps: Vec::new(),
            started,
            prefill_seconds: started.elapsed().as_secs_f64(),
            drafter_prefill_seconds: 0.0,
        };
        let first = generating.session.generated()[0];
        generating
            .out
            .push(first, &mut generating.stream, on_text)?;
        if !generating.is_done() {
            generating.drafter_prefill_seconds = generating.session.prefill_drafter(drafter)?;
        }
        Ok(generating)
    }

    /// Whether it has stopped (a stop token, the token limit, or `on_text` said so).
    pub fn is_done(&self) -> bool {
        self.out.stop_reason.is_some()
    }

    /// Tokens emitted so far.
    pub fn tokens(&self) -> &[u32] {
        &self.out.tokens
    }

    /// Emits a step's tokens until a stop.
    fn emit(&mut self, step: Step, on_text: &mut dyn FnMut(&str) -> bool) -> Result<()> {
        for &token in &step.emitted {
            if self.out.stop_reason.is_none() {
                self.out.push(token, &mut self.stream, on_text)?;
            }
        }
        self.steps.push(step);
        Ok(())
    }

    /// The finished generation (or what it emitted so far, ended as cancelled).
    pub fn finish(self) -> SpecGeneration {
        SpecGeneration {
            generation: Generation {
                tokens: self.out.tokens,
                text: self.out.text,
                stop_reason: self.out.stop_reason.unwrap_or(StopReason::Cancelled),
                prefill_seconds: self.prefill_seconds,
                seconds: self.started.elapsed().as_secs_f64(),
            },
            drafter_prefill_seconds: self.drafter_prefill_seconds,
            steps: self.steps,
        }
    }
}

/// One generation's place in a step of several: its drafter, sampler and text sink.
pub struct Turn<'a, 't> {
    pub generating: &'a mut Generating<'t>,
    pub drafter: &'a mut dyn Drafter,
    pub sampler: &'a mut Sampler,
    pub on_text: &'a mut dyn FnMut(&str) -> bool,
}

/// One step of every unfinished generation in `turns` ([`step_sessions`]: one target forward
/// for all), each step's tokens emitted to its own generation.
pub fn step_generations(turns: &mut [Turn]) -> Result<()> {
    let mut running: Vec<&mut Turn> = turns
        .iter_mut()
        .filter(|t| !t.generating.is_done())
        .collect();
    let mut seats: Vec<Seat> = running
        .iter_mut()
        .map(|turn| Seat {
            session: &mut turn.generating.session,
            drafter: &mut *turn.drafter,
            sampler: &mut *turn.sampler,
        })
        .collect();
    let steps = step_sessions(&mut seats)?;
    drop(seats);
    for (turn, step) in running.into_iter().zip(steps) {
        turn.generating.emit(step, turn.on_text)?;
    }
    Ok(())
}

/// Greedy speculative generation with no streaming: what the auto-tuner's warm-up and the
/// losslessness checks run.
pub fn generate_greedy(
    target: &Target,
    drafter: &mut dyn Drafter,
    prompt_ids: &[u32],
    max_new_tokens: usize,
) -> Result<SpecGeneration> {
    generate_speculative(
        target,
        drafter,
        prompt_ids,
        max_new_tokens,
        Acceptance::Lossless,
        &mut Sampler::new(SamplingParams::default()),
        &mut |_| true,
    )
}

/// Emits tokens one at a time, applying plain decoding's stop rules.
struct Emitter<'t> {
    target: &'t Target,
    tokens: Vec<u32>,
    text: String,
    max_new_tokens: usize,
    stop_reason: Option<StopReason>,
}

impl Emitter<'_> {
    fn push(
        &mut self,
        token: u32,
        stream: &mut TokenStream,
        on_text: &mut dyn FnMut(&str) -> bool,
    ) -> Result<()> {
        if self.tokens.len() >= self.max_new_tokens {
            self.stop_reason = Some(StopReason::Length);
            return Ok(());
        }
        self.tokens.push(token);
        if self.target.stop_ids.contains(&token) {
            self.stop_reason = Some(StopReason::Eos);
        } else if let Some(piece) = stream.step(token)? {
            self.text.push_str(&piece);
            if !on_text(&piece) {
                self.stop_reason = Some(StopReason::Cancelled);
            }
        }
        if self.stop_reason.is_none() && self.tokens.len() >= self.max_new_tokens {
            self.stop_reason = Some(StopReason::Length);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use headway_model::{Generation, StopReason};

    use super::*;

    fn step(emitted: &[u32]) -> Step {
        Step {
            emitted: emitted.to_vec(),
            tree_tokens: 4,
            tree_depth: 4,
            draft_seconds: 0.0,
            verify_seconds: 0.0,
            accept_seconds: 0.0,
        }
    }

    fn generation(tokens: &[u32], steps: &[&[u32]]) -> SpecGeneration {
        SpecGeneration {
            generation: Generation {
                tokens: tokens.to_vec(),
                text: String::new(),
                stop_reason: StopReason::Length,
                prefill_seconds: 0.0,
                seconds: 0.0,
            },
            drafter_prefill_seconds: 0.0,
            steps: steps.iter().map(|e| step(e)).collect(),
        }
    }

    fn drafted(lengths: &[usize]) -> Vec<Drafted> {
        lengths
            .iter()
            .map(|&n| Drafted {
                tree: DraftTree::chain(
                    &vec![7; n],
                    std::iter::repeat(crate::tree::Proposal::Deterministic),
                ),
                prefix: 0,
                draft_seconds: 0.0,
            })
            .collect()
    }

    fn lengths(drafted: &[Drafted]) -> Vec<usize> {
        drafted.iter().map(|d| d.tree.len()).collect()
    }

    #[test]
    fn sequences_share_the_row_budget_by_a_common_cap() {
        // 4 roots leave 16 rows: a cap of 5 takes 15, the spare row goes to the first longer tree.
        let mut trees = drafted(&[10, 0, 30, 5]);
        share_rows(&mut trees, 20);
        assert_eq!(lengths(&trees), [6, 0, 5, 5]);
        // Trees that fit keep every node; one sequence keeps its tree whatever the budget.
        let mut trees = drafted(&[3, 4]);
        share_rows(&mut trees, 20);
        assert_eq!(lengths(&trees), [3, 4]);
        let mut trees = drafted(&[40]);
        share_rows(&mut trees, 20);
        assert_eq!(lengths(&trees), [40]);
        // Roots alone fill the budget: plain decoding for all.
        let mut trees = drafted(&[2; 25]);
        share_rows(&mut trees, 20);
        assert!(lengths(&trees).iter().all(|&n| n == 0));
    }

    #[test]
    fn accepted_tokens_count_every_draft_of_uncut_steps() {
        // First token 1; steps accept 2 then 0 drafts, each ending with its bonus.
        let out = generation(&[1, 2, 3, 4, 5], &[&[2, 3, 4], &[5]]);
        assert_eq!(out.accepted_tokens(), 2);
    }

    #[test]
    fn accepted_tokens_skip_drafts_cut_from_the_last_step() {
        // The last step accepted 3 drafts (7, 8, 9) and its bonus 10, but only 7 was emitted.
        let out = generation(&[1, 2, 3, 4, 7], &[&[2, 3, 4], &[7, 8, 9, 10]]);
        assert_eq!(out.accepted_tokens(), 3);
        // Cut right before its bonus: every accepted draft was emitted.
        let out = generation(&[1, 7, 8, 9], &[&[7, 8, 9, 10]]);
        assert_eq!(out.accepted_tokens(), 3);
    }
}
