//! Per-request stop strings over streamed text: text that might be the start of a stop string is
//! held back until it is clear, so a stop string never reaches the client, streamed or not.

pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
    stopped: bool,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops,
            pending: String::new(),
            stopped: false,
        }
    }

    /// Whether a stop string was found (generation should end).
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Adds `piece`; returns the text that is now safe to emit.
    pub fn push(&mut self, piece: &str) -> String {
        if self.stopped {
            return String::new();
        }
        self.pending.push_str(piece);
        let earliest = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min();
        if let Some(at) = earliest {
            self.stopped = true;
            let out = self.pending[..at].to_string();
            self.pending.clear();
            return out;
        }
        let hold = self
            .stops
            .iter()
            .flat_map(|s| {
                (1..s.len())
                    .filter(|&k| s.is_char_boundary(k))
                    .map(move |k| &s[..k])
            })
            .filter(|prefix| self.pending.ends_with(prefix))
            .map(str::len)
            .max()
            .unwrap_or(0);
        let emit = self.pending.len() - hold;
        let out = self.pending[..emit].to_string();
        self.pending.drain(..emit);
        out
    }

    /// The held-back text once generation has ended without a stop string.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_back_partial_matches_and_cuts_at_the_stop_string() {
        let mut m = StopMatcher::new(vec!["END".into(), "\n\n".into()]);
        assert_eq!(m.push("hello E"), "hello ");
        assert_eq!(m.push("N"), "");
        assert_eq!(m.push("VELOPE "), "ENVELOPE ");
        assert_eq!(m.push("x\n"), "x");
        assert_eq!(m.push("\nmore"), "");
        assert!(m.stopped());
        let mut m = StopMatcher::new(vec!["ü!".into()]);
        assert_eq!(m.push("aü"), "a");
        assert_eq!(m.finish(), "ü");
    }
}
