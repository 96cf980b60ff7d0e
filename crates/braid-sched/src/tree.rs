//! Binary-tree schedules: the double binary tree all-reduce, and broadcast and reduce on one tree.
//!
//! # The trees
//!
//! Both are built on the "bit" tree over positions `0..n`: position `p > 0` whose lowest set bit is `b`
//! has the children `p − b/2` and `p + l`, where `l` is the largest of `b/2, b/4, …, 1` that keeps
//! `p + l < n` (so odd positions are leaves); its parent is `p` with bit `b` cleared and bit `2b` set
//! when that is `< n`, else `p` with bit `b` cleared. Position 0 is the root; its only child is the
//! largest power of two below `n`. The height is `⌈log2 n⌉`.
//!
//! All-reduce runs two such trees at once, as NCCL does, each carrying one half of the buffer. Tree 0
//! puts rank `r` at position `r`; tree 1 mirrors it (`n − 1 − r`) when `n` is even and shifts it
//! (`r − 1 mod n`) when `n` is odd. Interior positions are even, so with `n` even the interior ranks of
//! one tree are exactly the leaves of the other; with `n` odd only rank 0 (the root of tree 0, which has
//! one child) is interior in both. Each rank thus sends and receives about as much as in a ring, in
//! `O(log n)` steps instead of `O(n)`.
//!
//! Rooted broadcast and reduce use tree 0 with positions taken relative to the root.
//!
//! # All-reduce
//!
//! Per chunk of a half: leaves send their input as a partial (`SendAcc`); interior ranks load their
//! input into scratch, combine each child's partial into it and send the scratch up; the root finishes
//! the scratch into its output, and the result flows down (`RecvCopy` forwarding to the first child,
//! `Send` from the output to the second). Each element is finished at exactly one rank (its tree's root)
//! and copied everywhere else, so all ranks end bit-identical.
//!
//! Pipelining: every action gets a time slot, and each rank runs its actions in slot order (ties broken
//! by tree, then up before down). For chunk `c` of a tree of height `H`, a rank at depth `d` sends up in
//! slot `2(c + H − d)` and receives the result in slot `2(c + H) + d`; every message is received exactly
//! one slot after it is sent. So a rank keeps sending chunks up while earlier ones come back down, and
//! both trees' chunks interleave. A channel carries at most one stream per tree, each stream sends once
//! every two slots, so when a rank sends, at most one earlier message on that channel (of the other
//! tree) can still be unread: with channels of depth 2 no schedule deadlocks, whatever the timing (the
//! rank waiting in the earliest slot of all always finds its message sent and room on its channel).
//! Chunks of an empty half send nothing.

use std::ops::Range;

use crate::{chunk_of, partition, Action, Buf};

/// A rank's place in a binary tree.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Node {
    /// The parent rank; `None` at the root.
    pub parent: Option<usize>,
    /// The child ranks, at most two.
    pub children: Vec<usize>,
    /// Hops from the root.
    pub depth: usize,
}

impl Node {
    /// Whether the rank has no children.
    pub fn is_leaf(&self) -> bool {
        self.children.is_empty()
    }
}

/// Rank `rank`'s place in the two trees of the double binary tree on `world` ranks (tree 0 rooted at
/// rank 0; tree 1 rooted at rank `world − 1` for even `world`, rank 1 for odd `world`).
pub fn double_tree(world: usize, rank: usize) -> [Node; 2] {
    check(world, rank);
    [0, 1].map(|t| node(world, dt_pos(world, t, rank), |p| dt_rank(world, t, p)))
}

/// Rank `rank`'s place in the binary tree rooted at `root` used by [`broadcast`] and [`reduce`].
pub fn rooted_tree(world: usize, rank: usize, root: usize) -> Node {
    check(world, rank);
    assert!(root < world, "root {root} out of range");
    node(world, (rank + world - root) % world, |p| (p + root) % world)
}

/// Height (the largest depth) of every tree on `world` ranks used here.
pub fn height(world: usize) -> usize {
    (0..world).map(|p| depth(world, p)).max().unwrap_or(0)
}

