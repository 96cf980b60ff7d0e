//! The kernels compiled at run time by NVRTC, without a GPU: every kernel of the catalogue lands in the
//! CUBIN for sm_80 and sm_90, the disk cache answers the second time with the same bytes, a damaged
//! entry is compiled again, and a cache that cannot be written costs only the compile. Needs libnvrtc
//! (`python3 -m pip install nvidia-cuda-nvrtc`); without it the tests say why and pass, or fail under
//! `BRAID_REQUIRE_TOOLS=1`.

mod support;

use std::time::Instant;

use braid_cuda::{driver_available, load_or_compile_in, CacheOutcome, Nvrtc};
use support::{scratch, unavailable};

fn nvrtc() -> Option<&'static Nvrtc> {
    match Nvrtc::get() {
        Ok(n) => Some(n),
        Err(e) => {
            unavailable(&e.to_string());
            None
        }
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// The image is an ELF CUBIN naming every entry point of the catalogue (as NUL-terminated symbols).
fn check_cubin(arch: u32, image: &[u8]) {
    assert!(
        image.starts_with(b"\x7fELF"),
        "sm_{arch}: not an ELF image (starts {:02x?})",
        &image[..image.len().min(4)]
    );
    let missing: Vec<String> = braid_cuda::catalogue()
        .into_iter()
        .filter(|name| !contains(image, format!("{name}\0").as_bytes()))
        .collect();
    assert!(
        missing.is_empty(),
        "sm_{arch}: {} kernels missing from the CUBIN: {missing:?}",
        missing.len()
    );
}

#[test]
fn sm80_compiles_is_cached_and_a_damaged_entry_is_compiled_again() {
    let Some(n) = nvrtc() else { return };
    let version = n.version().unwrap();
    assert!(
        n.has_cubin(),
        "NVRTC {version:?} at {} makes no CUBINs",
        n.path()
    );
    let dir = scratch("nvrtc-cache");

    let started = Instant::now();
    let (image, outcome) = load_or_compile_in(&dir, 80).unwrap();
    let cold = started.elapsed();
    assert_eq!(outcome, CacheOutcome::Miss);
    check_cubin(80, &image);

    let started = Instant::now();
    let (again, outcome) = load_or_compile_in(&dir, 80).unwrap();
    let hit = started.elapsed();
    assert_eq!(outcome, CacheOutcome::Hit);
    assert!(again == image, "the cache returned other bytes");
    println!(
        "NVRTC {}.{} ({}): {} kernels for sm_80 compiled in {:.1} s, read from the cache in {:.1} ms \
         ({} bytes)",
        version.0,
        version.1,
        n.path(),
        braid_cuda::catalogue().len(),
        cold.as_secs_f64(),
        hit.as_secs_f64() * 1e3,
        image.len()
    );

    // Damage the entry: one flipped byte in the image is seen, compiled again and replaced by a good
    // entry (truncations and other damage are the unit tests' business: each costs a compile here).
    let entries: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(
        entries.len(),
        1,
        "one entry, no temporary files: {entries:?}"
    );
    let entry = &entries[0];
    let mut bytes = std::fs::read(entry).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(entry, &bytes).unwrap();
    let (recompiled, outcome) = load_or_compile_in(&dir, 80).unwrap();
    assert_eq!(outcome, CacheOutcome::Miss, "a corrupt entry was trusted");
    assert!(
        recompiled == image,
        "NVRTC compiled other bytes the second time"
    );
    let (_, outcome) = load_or_compile_in(&dir, 80).unwrap();
    assert_eq!(
        outcome,
        CacheOutcome::Hit,
        "the corrupt entry was not replaced"
    );

    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn sm90_compiles_even_where_the_cache_cannot_be_written() {
    if nvrtc().is_none() {
        return;
    }
    // A cache directory under a regular file cannot be created, even by root: the kernels are
    // compiled anyway (and a warning says why they are not cached).
    let dir = scratch("nvrtc-unwritable");
    let file = dir.join("a-file");
    std::fs::write(&file, b"").unwrap();
    let started = Instant::now();
    let (image, outcome) = load_or_compile_in(&file.join("cache"), 90).unwrap();
    println!(
        "sm_90: {} bytes in {:.1} s without a cache",
        image.len(),
        started.elapsed().as_secs_f64()
    );
    assert_eq!(outcome, CacheOutcome::Miss);
    check_cubin(90, &image);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_unknown_architecture_is_an_invalid_argument() {
    if nvrtc().is_none() {
        return;
    }
    let e = braid_cuda::compile(7).unwrap_err();
    assert!(e.is_invalid_argument(), "{e}");
}

#[test]
fn a_library_that_is_not_nvrtc_is_refused() {
    // libc loads everywhere and is no NVRTC.
    let e = Nvrtc::open(std::path::Path::new("libc.so.6")).unwrap_err();
    assert!(e.contains("is not NVRTC"), "{e}");
    let e = Nvrtc::open(std::path::Path::new("/nonexistent/libnvrtc.so")).unwrap_err();
    assert!(e.contains("/nonexistent/libnvrtc.so"), "{e}");
}

#[test]
fn the_driver_check_says_whether_there_is_a_driver() {
    // A machine with the NVIDIA kernel driver has /proc/driver/nvidia; CI and this crate's other
    // checks run where there is none.
    let has_gpu_driver = std::path::Path::new("/proc/driver/nvidia").exists();
    match driver_available() {
        Ok(()) => assert!(has_gpu_driver, "libcuda loaded without the kernel driver"),
        Err(e) => {
            let text = e.to_string();
            assert!(text.starts_with("no CUDA driver: "), "{text}");
            assert!(text.contains("libcuda.so.1"), "{text}");
            assert!(!has_gpu_driver, "the driver is installed but: {text}");
        }
    }
}

#[test]
fn the_device_resident_all_reduce_compiles_for_every_world_size_and_is_cached() {
    use braid_core::{DType, ReduceOp};
    use braid_cuda::resident::{kernel_headers, kernel_name, kernel_source, MAX_RANKS};
    let Some(nvrtc) = nvrtc() else { return };
    let dir = scratch("nvrtc-resident");
    // One kernel per world size (each its own program), in the dtypes whose reductions differ most.
    for world in 1..=MAX_RANKS {
        let (dtype, op) = match world % 3 {
            0 => (DType::F32, ReduceOp::Sum),
            1 => (DType::BF16, ReduceOp::Avg),
            _ => (DType::I64, ReduceOp::Max),
        };
        let name = kernel_name(dtype, op, world);
        let source = kernel_source(dtype, op, world);
        let arch = if world % 2 == 0 { 90 } else { 80 };
        let started = std::time::Instant::now();
        let (image, outcome) = braid_cuda::load_or_compile_program_in(
            &dir,
            &format!("{name}.cu"),
            &source,
            &kernel_headers(),
            arch,
        )
        .unwrap_or_else(|e| panic!("{name} for sm_{arch}: {e}"));
        assert_eq!(outcome, braid_cuda::CacheOutcome::Miss);
        assert!(
            !nvrtc.has_cubin() || image.starts_with(b"\x7fELF"),
            "{name} for sm_{arch}: not an ELF image"
        );
        assert!(
            contains(&image, format!("{name}\0").as_bytes()),
            "{name} is not in its image"
        );
        println!(
            "{name} for sm_{arch}: {} bytes in {:.1?}",
            image.len(),
            started.elapsed()
        );
        let (again, outcome) = braid_cuda::load_or_compile_program_in(
            &dir,
            &format!("{name}.cu"),
            &source,
            &kernel_headers(),
            arch,
        )
        .unwrap();
        assert_eq!((again, outcome), (image, braid_cuda::CacheOutcome::Hit));
    }
}

#[test]
fn the_compression_kernels_compile_through_nvrtc_for_sm80_and_sm90() {
    use braid_cuda::compress::{
        headers, mx_acc_kernel, mx_ef_kernel, INT8_EF_KERNEL, INT8_SOURCE, MX_FORMATS, MX_SOURCE,
    };
    let Some(nvrtc) = nvrtc() else { return };
    let dir = scratch("nvrtc-compress");
    let mx: Vec<String> = MX_FORMATS
        .iter()
        .flat_map(|f| [mx_ef_kernel(f), mx_acc_kernel(f)])
        .collect();
    for arch in [80, 90] {
        for (source, names) in [
            (MX_SOURCE, mx.clone()),
            (INT8_SOURCE, vec![INT8_EF_KERNEL.to_string()]),
        ] {
            let (image, outcome) =
                braid_cuda::load_or_compile_program_in(&dir, source.0, source.1, &headers(), arch)
                    .unwrap_or_else(|e| panic!("{} for sm_{arch}: {e}", source.0));
            assert_eq!(outcome, braid_cuda::CacheOutcome::Miss);
            assert!(!nvrtc.has_cubin() || image.starts_with(b"\x7fELF"));
            for name in names {
                assert!(
                    contains(&image, format!("{name}\0").as_bytes()),
                    "{name} is not in the sm_{arch} image of {}",
                    source.0
                );
            }
        }
    }
}
