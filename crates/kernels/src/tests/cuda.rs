use super::*;

#[test]
fn probe_never_panics_and_agrees_with_is_available() {
    let p = probe();
    assert_eq!(is_available(), matches!(p, Availability::Devices(_)));
}

/// NVRTC compiles both kernels wherever its library is found (no GPU needed: `LD_LIBRARY_PATH` pointing at PyPI's
/// `nvidia-cuda-nvrtc` is enough); without it there is nothing to check here.
#[test]
fn the_kernels_compile_where_nvrtc_is_present() {
    match crate::launch::ptx("compute_90") {
        Ok(ptx) => {
            assert!(ptx.contains(".entry hscapture_capture_armed("), "capture kernel missing from the PTX");
            assert!(ptx.contains(".entry hscapture_fp8_quantize("), "fp8 kernel missing from the PTX");
        }
        Err(e) if e.0.contains("dynamically load") || e.0.contains("library") => eprintln!("NVRTC not present: {e:?}"),
        Err(e) => panic!("the kernels do not compile: {e:?}"),
    }
}
