//! Helpers for tests of code that drafts with heads (here and in `headway-serve`).

use headway_model::linear::Matrix;
use headway_model::testing::tiny_config;
use tch::{Device, Kind, Tensor};

use crate::eagle::TAP_PROJ;
use crate::{Eagle3Config, Eagle3Head, EagleConfig, EagleHead};

/// A fresh EAGLE head of `layers` layers fusing `taps` for the tiny test target, after seeding
/// libtorch's generator with `seed`: the target's embedding is random, and the LM head is its
/// first `lm_rows` rows (a draft vocabulary when fewer than the vocabulary).
pub fn tiny_eagle_head(seed: i64, layers: usize, taps: Vec<usize>, lm_rows: i64) -> EagleHead {
    tch::manual_seed(seed);
    let config = tiny_config();
    let embed = Tensor::randn(
        [config.vocab_size as i64, config.hidden_size as i64],
        (Kind::Float, Device::Cpu),
    );
    let config = EagleConfig::for_target(&config, layers).with_taps(taps);
    EagleHead::new(
        config,
        &Matrix::Dense(embed.shallow_clone()),
        &embed.narrow(0, 0, lm_rows),
    )
    .expect("a valid tiny head")
}

/// A fresh EAGLE-3 head for the tiny test target fusing `taps` and drafting over its first
/// `draft_vocab` tokens, after seeding libtorch's generator with `seed` (random embedding; LM-head
/// rows from it; the LM head itself random, as a trained head's would be, not the target's).
pub fn tiny_eagle3_head(seed: i64, taps: Vec<usize>, draft_vocab: usize) -> Eagle3Head {
    tch::manual_seed(seed);
    let config = tiny_config();
    let embed = Tensor::randn(
        [config.vocab_size as i64, config.hidden_size as i64],
        (Kind::Float, Device::Cpu),
    );
    let rows = Tensor::randn(
        [draft_vocab as i64, config.hidden_size as i64],
        (Kind::Float, Device::Cpu),
    );
    let config = Eagle3Config::for_target(&config, taps, draft_vocab);
    Eagle3Head::new(config, &Matrix::Dense(embed), &rows).expect("a valid tiny head")
}

/// Replaces a tapped head's tap projection, zero when fresh (so the head starts by ignoring its
/// taps), with random weights of standard deviation `std`, so that drafting really reads the
/// taps. A head without taps is left as it is.
pub fn randomize_tap_projection(head: &mut EagleHead, std: f64) {
    if let Ok(projection) = head.params.get(TAP_PROJ) {
        let random = projection.randn_like() * std;
        head.params.insert(TAP_PROJ, &random);
    }
}
