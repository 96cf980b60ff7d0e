//! Helpers shared by the integration tests.
#![allow(dead_code)]

use braid_compress::mx::MxElement;
use braid_compress::rng::Stream;
use braid_compress::{Cast, Codec, Int8, Mx, PowerSgd, RandomK, Sign, ThresholdTopK, TopK};

/// A heavy-tailed gradient: standard normals, one in 50 multiplied by 30.
pub fn grad(seed: u64, len: usize) -> Vec<f32> {
    let s = Stream::new(seed, 1000, 0);
    (0..len as u64)
        .map(|i| {
            s.normal_at(i)
                * if s.u64_at(i + (1 << 40)) % 50 == 0 {
                    30.0
                } else {
                    1.0
                }
        })
        .collect()
}

/// One of every codec, with seed `seed` where a codec takes one.
pub fn all_codecs(seed: u64) -> Vec<Box<dyn Codec>> {
    vec![
        Box::new(TopK::default()),
        Box::new(TopK::new(0.01).unwrap()),
        Box::new(
            ThresholdTopK::new(0.1, seed)
                .unwrap()
                .with_sample(0.05, 16)
                .unwrap(),
        ),
        Box::new(RandomK::new(0.1, seed).unwrap()),
        Box::new(RandomK::new(0.25, seed).unwrap().unbiased()),
        Box::new(Int8::default()),
        Box::new(Int8::new(7).unwrap()),
        Box::new(Int8::stochastic(32, seed).unwrap()),
        Box::new(Sign::default()),
        Box::new(Sign::whole_tensor()),
        Box::new(Cast::F16),
        Box::new(Cast::Bf16),
        Box::new(PowerSgd::new(2, seed).unwrap()),
        Box::new(
            PowerSgd::new(3, seed)
                .unwrap()
                .with_cols(7)
                .unwrap()
                .without_warm_start(),
        ),
        Box::new(Mx::new(MxElement::E4M3)),
        Box::new(Mx::new(MxElement::E5M2)),
        Box::new(Mx::new(MxElement::E2M1)),
    ]
}

/// A `rows × r` row-major matrix with orthonormal columns: Gaussian, orthogonalised twice.
pub fn orthonormal(seed: u64, rows: usize, r: usize) -> Vec<f32> {
    let s = Stream::new(seed, 1001, 0);
    let mut a: Vec<f32> = (0..(rows * r) as u64).map(|i| s.normal_at(i)).collect();
    braid_compress::power_sgd::orthogonalize(&mut a, r, 0.0);
    braid_compress::power_sgd::orthogonalize(&mut a, r, 0.0);
    a
}
