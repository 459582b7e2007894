//! Every kernel source compiles with NVRTC for sm_90 (H100/H200) and sm_80
//! (A100), defines the kernels it lists, and spills no register (from
//! ptxas's report). No GPU is needed: NVRTC comes from the PyPI wheel
//! `nvidia-cuda-nvrtc==13.0.*`, which `.ci/run` installs in `.venv`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use ultrafast_kernels::nvrtc::Nvrtc;
use ultrafast_kernels::sources::SOURCES;

/// The wheel's library folder: `$ULTRAFAST_NVRTC_DIR`, else the one in the
/// repository's `.venv`.
fn wheel_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("ULTRAFAST_NVRTC_DIR") {
        return PathBuf::from(d);
    }
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.venv/lib");
    std::fs::read_dir(&venv)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("site-packages/nvidia/cu13/lib"))
        .find(|p| p.join("libnvrtc.so.13").exists())
        .unwrap_or_else(|| {
            panic!(
                "NVRTC not found: install it with `.venv/bin/pip install 'nvidia-cuda-nvrtc==13.0.*'` \
                 (bash .ci/run does) or set ULTRAFAST_NVRTC_DIR to a folder with libnvrtc.so.13"
            )
        })
}

#[test]
fn every_kernel_compiles_for_sm90_and_sm80_without_spills() {
    let nvrtc = Nvrtc::open(Some(&wheel_dir())).expect("NVRTC opens");
    assert_eq!(nvrtc.version.0, 13, "the CUDA 13 NVRTC wheel");
    for arch in [90, 80] {
        for src in SOURCES {
            let c = nvrtc
                .compile(&src.full(), src.name, arch)
                .unwrap_or_else(|e| panic!("{e}"));
            assert!(c.cubin.len() > 1000, "{}: a CUBIN for sm_{arch}", src.name);
            for k in src.kernels {
                assert!(
                    c.log.contains(&format!("Compiling entry function '{k}'")),
                    "{}: kernel {k} is missing for sm_{arch}:\n{}",
                    src.name,
                    c.log
                );
            }
            assert!(
                c.spills().is_empty(),
                "{}: registers spill in {:?} for sm_{arch}:\n{}",
                src.name,
                c.spills(),
                c.log
            );
        }
    }
}

#[test]
fn compiled_kernels_are_cached_on_disk() {
    let nvrtc = Nvrtc::open(Some(&wheel_dir())).expect("NVRTC opens");
    let dir = tempfile::tempdir().unwrap();
    let src = SOURCES[3];
    let first = nvrtc
        .compile_cached(&src.full(), src.name, 90, dir.path())
        .unwrap();
    let files: Vec<_> = std::fs::read_dir(dir.path()).unwrap().flatten().collect();
    assert_eq!(files.len(), 1, "one cached CUBIN");
    // The second call reads the file: prove it by changing the file.
    let path = files[0].path();
    std::fs::write(&path, b"cached").unwrap();
    let second = nvrtc
        .compile_cached(&src.full(), src.name, 90, dir.path())
        .unwrap();
    assert_eq!(second, b"cached");
    assert_ne!(first, second);
}

#[test]
fn a_kernel_that_does_not_compile_names_itself() {
    let nvrtc = Nvrtc::open(Some(&wheel_dir())).expect("NVRTC opens");
    let err = nvrtc
        .compile("extern \"C\" __global__ void k() { nope(); }", "bad.cu", 90)
        .unwrap_err();
    assert!(err.contains("bad.cu") && err.contains("nope"), "{err}");
}

/// Without a GPU, opening one is an error that names CUDA, never a panic
/// (cudarc panics on a missing library; `Gpu::open` probes first). With
/// one, every kernel loads.
#[test]
fn opening_a_gpu_either_loads_every_kernel_or_says_why_not() {
    let nvrtc = Nvrtc::open(Some(&wheel_dir())).expect("NVRTC opens");
    let dir = tempfile::tempdir().unwrap();
    match (
        ultrafast_kernels::cuda::probe(),
        ultrafast_kernels::gpu::Gpu::open(0, &nvrtc, dir.path()),
    ) {
        (Err(_), Err(why)) => assert!(why.contains("CUDA"), "{why}"),
        (Ok(_), Ok(g)) => eprintln!(
            "opened {} (sm_{}{})",
            g.name, g.capability.0, g.capability.1
        ),
        (Ok(gpus), Err(why)) => panic!("a GPU is present ({gpus:?}) but did not open: {why}"),
        (Err(why), Ok(_)) => panic!("the probe found no GPU ({why}) but one opened"),
    }
}
