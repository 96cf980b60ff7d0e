//! braid's view of the CUDA driver ABI, checked without a GPU against CUDA's own `cuda.h`: every entry
//! point braid loads is declared there under its first name, with the C parameter list braid wrote
//! beside its Rust signature (a C compiler assigns each to a pointer of that type, so a wrong type is
//! a compile error), the Rust parameter types match those C types one for one, every constant has
//! cuda.h's value, and `RcArgs` has the layout the C++ compiler gives `braid::RcArgs`.

mod support;

use std::path::PathBuf;
use std::process::Command;

use braid_cuda::driver::api::{CONSTANTS, ENTRY_POINTS, STRUCTS};
use support::{cuda_include, cxx, kernels_dir, scratch, unavailable};

/// The C types a Rust parameter type of the table may stand for.
fn c_types(rust: &str) -> &'static [&'static str] {
    match rust.replace(' ', "").as_str() {
        "c_uint" => &["unsigned int"],
        "c_int" => &[
            "int",
            "CUdevice_attribute",
            "CUpointer_attribute",
            "CUmemAllocationGranularity_flags",
            "CUmemAllocationHandleType",
            "CUstreamCaptureMode",
        ],
        "*mutc_int" => &["int*", "CUstreamCaptureStatus*"],
        "u64" => &["unsigned long long", "CUmemGenericAllocationHandle"],
        "*mutu64" => &["CUmemGenericAllocationHandle*"],
        "*constMemAllocationProp" => &["const CUmemAllocationProp*"],
        "*constMemAccessDesc" => &["const CUmemAccessDesc*"],
        "IpcMemHandle" => &["CUipcMemHandle"],
        "*mutIpcMemHandle" => &["CUipcMemHandle*"],
        "CuResult" => &["CUresult"],
        "CuDevice" => &["CUdevice"],
        "CuDevicePtr" => &["CUdeviceptr"],
        "Handle" => &[
            "CUcontext",
            "CUstream",
            "CUevent",
            "CUmodule",
            "CUfunction",
            "CUgraph",
            "CUgraphExec",
        ],
        "*mutHandle" => &[
            "CUcontext*",
            "CUstream*",
            "CUevent*",
            "CUmodule*",
            "CUfunction*",
            "CUgraph*",
            "CUgraphExec*",
        ],
        "*mutc_char" => &["char*"],
        "*constc_char" => &["const char*"],
        "*mut*constc_char" => &["const char**"],
        "*mutCuDevice" => &["CUdevice*"],
        "*mutCuDevicePtr" => &["CUdeviceptr*"],
        "usize" => &["size_t"],
        "*mutusize" => &["size_t*"],
        "u8" => &["unsigned char"],
        "u32" => &["cuuint32_t"],
        "*mutf32" => &["float*"],
        "*mutc_void" => &["void*"],
        "*constc_void" => &["const void*"],
        "*mut*mutc_void" => &["void**"],
        _ => &[],
    }
}

fn params(c: &str) -> Vec<String> {
    let c = c.trim();
    if c == "void" {
        return Vec::new();
    }
    c.split(',').map(|p| p.trim().to_string()).collect()
}

#[test]
fn rust_and_c_parameter_types_agree_one_for_one() {
    for (names, c, rust) in ENTRY_POINTS {
        let c = params(c);
        assert_eq!(
            c.len(),
            rust.len(),
            "{}: {} C parameters, {} Rust",
            names[0],
            c.len(),
            rust.len()
        );
        for (i, (cp, rp)) in c.iter().zip(rust.iter()).enumerate() {
            assert!(
                c_types(rp).contains(&cp.as_str()),
                "{} parameter {i}: Rust {rp} is not C {cp}",
                names[0]
            );
        }
    }
}

