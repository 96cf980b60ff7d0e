//! `BRAID_NVRTC_LIBRARY` naming a file that is not there: every entry point that needs NVRTC returns an
//! error naming the path and saying how to fix it. (Its own test binary: it sets the variable for the
//! whole process.)

use braid_cuda::Nvrtc;

#[test]
fn a_bad_nvrtc_library_path_is_an_error_naming_it() {
    let dir = std::env::temp_dir().join(format!("braid-cuda-no-nvrtc-{}", std::process::id()));
    let path = dir.join("libnvrtc.so.99");
    std::env::set_var("BRAID_NVRTC_LIBRARY", &path);
    let shown = path.display().to_string();
    let errors = [
        Nvrtc::find().unwrap_err(),
        braid_cuda::compile(80).unwrap_err(),
        braid_cuda::load_or_compile_in(&dir, 80).unwrap_err(),
    ];
    for e in errors {
        let text = e.to_string();
        assert!(text.contains(&shown), "{text}");
        assert!(text.contains("BRAID_NVRTC_LIBRARY"), "{text}");
        assert!(text.contains("nvidia-cuda-nvrtc"), "{text}");
    }
    assert!(
        !dir.exists(),
        "the cache directory was created without a compile"
    );
}
