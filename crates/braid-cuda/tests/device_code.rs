//! The kernels as a GPU would get them, checked without one: every reduce-copy kernel of the catalogue
//! compiles for sm_80 and sm_90 with no spills and no local memory (ptxas `-v`), and its SASS moves
//! data with 16-byte global loads and stores on the main path (`cuobjdump -sass`). Needs nvcc and
//! cuobjdump (with nvdisasm); without them the tests say why and pass, or fail under
//! `BRAID_REQUIRE_TOOLS=1`.

mod support;

use std::collections::BTreeMap;
use std::process::Command;

use support::{cuda_tool, kernels_dir, scratch, unavailable};

/// What ptxas and the SASS say about one kernel.
#[derive(Debug, Default)]
struct Report {
    registers: Option<u32>,
    stack: Option<u64>,
    spill_stores: Option<u64>,
    spill_loads: Option<u64>,
    /// Nonzero `lmem` or `cumulative stack size` figures, as printed.
    local: Vec<String>,
    ldg128: usize,
    stg128: usize,
    narrow_global: usize,
}

fn number_before(line: &str, what: &str) -> Option<u64> {
    let i = line.find(what)?;
    line[..i].split_whitespace().last()?.parse().ok()
}

/// Parses `ptxas -v` output into per-kernel reports.
fn parse_ptxas(text: &str, reports: &mut BTreeMap<String, Report>) {
    let mut current: Option<String> = None;
    for line in text.lines() {
        if let Some(rest) = line.split("Function properties for ").nth(1) {
            current = Some(rest.trim().to_string());
            continue;
        }
        let Some(name) = current.clone() else {
            continue;
        };
        let r = reports.entry(name).or_default();
        if line.contains("stack frame") {
            r.stack = number_before(line, "bytes stack frame");
            r.spill_stores = number_before(line, "bytes spill stores");
            r.spill_loads = number_before(line, "bytes spill loads");
        }
        if line.contains("Used ") && line.contains("registers") {
            r.registers = number_before(line, "registers").map(|n| n as u32);
            for what in ["bytes lmem", "bytes cumulative stack size"] {
                if number_before(line, what).is_some_and(|n| n != 0) {
                    r.local.push(line.trim().to_string());
                }
            }
            current = None;
        }
    }
}

/// Counts 16-byte and narrower global accesses per function in `cuobjdump -sass` output.
fn parse_sass(text: &str, reports: &mut BTreeMap<String, Report>) {
    let mut current: Option<String> = None;
    for line in text.lines() {
        if let Some(rest) = line.split("Function : ").nth(1) {
            current = Some(rest.trim().to_string());
            continue;
        }
        let Some(name) = &current else { continue };
        let r = reports.entry(name.clone()).or_default();
        // Lines look like `/*0060*/   LDG.E.128 R4, desc[UR4][R4.64] ;  /* 0x... */`.
        let Some(code) = line.split("*/").nth(1) else {
            continue;
        };
        let Some(op) = code.split_whitespace().find(|t| !t.starts_with('@')) else {
            continue;
        };
        let global = op.starts_with("LDG.") || op.starts_with("STG.") || op == "LDG" || op == "STG";
        if !global {
            continue;
        }
        if op.split('.').any(|p| p == "128") {
            if op.starts_with("LDG") {
                r.ldg128 += 1;
            } else {
                r.stg128 += 1;
            }
        } else {
            r.narrow_global += 1;
        }
    }
}

