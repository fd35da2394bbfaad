//! Cross-entropy through a vocabulary-sized output projection, its gradient taken in place.
//!
//! Both heads score features `x` `[n, hidden]` with an LM head `W` `[vocab, hidden]`: the logits
//! `z = x Wᵀ` are `[n, vocab]`, with vocab up to 49k. On the CPU the vocabulary-sized tensors cost
//! as much as the products: every fresh one is faulted in and zeroed page by page (about 80 ms
//! for `[1500, 49152]` f32 on the development machine, against 20 ms for a softmax over it in
//! place), and autograd keeps several of them for its backward pass (profiled on EAGLE: our
//! backward took twice PyTorch's). So the logits are written into a [`Scratch`] buffer kept
//! between steps, and turned there into the gradient with respect to the logits,
//! `softmax(z) − p` (p: the target distribution, one-hot for a token, rows summing to one); the
//! backward products `∂x = ∂z W` and `∂W = ∂zᵀ x` are taken at once. The returned loss hands them
//! to autograd as `value + Σ (x − x̄) ∂x [+ Σ (W − W̄) ∂W]` (x̄, W̄ detached): the loss's value,
//! exactly these gradients, and nothing vocabulary-sized kept for the backward pass.
//!
//! Under autocast (bf16 training on CUDA) the products run in the autocast kind and the
//! softmax and loss in f32 in the buffer, as autocast itself would do them.

use tch::{Device, Kind, Tensor};

use crate::autocast::active_kind;

/// A buffer for `[rows, vocab]` f32 tensors, kept between steps and grown when too small.
#[derive(Default)]
pub struct Scratch(Option<Tensor>);

impl Scratch {
    /// A `[rows, cols]` f32 tensor over the buffer; its contents are whatever was there.
    fn view(&mut self, rows: i64, cols: i64, device: Device) -> Tensor {
        let needed = rows * cols;
        let fits = |t: &Tensor| t.numel() as i64 >= needed && t.device() == device;
        if !self.0.as_ref().is_some_and(fits) {
            self.0 = Some(Tensor::empty([needed], (Kind::Float, device)));
        }
        let buffer = self.0.as_ref().expect("the buffer was just made");
        buffer.narrow(0, 0, needed).view([rows, cols])
    }
}

/// The logits `x Wᵀ` `[n, vocab]`, written into `scratch` (valid until its next use); no gradient.
fn projected_logits(x: &Tensor, weight: &Tensor, scratch: &mut Scratch) -> Tensor {
    let z = scratch.view(x.size()[0], weight.size()[0], x.device());
    let (x, weight) = (x.detach(), weight.detach());
    tch::no_grad(|| match active_kind(x.device()) {
        // Autocast makes no `out=` variants: the product runs in its kind, then fills the buffer.
        Some(_) => {
            let mut z = z;
            z.copy_(&x.mm(&weight.tr()));
            z
        }
        None => x.mm_out(&z, &weight.tr()),
    })
}

/// `softmax(x Wᵀ)` `[n, vocab]`, computed in `scratch` (valid until its next use).
pub fn projected_softmax(x: &Tensor, weight: &Tensor, scratch: &mut Scratch) -> Tensor {
    let z = projected_logits(x, weight, scratch);
    tch::no_grad(|| z.softmax_int_out(&z, -1, Kind::Float))
}

/// The top-scoring index of `x Wᵀ` per row, `[n]`, computed in `scratch`.
pub fn projected_argmax(x: &Tensor, weight: &Tensor, scratch: &mut Scratch) -> Tensor {
    tch::no_grad(|| projected_logits(x, weight, scratch).argmax(-1, false))
}

