//! Attention masks and position ids for prefix + new-token forwards.
//!
//! Convention (the one `scaled_dot_product_attention` uses for boolean masks): a mask is a `Bool`
//! tensor of shape `[batch or 1, 1, new, past + new]` where `true` means "may attend". Row `i` is
//! the `i`-th new token; columns `0..past` are the cached prefix, `past..past + new` the new tokens.

use tch::{Device, Kind, Tensor};

use crate::{ModelError, Result};

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