/// Double binary tree all-reduce of `count` elements on rank `rank` of `world`, `chunk` elements per
/// message: the first half of the buffer is reduced and broadcast on tree 0, the second on tree 1.
pub fn all_reduce(world: usize, rank: usize, count: usize, chunk: usize) -> Vec<Action> {
    check(world, rank);
    if world == 1 {
        return vec![Action::Copy {
            src: 0..count,
            dst: 0..count,
        }];
    }
    assert!(chunk > 0, "chunk of zero elements");
    let h = height(world);
    let halves = partition(count, 2);
    // (slot, tree, phase: 0 up / 1 down, order within the phase)
    let mut keyed: Vec<((usize, usize, usize, usize), Action)> = Vec::new();
    for (t, (node, half)) in double_tree(world, rank).iter().zip(&halves).enumerate() {
        let d = node.depth;
        for c in 0..half.len().div_ceil(chunk) {
            let range = chunk_of(half, c, chunk);
            let up = 2 * (c + h - d);
            if !node.is_leaf() {
                keyed.push((
                    (up - 1, t, 0, 0),
                    Action::LoadAcc {
                        range: range.clone(),
                    },
                ));
                for (i, &from) in node.children.iter().enumerate() {
                    let range = range.clone();
                    keyed.push(((up - 1, t, 0, 1 + i), Action::RecvCombine { from, range }));
                }
            }
            match node.parent {
                Some(to) => {
                    let r = range.clone();
                    let send = if node.is_leaf() {
                        Action::SendAcc { to, range: r }
                    } else {
                        Action::SendScratch { to, range: r }
                    };
                    keyed.push(((up, t, 0, 0), send));
                    let down = 2 * (c + h) + d;
                    keyed.push((
                        (down, t, 1, 0),
                        Action::RecvCopy {
                            from: to,
                            output: range.clone(),
                            forward: node.children.first().copied(),
                        },
                    ));
                    if let Some(&second) = node.children.get(1) {
                        keyed.push(((down, t, 1, 1), send_output(second, range)));
                    }
                }
                None => {
                    let down = 2 * (c + h);
                    keyed.push((
                        (down, t, 1, 0),
                        Action::FinishScratch {
                            range: range.clone(),
                            nranks: world,
                        },
                    ));
                    for (i, &to) in node.children.iter().enumerate() {
                        keyed.push(((down, t, 1, 1 + i), send_output(to, range.clone())));
                    }
                }
            }
        }
    }
    keyed.sort_by_key(|(k, _)| *k);
    keyed.into_iter().map(|(_, a)| a).collect()
}

/// Pipelined binary-tree broadcast of `count` elements from `root`: the root copies its input to its
/// output and sends it to its children; every other rank receives a chunk, forwards it to its first
/// child and sends it from its output to the second.
pub fn broadcast(
    world: usize,
    rank: usize,
    root: usize,
    count: usize,
    chunk: usize,
) -> Vec<Action> {
    let node = rooted_tree(world, rank, root);
    assert!(chunk > 0, "chunk of zero elements");
    let all = 0..count;
    let mut plan = Vec::new();
    for c in 0..count.div_ceil(chunk) {
        let r = chunk_of(&all, c, chunk);
        match node.parent {
            None => {
                plan.push(Action::Copy {
                    src: r.clone(),
                    dst: r.clone(),
                });
                plan.extend(node.children.iter().map(|&to| Action::Send {
                    to,
                    buf: Buf::Input,
                    range: r.clone(),
                }));
            }
            Some(from) => {
                plan.push(Action::RecvCopy {
                    from,
                    output: r.clone(),
                    forward: node.children.first().copied(),
                });
                if let Some(&second) = node.children.get(1) {
                    plan.push(send_output(second, r));
                }
            }
        }
    }
    plan
}

/// Pipelined binary-tree reduction of `count` elements to `root`: leaves send their input as partials,
/// interior ranks accumulate their input and their children's partials in scratch and pass it up, the
/// root finishes it. Only the root writes output.
pub fn reduce(world: usize, rank: usize, root: usize, count: usize, chunk: usize) -> Vec<Action> {
    let node = rooted_tree(world, rank, root);
    if world == 1 {
        return vec![Action::Copy {
            src: 0..count,
            dst: 0..count,
        }];
    }
    assert!(chunk > 0, "chunk of zero elements");
    let all = 0..count;
    let mut plan = Vec::new();
    for c in 0..count.div_ceil(chunk) {
        let range = chunk_of(&all, c, chunk);
        if node.is_leaf() {
            let to = node
                .parent
                .expect("a leaf of a tree of several ranks has a parent");
            plan.push(Action::SendAcc { to, range });
            continue;
        }
        plan.push(Action::LoadAcc {
            range: range.clone(),
        });
        plan.extend(node.children.iter().map(|&from| Action::RecvCombine {
            from,
            range: range.clone(),
        }));
        plan.push(match node.parent {
            Some(to) => Action::SendScratch { to, range },
            None => Action::FinishScratch {
                range,
                nranks: world,
            },
        });
    }
    plan
}

