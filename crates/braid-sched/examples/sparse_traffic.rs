//! The sparse all-reduce's traffic model: bytes per rank of the all-gather way, the reduce-scatter way
//! and a dense ring, for a tensor of `LEN` f32 elements at `DENSITY` (arguments; defaults 2^24 and 0.1).
//!
//! `cargo run -p braid-sched --example sparse_traffic -- 16777216 0.01`

use braid_sched::sparse::traffic;

fn main() {
    let mut args = std::env::args().skip(1);
    let len: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(1 << 24);
    let density: f64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(0.1);
    let k = ((density * len as f64).round() as u64).clamp(1, len.max(1) as u64);
    println!("# bytes per rank, {len} f32 elements, {k} pairs per rank (density {density})");
    println!(
        "# {:>5} {:>15} {:>15} {:>15} {:>9} {:>9}",
        "ranks", "all-gather", "reduce-scatter", "dense ring", "ag/dense", "rs/dense"
    );
    for n in [2usize, 4, 8, 16, 32, 64, 128, 256] {
        let t = traffic(n, len, k);
        println!(
            "  {n:>5} {:>15} {:>15} {:>15} {:>9.3} {:>9.3}",
            t.all_gather,
            t.reduce_scatter,
            t.dense_ring,
            t.all_gather as f64 / t.dense_ring as f64,
            t.reduce_scatter as f64 / t.dense_ring as f64
        );
    }
}
