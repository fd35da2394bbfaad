//! Attention masks and position ids for prefix + new-token forwards.
//!
//! Convention (the one `scaled_dot_product_attention` uses for boolean masks): a mask is a `Bool`
//! tensor of shape `[batch or 1, 1, new, past + new]` where `true` means "may attend". Row `i` is
//! the `i`-th new token; columns `0..past` are the cached prefix, `past..past + new` the new tokens.
//!
//! [`TreeInput`] is the one value every caller builds a forward over new tokens from
//! ([`crate::ForwardInput::new`]): a causal run (prefill, decoding) or a tree (verification, EAGLE
//! drafting, latency profiles).

use tch::{Device, Kind, Tensor};

use crate::{ModelError, Result};

/// Token ids `[1, n]`, position ids `[1, n]` and, for a tree, the ancestor mask
/// `[1, 1, n, past + n]` of `n` new tokens after `past` cached ones.
pub struct TreeInput {
    pub ids: Tensor,
    pub positions: Tensor,
    /// `None` for a causal run: decoding needs no mask, and plain decoding's arithmetic is the
    /// reference that tree verification must match.
    pub mask: Option<Tensor>,
}

impl TreeInput {
    /// `tokens` in order after `past` cached ones, each seeing everything before it.
    pub fn causal(past: usize, tokens: &[u32], device: Device) -> Self {
        Self {
            ids: ids_tensor(tokens, device),
            positions: positions(past, tokens.len(), device),
            mask: None,
        }
    }

    /// A tree of `tokens` after `past` cached ones: `parents[i]` is token `i`'s parent among the
    /// new tokens (`None`: it hangs off the prefix); each token sees the prefix, its ancestors and
    /// itself, at position `past + depth` (children of the prefix at depth 0). The mask is always
    /// explicit: callers that want plain decoding's arithmetic use [`Self::causal`].
    pub fn tree(
        past: usize,
        tokens: &[u32],
        parents: &[Option<usize>],
        device: Device,
    ) -> Result<Self> {
        if tokens.len() != parents.len() {
            return Err(ModelError::Input(format!(
                "a tree of {} tokens needs as many parents, got {}",
                tokens.len(),
                parents.len()
            )));
        }
        let positions: Vec<i64> = tree_depths(parents)
            .iter()
            .map(|&d| (past + d) as i64)
            .collect();
        Ok(Self {
            ids: ids_tensor(tokens, device),
            positions: Tensor::from_slice(&positions)
                .unsqueeze(0)
                .to_device(device),
            mask: Some(tree_mask(past, parents, device)?),
        })
    }

    /// The last `rows` tokens only, for a forward whose cache already holds the others (the
    /// EAGLE drafter feeds its tree depth by depth): their mask rows keep every column.
    pub fn last_rows(self, rows: usize) -> Self {
        let n = self.ids.size()[1];
        let (start, len) = (n - rows as i64, rows as i64);
        Self {
            ids: self.ids.narrow(1, start, len),
            positions: self.positions.narrow(1, start, len),
            mask: self.mask.map(|m| m.narrow(2, start, len)),
        }
    }
}

/// Token ids `[1, n]`.
fn ids_tensor(tokens: &[u32], device: Device) -> Tensor {
    let ids: Vec<i64> = tokens.iter().map(|&t| i64::from(t)).collect();
    Tensor::from_slice(&ids).unsqueeze(0).to_device(device)
}

/// A causal mask for `new` tokens after `past` cached ones.
pub fn causal_mask(past: usize, new: usize, device: Device) -> Tensor {
    let rows = Tensor::arange(new as i64, (Kind::Int64, device)).unsqueeze(1);
    let cols = Tensor::arange((past + new) as i64, (Kind::Int64, device)).unsqueeze(0);
    cols.le_tensor(&(rows + past as i64))
        .view([1, 1, new as i64, (past + new) as i64])
}

/// A tree mask for `parents.len()` new tokens after `past` cached ones: every new token sees the
/// whole prefix, itself and its ancestors. `parents[i]` is the index (among the new tokens) of
/// token `i`'s parent, `None` for tokens that hang directly off the prefix; parents must come
/// before their children.
pub fn tree_mask(past: usize, parents: &[Option<usize>], device: Device) -> Result<Tensor> {
    let new = parents.len();
    let width = past + new;
    let mut allowed = vec![false; new * width];
    for (node, parent) in parents.iter().enumerate() {
        let row = &mut allowed[node * width..(node + 1) * width];
        row[..past].iter_mut().for_each(|a| *a = true);
        row[past + node] = true;
        let mut ancestor = *parent;
        while let Some(a) = ancestor {
            if a >= node {
                return Err(ModelError::Input(format!(
                    "tree node {node} has parent {a}: parents must precede their children"
                )));
            }
            row[past + a] = true;
            ancestor = parents[a];
        }
    }
    Ok(Tensor::from_slice(&allowed)
        .view([1, 1, new as i64, width as i64])
        .to_device(device))
}

/// Depth of each tree node (roots hang off the prefix at depth 0), the position offset that tree
/// verification gives each node after the prefix.
pub fn tree_depths(parents: &[Option<usize>]) -> Vec<usize> {
    let mut depths = Vec::with_capacity(parents.len());
    for parent in parents {
        let depth = parent.map_or(0, |p| depths.get(p).map_or(0, |d: &usize| d + 1));
        depths.push(depth);
    }
    depths
}

/// Position ids `[1, new]` for `new` consecutive tokens starting at `start`.
pub fn positions(start: usize, new: usize, device: Device) -> Tensor {
    Tensor::arange_start(start as i64, (start + new) as i64, (Kind::Int64, device)).unsqueeze(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(t: &Tensor) -> Vec<i64> {
        Vec::<i64>::try_from(t.to_kind(Kind::Int64).view([-1])).unwrap()
    }

    #[test]
    fn a_tree_input_holds_depth_positions_and_each_nodes_ancestors() {
        // Prefix of 3; tokens 10 → 11 → 13 and 10 → 12.
        let parents = [None, Some(0), Some(0), Some(1)];
        let input = TreeInput::tree(3, &[10, 11, 12, 13], &parents, Device::Cpu).unwrap();
        assert_eq!(values(&input.ids), [10, 11, 12, 13]);
        assert_eq!(values(&input.positions), [3, 4, 4, 5]);
        let mask = input.mask.as_ref().unwrap();
        assert_eq!(mask.size(), [1, 1, 4, 7]);
        let row = |r: i64| values(&mask.get(0).get(0).get(r));
        assert_eq!(row(0), [1, 1, 1, 1, 0, 0, 0]);
        assert_eq!(row(2), [1, 1, 1, 1, 0, 1, 0]);
        assert_eq!(row(3), [1, 1, 1, 1, 1, 0, 1]);
        // The last rows alone keep every column: the earlier nodes are in the cache.
        let last = TreeInput::tree(3, &[10, 11, 12, 13], &parents, Device::Cpu)
            .unwrap()
            .last_rows(2);
        assert_eq!(values(&last.ids), [12, 13]);
        assert_eq!(values(&last.positions), [4, 5]);
        assert!(last.mask.unwrap().equal(&mask.narrow(2, 2, 2)));
        let causal = TreeInput::causal(5, &[7, 8], Device::Cpu);
        assert_eq!(values(&causal.positions), [5, 6]);
        assert!(causal.mask.is_none());
        assert!(TreeInput::tree(0, &[1, 2], &[None], Device::Cpu).is_err());
        assert!(TreeInput::tree(0, &[1, 2], &[Some(1), None], Device::Cpu).is_err());
    }
}
