//! Throughput of every reference codec over one gradient buffer, next to a memcpy of the same buffer
//! measured in the same run: the ratios are what carries over between machines.
//!
//! ```sh
//! cargo run --release -p braid-compress --example codec_throughput        # 64 MiB of f32
//! cargo run --release -p braid-compress --example codec_throughput -- 16  # 16 MiB
//! ```
//!
//! GB/s counts gradient bytes (4 per element) per second, 1 GB = 10⁹ bytes; each figure is the best of a
//! few repetitions. Single-threaded, like the codecs.

use std::hint::black_box;
use std::time::{Duration, Instant};

use braid_compress::rng::Stream;
use braid_compress::{
    Cast, Codec, ErrorFeedback, Int8, PowerSgd, RandomK, Sign, ThresholdTopK, TopK,
};

const REPS: usize = 3;

fn best<T>(reps: usize, mut f: impl FnMut() -> T) -> Duration {
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            black_box(f());
            t.elapsed()
        })
        .min()
        .expect("at least one repetition")
}

fn main() {
    let mib: usize = std::env::args()
        .nth(1)
        .map(|a| a.parse().expect("the argument is a size in MiB"))
        .unwrap_or(64);
    let len = mib * (1 << 20) / 4;
    let bytes = (4 * len) as f64;
    let gbps = |d: Duration| bytes / d.as_secs_f64() / 1e9;

    // A heavy-tailed gradient: normals, one in 50 multiplied by 30.
    let s = Stream::new(1, 1000, 0);
    let grad: Vec<f32> = (0..len as u64)
        .map(|i| {
            s.normal_at(i)
                * if s.u64_at(i | 1 << 40) % 50 == 0 {
                    30.0
                } else {
                    1.0
                }
        })
        .collect();
    let mut out = vec![0f32; len];

    let memcpy = best(5, || out.copy_from_slice(black_box(&grad)));
    let base = gbps(memcpy);
    println!("{mib} MiB of f32 gradient ({len} elements), best of {REPS}, single thread");
    println!("memcpy: {base:.2} GB/s");
    println!();
    println!(
        "{:<30} {:>10} {:>8} {:>12} {:>8} {:>9}",
        "codec", "compress", "/memcpy", "decompress", "/memcpy", "wire/f32"
    );

    let codecs: Vec<(&str, Box<dyn Codec>)> = vec![
        ("top-k 10%", Box::new(TopK::default())),
        ("top-k 1%", Box::new(TopK::new(0.01).unwrap())),
        (
            "threshold top-k 10%",
            Box::new(ThresholdTopK::new(0.1, 7).unwrap()),
        ),
        (
            "threshold top-k 1%",
            Box::new(ThresholdTopK::new(0.01, 7).unwrap()),
        ),
        ("random-k 10%", Box::new(RandomK::new(0.1, 7).unwrap())),
        ("random-k 1%", Box::new(RandomK::new(0.01, 7).unwrap())),
        ("int8 block 256", Box::new(Int8::default())),
        (
            "int8 block 256 stochastic",
            Box::new(Int8::stochastic(256, 7).unwrap()),
        ),
        ("sign block 256", Box::new(Sign::default())),
        ("fp16", Box::new(Cast::F16)),
        ("bf16", Box::new(Cast::Bf16)),
        (
            "PowerSGD rank 4 (warm)",
            Box::new(PowerSgd::new(4, 7).unwrap()),
        ),
    ];
    for (label, mut codec) in codecs {
        let mut step = 0;
        let compress = best(REPS, || {
            step += 1;
            codec.compress(&grad, step)
        });
        let c = codec.compress(&grad, 0);
        let decompress = best(REPS, || c.decompress(&mut out).unwrap());
        println!(
            "{:<30} {:>5.2} GB/s {:>7.3}x {:>7.2} GB/s {:>7.3}x {:>9.4}",
            label,
            gbps(compress),
            gbps(compress) / base,
            gbps(decompress),
            gbps(decompress) / base,
            c.wire_bytes() as f64 / bytes,
        );
    }

    // The whole step a rank runs: clip check, add the error, compress, decompress, new error, statistics.
    let mut ef = ErrorFeedback::new(len);
    let mut codec = TopK::default();
    let mut step = 0;
    let t = best(REPS, || {
        step += 1;
        ef.step(&grad, &mut codec, step).unwrap()
    });
    println!(
        "{:<30} {:>5.2} GB/s {:>7.3}x",
        "error-feedback step, top-k 10%",
        gbps(t),
        gbps(t) / base
    );
}