#[test]
fn entry_points_and_constants_match_cuda_h() {
    let include = match cuda_include() {
        Ok(p) => p,
        Err(why) => return unavailable(&why),
    };
    let cc = match std::env::var("CC") {
        Ok(cc) => cc,
        Err(_) => "gcc".into(),
    };
    // The entry points are only type-checked (`-c`: there is no driver to link), the constants printed.
    let mut src = String::from(
        "#include <cuda.h>\n#include <stddef.h>\n#include <stdio.h>\n\nint main(void) {\n#ifndef CONSTANTS_ONLY\n",
    );
    for (i, (names, c, _)) in ENTRY_POINTS.iter().enumerate() {
        let c = if c.trim() == "void" {
            "void".to_string()
        } else {
            params(c).join(", ")
        };
        src.push_str(&format!(
            "  {{ CUresult (*f{i})({c}) = &{}; (void)f{i}; }}\n",
            names[0]
        ));
    }
    src.push_str("#endif\n");
    for (name, _, fields) in STRUCTS {
        src.push_str(&format!(
            "  printf(\"sizeof {name} %zu\\n\", sizeof({name}));\n"
        ));
        for (field, _) in fields.iter() {
            src.push_str(&format!(
                "  printf(\"offsetof {name} {field} %zu\\n\", offsetof({name}, {field}));\n"
            ));
        }
    }
    for (name, _) in CONSTANTS {
        src.push_str(&format!(
            "  printf(\"{name} %lld\\n\", (long long)({name}));\n"
        ));
    }
    src.push_str("  return 0;\n}\n");
    let dir = scratch("driver-abi");
    let (file, exe) = (dir.join("abi.c"), dir.join("abi"));
    std::fs::write(&file, &src).unwrap();
    let compile = |extra: &[&str], out: &PathBuf| {
        Command::new(&cc)
            .args(["-std=c11", "-Wall", "-Werror"])
            .args(extra)
            .arg("-I")
            .arg(&include)
            .arg(&file)
            .arg("-o")
            .arg(out)
            .output()
            .expect("running the C compiler")
    };
    let out = compile(&["-c"], &dir.join("abi.o"));
    assert!(
        out.status.success(),
        "braid's driver entry points do not match {}/cuda.h:\n{}",
        include.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let out = compile(&["-DCONSTANTS_ONLY"], &exe);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run = Command::new(&exe).output().unwrap();
    let text = String::from_utf8_lossy(&run.stdout);
    for (name, size, fields) in STRUCTS {
        let line = format!("sizeof {name} {size}");
        assert!(
            text.lines().any(|l| l == line),
            "{name} is not {size} bytes in cuda.h:\n{text}"
        );
        for (field, offset) in fields.iter() {
            let line = format!("offsetof {name} {field} {offset}");
            assert!(
                text.lines().any(|l| l == line),
                "{name}.{field} is not at offset {offset} in cuda.h:\n{text}"
            );
        }
    }
    for (name, value) in CONSTANTS {
        let line = format!("{name} {value}");
        assert!(
            text.lines().any(|l| l == line),
            "{name} is not {value} in cuda.h:\n{text}"
        );
    }
    println!(
        "{} entry points and {} constants match {}",
        ENTRY_POINTS.len(),
        CONSTANTS.len(),
        include.join("cuda.h").display()
    );
}

#[test]
fn rc_args_has_the_kernels_layout() {
    let cxx = match cxx() {
        Ok(c) => c,
        Err(why) => return unavailable(&why),
    };
    let dir = scratch("rcargs");
    let (file, exe): (PathBuf, PathBuf) = (dir.join("layout.cpp"), dir.join("layout"));
    std::fs::write(
        &file,
        "#include <cstddef>\n#include <cstdio>\n#include \"braid_reduce_copy.cuh\"\n\
         int main() { std::printf(\"%zu %zu %zu %zu %zu %zu\\n\", sizeof(braid::RcArgs), \
         alignof(braid::RcArgs), offsetof(braid::RcArgs, src), offsetof(braid::RcArgs, dst), \
         offsetof(braid::RcArgs, count), offsetof(braid::RcArgs, nranks)); }\n",
    )
    .unwrap();
    let out = Command::new(cxx)
        .args([
            "-std=c++17",
            "-Wall",
            "-Werror",
            "-Wno-unknown-pragmas",
            "-I",
        ])
        .arg(kernels_dir())
        .arg(&file)
        .arg("-o")
        .arg(&exe)
        .output()
        .expect("running the C++ compiler");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got = String::from_utf8(Command::new(&exe).output().unwrap().stdout).unwrap();
    let want = format!(
        "{} {} {} {} {} {}\n",
        std::mem::size_of::<braid_cuda::RcArgs>(),
        std::mem::align_of::<braid_cuda::RcArgs>(),
        std::mem::offset_of!(braid_cuda::RcArgs, src),
        std::mem::offset_of!(braid_cuda::RcArgs, dst),
        std::mem::offset_of!(braid_cuda::RcArgs, count),
        std::mem::offset_of!(braid_cuda::RcArgs, nranks)
    );
    assert_eq!(got, want, "C++ layout (left) against Rust's (right)");
}
