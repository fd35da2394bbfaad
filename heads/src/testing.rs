//! Helpers for tests of code that drafts with heads (here and in `headway-serve`).

use crate::eagle::TAP_PROJ;
use crate::EagleHead;

/// Replaces a tapped head's tap projection, zero when fresh (so the head starts by ignoring its
/// taps), with random weights of standard deviation `std`, so that drafting really reads the
/// taps. A head without taps is left as it is.
pub fn randomize_tap_projection(head: &mut EagleHead, std: f64) {
    if let Ok(projection) = head.params.get(TAP_PROJ) {
        let random = projection.randn_like() * std;
        head.params.insert(TAP_PROJ, &random);
    }
}