/// What each row's logits are scored against.
pub enum VocabTarget<'a> {
    /// A distribution over the vocabulary per row, `[n, vocab]`, each row summing to one.
    Distribution(&'a Tensor),
    /// A token index per row, `[n]`.
    Token(&'a Tensor),
}

/// Mean cross-entropy over rows, and how often a reference token ranked first / in the top 5.
pub struct VocabLoss {
    /// Scalar; backpropagates into `x` and, when it requires grad, `W` (only when the loss was
    /// asked for with gradients).
    pub loss: Tensor,
    pub top1: f64,
    pub top5: f64,
}

/// Cross-entropy of `softmax(x Wᵀ)` against `target`, averaged over the `n` rows of `x`, with
/// top-1/top-5 hits of the token ids `reference` `[n]`; the logits live in `scratch`. Without
/// `with_grad` (evaluation) the backward products are skipped and the loss carries no gradient.
pub fn projected_cross_entropy(
    x: &Tensor,
    weight: &Tensor,
    target: VocabTarget,
    reference: &Tensor,
    with_grad: bool,
    scratch: &mut Scratch,
) -> VocabLoss {
    let n = x.size()[0];
    let (x_value, weight_value) = (x.detach(), weight.detach());
    let (value, top1, top5, grads) = tch::no_grad(|| {
        let mut z = projected_logits(&x_value, &weight_value, scratch);
        let (top1, top5) = top_hits(&z, reference);
        // Per row, CE = log Σ exp(z) − Σ p z (Σ p = 1), and log Σ exp(z) = max z − log max softmax(z).
        let max = z.amax([-1], false);
        let scored = match target {
            VocabTarget::Distribution(p) => p.unsqueeze(1).bmm(&z.unsqueeze(2)).view([n]),
            VocabTarget::Token(t) => z.gather(1, &t.unsqueeze(-1), false).view([n]),
        };
        let _ = z.softmax_int_out(&z, -1, Kind::Float);
        let log_sum_exp = max - z.amax([-1], false).log();
        let value = (log_sum_exp - scored).mean(Kind::Float);
        if !with_grad {
            return (value, top1, top5, None);
        }
        match target {
            VocabTarget::Distribution(p) => {
                let _ = z.g_sub_(p);
            }
            VocabTarget::Token(t) => {
                let minus_one = Tensor::full([n, 1], -1.0, (Kind::Float, z.device()));
                let _ = z.scatter_add_(1, &t.unsqueeze(-1), &minus_one);
            }
        }
        let scale = 1.0 / n as f64;
        let grad_x = z.mm(&weight_value) * scale;
        let grad_weight = weight.requires_grad().then(|| z.tr().mm(&x_value) * scale);
        (value, top1, top5, Some((grad_x, grad_weight)))
    });
    let loss = match grads {
        None => value,
        Some((grad_x, grad_weight)) => {
            let loss = value + ((x - &x_value) * grad_x).sum(Kind::Float);
            match grad_weight {
                Some(grad_weight) => {
                    loss + ((weight - &weight_value) * grad_weight).sum(Kind::Float)
                }
                None => loss,
            }
        }
    };
    VocabLoss { loss, top1, top5 }
}

/// Top-1 and top-5 hits of `logits` `[n, vocab]` against `targets` `[n]` (`topk`: measured 4×
/// faster on `[1500, 49152]` than counting, per row, the logits above the target's).
fn top_hits(logits: &Tensor, targets: &Tensor) -> (f64, f64) {
    let k = logits.size()[1].min(5);
    let best = logits.topk(k, -1, true, true).1;
    let hits = best.eq_tensor(&targets.unsqueeze(-1));
    let top1 = hits.select(1, 0).sum(Kind::Float).double_value(&[]);
    let top5 = hits.sum(Kind::Float).double_value(&[]);
    (top1, top5)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Reduction};

    const N: i64 = 7;
    const H: i64 = 5;
    const V: i64 = 13;

    struct Case {
        x: Tensor,
        weight: Tensor,
        probs: Tensor,
        tokens: Tensor,
    }

    fn case(weight_learns: bool) -> Case {
        tch::manual_seed(3);
        let options = (Kind::Float, Device::Cpu);
        Case {
            x: Tensor::randn([N, H], options).set_requires_grad(true),
            weight: Tensor::randn([V, H], options).set_requires_grad(weight_learns),
            probs: (Tensor::randn([N, V], options) * 2.0).softmax(-1, Kind::Float),
            tokens: Tensor::randint(V, [N], (Kind::Int64, Device::Cpu)),
        }
    }

    /// The loss as autograd sees it written plainly: CE of log-softmax(x Wᵀ).
    fn plain_loss(c: &Case, soft: bool) -> Tensor {
        let logits = c.x.matmul(&c.weight.tr());
        if soft {
            -(&c.probs * logits.log_softmax(-1, Kind::Float))
                .sum_dim_intlist(-1, false, Kind::Float)
                .mean(Kind::Float)
        } else {
            logits.cross_entropy_loss::<Tensor>(&c.tokens, None, Reduction::Mean, -100, 0.0)
        }
    }

    /// Gradients of `loss` with respect to x and (when it learns) W, left zeroed after.
    fn gradients(c: &Case, loss: &Tensor) -> Vec<Tensor> {
        loss.backward();
        let mut grads = vec![c.x.grad().copy()];
        if c.weight.requires_grad() {
            grads.push(c.weight.grad().copy());
            let _ = c.weight.grad().zero_();
        }
        let _ = c.x.grad().zero_();
        grads
    }

    fn max_difference(a: &Tensor, b: &Tensor) -> f64 {
        (a - b).abs().max().double_value(&[])
    }

    #[test]
    fn value_and_gradients_equal_autograd_through_the_plain_formula() {
        for weight_learns in [false, true] {
            for soft in [true, false] {
                let c = case(weight_learns);
                let target = if soft {
                    VocabTarget::Distribution(&c.probs)
                } else {
                    VocabTarget::Token(&c.tokens)
                };
                let ours = projected_cross_entropy(
                    &c.x,
                    &c.weight,
                    target,
                    &c.tokens,
                    true,
                    &mut Scratch::default(),
                );
                let plain = plain_loss(&c, soft);
                let label = format!("soft {soft}, weight learns {weight_learns}");
                assert!(max_difference(&ours.loss, &plain) < 1e-5, "{label}");
                let (ours_grads, plain_grads) = (gradients(&c, &ours.loss), gradients(&c, &plain));
                assert_eq!(ours_grads.len(), 1 + weight_learns as usize);
                for (a, b) in ours_grads.iter().zip(&plain_grads) {
                    assert!(b.abs().max().double_value(&[]) > 1e-3, "{label}");
                    assert!(max_difference(a, b) < 1e-5, "{label}");
                }
            }
        }
    }

    #[test]
    fn top_hits_count_the_reference_tokens_ranked_first_and_in_the_top_five() {
        // Row i's reference is the token its logits rank i mod 7 (0 = first): the hits are
        // then known whatever random state the parallel tests leave behind.
        let c = case(false);
        let logits = c.x.matmul(&c.weight.tr());
        let ranked = logits.topk(7, -1, true, true).1;
        let ranks: Vec<i64> = (0..N).map(|i| i % 7).collect();
        let tokens = ranked
            .gather(1, &Tensor::from_slice(&ranks).unsqueeze(-1), false)
            .squeeze_dim(-1);
        let ours = projected_cross_entropy(
            &c.x,
            &c.weight,
            VocabTarget::Token(&tokens),
            &tokens,
            false,
            &mut Scratch::default(),
        );
        let expected = |below: i64| ranks.iter().filter(|&&r| r < below).count() as f64;
        assert_eq!(ours.top1, expected(1));
        assert_eq!(ours.top5, expected(5));
    }

    #[test]
    fn under_bf16_autocast_the_products_round_and_the_figures_stay_close() {
        let c = case(true);
        let plain = plain_loss(&c, true);
        let plain_grads = gradients(&c, &plain);
        let ours = crate::autocast::with_autocast(Device::Cpu, Kind::BFloat16, || {
            let target = VocabTarget::Distribution(&c.probs);
            let mut scratch = Scratch::default();
            projected_cross_entropy(&c.x, &c.weight, target, &c.tokens, true, &mut scratch)
        })
        .unwrap();
        assert_eq!(ours.loss.kind(), Kind::Float);
        assert!(max_difference(&ours.loss, &plain) < 0.05);
        for (a, b) in gradients(&c, &ours.loss).iter().zip(&plain_grads) {
            assert_eq!(a.kind(), Kind::Float);
            let (difference, scale) = (max_difference(a, b), b.abs().max().double_value(&[]));
            assert!(difference > 0.0, "the products ran in bf16");
            assert!(difference < 0.03 * scale, "{difference} against {scale}");
        }
    }

    #[test]
    fn without_gradients_the_value_stays_and_nothing_flows_back() {
        let c = case(true);
        let target = VocabTarget::Distribution(&c.probs);
        let ours = projected_cross_entropy(
            &c.x,
            &c.weight,
            target,
            &c.tokens,
            false,
            &mut Scratch::default(),
        );
        assert!(!ours.loss.requires_grad());
        assert!(max_difference(&ours.loss, &plain_loss(&c, true)) < 1e-5);
    }

    #[test]
    fn a_scratch_reused_across_sizes_gives_the_figures_of_a_fresh_one() {
        let (large, small) = (case(false), case(true));
        let small = Case {
            x: small.x.narrow(0, 0, 4).detach().set_requires_grad(true),
            probs: small.probs.narrow(0, 0, 4),
            tokens: small.tokens.narrow(0, 0, 4),
            ..small
        };
        let mut shared = Scratch::default();
        for c in [&large, &small, &large] {
            let probs = projected_softmax(&c.x, &c.weight, &mut shared);
            let expected = c.x.matmul(&c.weight.tr()).softmax(-1, Kind::Float);
            assert!(max_difference(&probs, &expected) < 1e-6);
            let best = projected_argmax(&c.x, &c.weight, &mut shared);
            assert!(best.equal(&expected.argmax(-1, false)));
            let scored = |scratch: &mut Scratch| {
                let target = VocabTarget::Distribution(&c.probs);
                let loss =
                    projected_cross_entropy(&c.x, &c.weight, target, &c.tokens, true, scratch);
                (
                    loss.loss.double_value(&[]),
                    loss.top1,
                    loss.top5,
                    gradients(c, &loss.loss),
                )
            };
            let (reused, fresh) = (scored(&mut shared), scored(&mut Scratch::default()));
            assert_eq!((reused.0, reused.1, reused.2), (fresh.0, fresh.1, fresh.2));
            assert!(max_difference(&reused.3[0], &fresh.3[0]) == 0.0);
        }
    }
}
