//! Deterministic train / held-out split.
//!
//! A conversation's side depends only on its own key — the id, or the turns' content when the id
//! is empty — so it never moves when the corpus grows, is reordered or is read on another machine.
//! The hash is FNV-1a 64 finished with the SplitMix64 mixer
//! ([`headway_model::hash`]): FNV-1a alone leaves the high bits of
//! short, similar ids (`q_1`, `q_2`, …) correlated; the mixer spreads every input bit over the
//! whole word. The top 53 bits, read as a fraction `u` in [0, 1), put a conversation in the
//! held-out set when `u < held_out_fraction`.

use headway_model::hash::{fnv1a64, mix64};

use crate::conversation::Conversation;
use crate::error::{DatasetError, Result};

/// Which side of the split a conversation is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    Train,
    HeldOut,
}

/// The key a conversation is split by: `mix64(fnv1a64(split_group))` when it has a group, else
/// `mix64(fnv1a64(id))`, or its [`Conversation::content_hash`] when the id is empty.
pub fn split_hash(conversation: &Conversation) -> u64 {
    match (&conversation.split_group, conversation.id.is_empty()) {
        (Some(group), _) => mix64(fnv1a64(group.as_bytes())),
        (None, true) => conversation.content_hash(),
        (None, false) => mix64(fnv1a64(conversation.id.as_bytes())),
    }
}

fn check_fraction(held_out_fraction: f64) -> Result<()> {
    if (0.0..=1.0).contains(&held_out_fraction) {
        Ok(())
    } else {
        Err(DatasetError::Argument(format!(
            "held-out fraction must be in [0, 1], got {held_out_fraction}"
        )))
    }
}

/// The side of `conversation` for a held-out fraction in [0, 1] (0: all train, 1: all held out).
pub fn split_of(conversation: &Conversation, held_out_fraction: f64) -> Result<Split> {
    check_fraction(held_out_fraction)?;
    Ok(side(split_hash(conversation), held_out_fraction))
}

/// The side of the sequence named `id` (features imported from files, named by their paths):
/// the rule of a conversation with that id.
pub fn split_of_id(id: &str, held_out_fraction: f64) -> Result<Split> {
    check_fraction(held_out_fraction)?;
    Ok(side(mix64(fnv1a64(id.as_bytes())), held_out_fraction))
}

fn side(hash: u64, held_out_fraction: f64) -> Split {
    // 53 bits fit an f64 mantissa exactly.
    let u = (hash >> 11) as f64 / (1u64 << 53) as f64;
    if u < held_out_fraction {
        Split::HeldOut
    } else {
        Split::Train
    }
}

/// Splits `conversations` into `(train, held_out)`, each in input order.
pub fn split(
    conversations: Vec<Conversation>,
    held_out_fraction: f64,
) -> Result<(Vec<Conversation>, Vec<Conversation>)> {
    check_fraction(held_out_fraction)?;
    Ok(conversations
        .into_iter()
        .partition(|c| side(split_hash(c), held_out_fraction) == Split::Train))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conversation::{Role, Turn};

    fn with_id(id: String) -> Conversation {
        Conversation {
            id,
            turns: vec![Turn::new(Role::User, "same content")],
            split_group: None,
        }
    }

    #[test]
    fn fnv1a64_matches_the_published_test_vectors() {
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn the_split_depends_only_on_the_id_and_hits_the_fraction_on_10k_ids() {
        let ids: Vec<String> = (0..10_000).map(|i| format!("q_{i}")).collect();
        let convs: Vec<Conversation> = ids.iter().cloned().map(with_id).collect();
        let (train, held) = split(convs.clone(), 0.1).unwrap();
        assert_eq!(train.len() + held.len(), 10_000);
        // Binomial(10k, 0.1) has a standard deviation of 30; allow 5 of them.
        assert!(
            (held.len() as i64 - 1000).abs() < 150,
            "{} held out",
            held.len()
        );
        // Same ids, another order, another run: same sides.
        let mut reversed = convs.clone();
        reversed.reverse();
        let (_, held_again) = split(reversed, 0.1).unwrap();
        let mut a: Vec<&str> = held.iter().map(|c| c.id.as_str()).collect();
        let mut b: Vec<&str> = held_again.iter().map(|c| c.id.as_str()).collect();
        a.sort_unstable();
        b.sort_unstable();
        assert_eq!(a, b);
        // A pinned value guards against the hash changing between releases.
        assert_eq!(split_hash(&with_id("q_0".into())), 0xf584_c76a_1fce_2bf3);
        assert_eq!(split_of(&convs[0], 0.0).unwrap(), Split::Train);
        assert_eq!(split_of(&convs[0], 1.0).unwrap(), Split::HeldOut);
        for (id, conversation) in ids.iter().zip(&convs).take(100) {
            assert_eq!(
                split_of_id(id, 0.1).unwrap(),
                split_of(conversation, 0.1).unwrap()
            );
        }
    }

    #[test]
    fn a_split_group_overrides_the_id() {
        let parts: Vec<Conversation> = (0..50)
            .map(|i| Conversation {
                split_group: Some("chat".into()),
                ..with_id(format!("chat_{i}"))
            })
            .collect();
        let sides: Vec<Split> = parts.iter().map(|c| split_of(c, 0.5).unwrap()).collect();
        assert!(
            sides.iter().all(|&s| s == sides[0]),
            "every part on one side"
        );
        assert_eq!(split_hash(&parts[0]), mix64(fnv1a64(b"chat")));
    }

    #[test]
    fn conversations_without_an_id_are_split_by_content() {
        let a = Conversation {
            id: String::new(),
            turns: vec![Turn::new(Role::User, "x")],
            split_group: None,
        };
        assert_eq!(split_hash(&a), a.content_hash());
    }

    #[test]
    fn a_fraction_outside_zero_to_one_is_an_error() {
        assert!(split(Vec::new(), 1.5).is_err());
        assert!(split(Vec::new(), f64::NAN).is_err());
    }
}