fn send_output(to: usize, range: Range<usize>) -> Action {
    Action::Send {
        to,
        buf: Buf::Output,
        range,
    }
}

/// Position of `rank` in tree `t` of the double tree.
fn dt_pos(n: usize, t: usize, rank: usize) -> usize {
    match (t, n % 2) {
        (0, _) => rank,
        (_, 0) => n - 1 - rank,
        _ => (rank + n - 1) % n,
    }
}

/// Rank at position `pos` of tree `t` of the double tree.
fn dt_rank(n: usize, t: usize, pos: usize) -> usize {
    match (t, n % 2) {
        (0, _) => pos,
        (_, 0) => n - 1 - pos,
        _ => (pos + 1) % n,
    }
}

/// The node at position `pos` of the bit tree on `n` positions, with positions mapped to ranks.
fn node(n: usize, pos: usize, rank_of: impl Fn(usize) -> usize) -> Node {
    let (parent, children) = links(n, pos);
    Node {
        parent: parent.map(&rank_of),
        children: children.into_iter().map(&rank_of).collect(),
        depth: depth(n, pos),
    }
}

/// Parent and children of position `pos` in the bit tree on `n` positions.
fn links(n: usize, pos: usize) -> (Option<usize>, Vec<usize>) {
    if pos == 0 {
        // The largest power of two below n.
        let top = (n > 1).then(|| 1usize << (usize::BITS - 1 - (n - 1).leading_zeros()));
        return (None, top.into_iter().collect());
    }
    let low = pos & pos.wrapping_neg();
    let up = (pos ^ low) | (low << 1);
    let parent = if up < n { up } else { pos ^ low };
    let mut children = Vec::with_capacity(2);
    if low > 1 {
        children.push(pos - low / 2);
        let mut step = low / 2;
        while step > 0 && pos + step >= n {
            step /= 2;
        }
        if step > 0 {
            children.push(pos + step);
        }
    }
    (Some(parent), children)
}

fn depth(n: usize, mut pos: usize) -> usize {
    let mut d = 0;
    while let (Some(p), _) = links(n, pos) {
        pos = p;
        d += 1;
    }
    d
}

fn check(world: usize, rank: usize) {
    assert!(
        world > 0 && rank < world,
        "rank {rank} out of range for world {world}"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every non-root names a parent that lists it as a child, and every rank is reached from the root.
    #[test]
    fn trees_are_consistent() {
        for n in 1..=200 {
            let trees: Vec<[Node; 2]> = (0..n).map(|r| double_tree(n, r)).collect();
            for t in 0..2 {
                let roots = trees.iter().filter(|nodes| nodes[t].parent.is_none());
                assert_eq!(roots.count(), 1, "n={n} tree {t}");
                for (r, nodes) in trees.iter().enumerate() {
                    let node = &nodes[t];
                    assert!(node.children.len() <= 2);
                    if let Some(p) = node.parent {
                        assert!(trees[p][t].children.contains(&r), "n={n} t={t} r={r}");
                        assert_eq!(trees[p][t].depth + 1, node.depth);
                    }
                    for &c in &node.children {
                        assert_eq!(trees[c][t].parent, Some(r));
                    }
                    assert!(node.depth <= height(n));
                }
            }
            // Complementary: a rank interior in both trees is the root of tree 0 (odd n only).
            for (r, [a, b]) in trees.iter().enumerate() {
                if !a.is_leaf() && !b.is_leaf() {
                    assert!(n % 2 == 1 && r == 0, "n={n} r={r}");
                }
            }
            assert_eq!(
                height(n),
                (usize::BITS - (n - 1).leading_zeros()) as usize,
                "⌈log2 {n}⌉"
            );
        }
    }

    #[test]
    fn rooted_tree_is_rotated() {
        for n in 1..=40 {
            for root in 0..n {
                assert_eq!(rooted_tree(n, root, root).parent, None);
                for r in 0..n {
                    let node = rooted_tree(n, r, root);
                    if let Some(p) = node.parent {
                        assert!(rooted_tree(n, p, root).children.contains(&r));
                    }
                }
            }
        }
    }
}