fn check_arch(arch: &str) {
    let (nvcc, cuobjdump) = match (cuda_tool("nvcc"), cuda_tool("cuobjdump")) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(why), _) | (_, Err(why)) => return unavailable(&why),
    };
    let dir = scratch(&format!("device-{arch}"));
    let cubin = dir.join(format!("reduce_copy.{arch}.cubin"));
    let started = std::time::Instant::now();
    let out = Command::new(&nvcc)
        .arg(format!("-arch={arch}"))
        .args(["-cubin", "-Xptxas", "-v", "-o"])
        .arg(&cubin)
        .arg(kernels_dir().join("reduce_copy.cu"))
        .output()
        .expect("running nvcc");
    let ptxas =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "nvcc for {arch} failed:\n{ptxas}");
    let compile = started.elapsed();
    let sass = Command::new(&cuobjdump)
        .arg("-sass")
        .arg(&cubin)
        .output()
        .expect("running cuobjdump");
    assert!(
        sass.status.success(),
        "cuobjdump -sass failed (it needs nvdisasm: pip nvidia-cuda-nvdisasm): {}",
        String::from_utf8_lossy(&sass.stderr)
    );

    let mut reports = BTreeMap::new();
    parse_ptxas(&ptxas, &mut reports);
    parse_sass(&String::from_utf8_lossy(&sass.stdout), &mut reports);

    let mut problems = Vec::new();
    let names = braid_cuda::catalogue();
    for name in &names {
        let Some(r) = reports.get(name) else {
            problems.push(format!("{name}: not in the cubin"));
            continue;
        };
        if r.registers.is_none() || r.stack.is_none() {
            problems.push(format!("{name}: ptxas printed no resource usage"));
        }
        if r.stack != Some(0) || r.spill_stores != Some(0) || r.spill_loads != Some(0) {
            problems.push(format!(
                "{name}: stack {:?}, spill stores {:?}, spill loads {:?}",
                r.stack, r.spill_stores, r.spill_loads
            ));
        }
        if !r.local.is_empty() {
            problems.push(format!("{name}: local memory: {:?}", r.local));
        }
        if r.ldg128 == 0 || r.stg128 == 0 {
            problems.push(format!(
                "{name}: main path without 16-byte global accesses ({} LDG.128, {} STG.128)",
                r.ldg128, r.stg128
            ));
        }
    }
    let extra: Vec<_> = reports.keys().filter(|k| !names.contains(k)).collect();
    assert!(
        extra.is_empty(),
        "{arch}: kernels outside the catalogue: {extra:?}"
    );

    // The summary the issue notes quote: registers and 16-byte accesses by shape and dtype.
    println!(
        "{arch}: {} kernels compiled in {:.1} s",
        names.len(),
        compile.as_secs_f64()
    );
    let regs: Vec<u32> = names
        .iter()
        .filter_map(|n| reports.get(n)?.registers)
        .collect();
    println!(
        "{arch}: registers min {} max {}",
        regs.iter().min().unwrap_or(&0),
        regs.iter().max().unwrap_or(&0)
    );
    for name in &names {
        if let Some(r) = reports.get(name) {
            println!(
                "{arch} {name}: {} registers, {} LDG.128, {} STG.128, {} narrower global accesses",
                r.registers.unwrap_or(0),
                r.ldg128,
                r.stg128,
                r.narrow_global
            );
        }
    }
    assert!(
        problems.is_empty(),
        "{arch}: {} problems:\n{}",
        problems.len(),
        problems.join("\n")
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn every_kernel_compiles_for_sm80_without_spills_and_with_16_byte_accesses() {
    check_arch("sm_80");
}

#[test]
fn every_kernel_compiles_for_sm90_without_spills_and_with_16_byte_accesses() {
    check_arch("sm_90");
}

#[test]
fn parsers_see_spills_and_narrow_accesses() {
    // The checks above are only as good as their parsers: fed a spilling kernel with 4-byte accesses,
    // they must say so.
    let ptxas = "ptxas info    : Function properties for k\n    \
                 24 bytes stack frame, 20 bytes spill stores, 16 bytes spill loads\n\
                 ptxas info    : Used 255 registers, used 0 barriers, 24 bytes cumulative stack size\n";
    let sass = "\t\tFunction : k\n        /*0060*/                   LDG.E R4, desc[UR4][R4.64] ;  \
                /* 0x0000000404047981 */\n        /*0080*/              @P0 STG.E.128 desc[UR4][R2.64], R4 ;\n";
    let mut r = BTreeMap::new();
    parse_ptxas(ptxas, &mut r);
    parse_sass(sass, &mut r);
    let k = &r["k"];
    assert_eq!(
        (k.stack, k.spill_stores, k.spill_loads),
        (Some(24), Some(20), Some(16))
    );
    assert_eq!(k.registers, Some(255));
    assert_eq!(k.local.len(), 1);
    assert_eq!((k.ldg128, k.stg128, k.narrow_global), (0, 1, 1));
}

/// The compression kernels of kernels/mx.cu and kernels/int8.cu (element codes are bytes and nibbles:
/// no 16-byte accesses asked), each present with resource usage, no stack, no spills and no local
/// memory, for `arch`.
fn check_compression(arch: &str, source: &str, names: &[String]) {
    let nvcc = match cuda_tool("nvcc") {
        Ok(p) => p,
        Err(why) => return unavailable(&why),
    };
    let dir = scratch(&format!("{source}-{arch}"));
    let cubin = dir.join(format!("{source}.{arch}.cubin"));
    let out = Command::new(&nvcc)
        .arg(format!("-arch={arch}"))
        .args(["-cubin", "-Xptxas", "-v", "-o"])
        .arg(&cubin)
        .arg(kernels_dir().join(source))
        .output()
        .expect("running nvcc");
    let ptxas =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "nvcc for {arch} failed:\n{ptxas}");
    let mut reports = BTreeMap::new();
    parse_ptxas(&ptxas, &mut reports);
    let mut problems = Vec::new();
    for name in names {
        let Some(r) = reports.get(name) else {
            problems.push(format!("{name}: not in the cubin"));
            continue;
        };
        println!("{arch} {name}: {:?} registers", r.registers);
        if r.registers.is_none()
            || r.stack != Some(0)
            || r.spill_stores != Some(0)
            || r.spill_loads != Some(0)
            || !r.local.is_empty()
        {
            problems.push(format!("{name}: {r:?}"));
        }
    }
    assert!(problems.is_empty(), "{arch}: {}", problems.join("\n"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_compression_kernels_compile_for_sm80_and_sm90_without_spills_or_local_memory() {
    use braid_cuda::compress::{mx_acc_kernel, mx_ef_kernel, INT8_EF_KERNEL, MX_FORMATS};
    let mx: Vec<String> = MX_FORMATS
        .iter()
        .flat_map(|f| [mx_ef_kernel(f), mx_acc_kernel(f)])
        .collect();
    for arch in ["sm_80", "sm_90"] {
        check_compression(arch, "mx.cu", &mx);
        check_compression(arch, "int8.cu", &[INT8_EF_KERNEL.to_string()]);
    }
}
