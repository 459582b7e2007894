//! Compiling the CUDA C kernels at run time with NVRTC, for the GPU's own
//! compute capability, with the results cached on disk.
//!
//! NVRTC is opened with `dlopen` like the driver ([`crate::cuda`]), so no
//! CUDA toolkit is needed to build or to test: the PyPI wheel
//! `nvidia-cuda-nvrtc==13.*` ships `libnvrtc.so.13` and
//! `libnvrtc-builtins.so.13.N` (N its minor version) and nothing else (no
//! headers, which is why the kernel sources include none). Given the
//! wheel's `lib` folder, the builtins library found there, whatever its
//! minor version, is loaded first and globally, so NVRTC's own lookup of it
//! by name succeeds without `LD_LIBRARY_PATH`.

// The C calls into NVRTC need `unsafe`; each block says why it holds.
#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};

type Create = unsafe extern "C" fn(
    *mut *mut c_void,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> c_int;
type Compile = unsafe extern "C" fn(*mut c_void, c_int, *const *const c_char) -> c_int;
type Size = unsafe extern "C" fn(*mut c_void, *mut usize) -> c_int;
type Get = unsafe extern "C" fn(*mut c_void, *mut c_char) -> c_int;
type Destroy = unsafe extern "C" fn(*mut *mut c_void) -> c_int;
type Version = unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int;

/// An opened NVRTC library.
pub struct Nvrtc {
    create: Create,
    compile: Compile,
    log_size: Size,
    log: Get,
    cubin_size: Size,
    cubin: Get,
    destroy: Destroy,
    /// Major and minor version (13, 0 for the wheel).
    pub version: (i32, i32),
}

/// What one compilation gave.
#[derive(Debug, Clone)]
pub struct Compiled {
    /// The CUBIN for the requested architecture.
    pub cubin: Vec<u8>,
    /// NVRTC's log, with ptxas's report (registers, spills) per kernel.
    pub log: String,
}

impl Compiled {
    /// Kernels whose registers spilled to local memory, from ptxas's
    /// report (`N bytes spill stores` with N > 0).
    pub fn spills(&self) -> Vec<String> {
        let mut out = Vec::new();
        let mut current = "";
        for line in self.log.lines() {
            if let Some(i) = line.find("Compiling entry function '") {
                let rest = &line[i + 26..];
                current = rest.split('\'').next().unwrap_or("");
            }
            if let Some(i) = line.find(" bytes spill stores") {
                let n = line[..i].rsplit(' ').next().unwrap_or("0");
                if n.trim().parse::<u64>().unwrap_or(0) > 0 {
                    out.push(current.to_string());
                }
            }
        }
        out
    }
}

/// The NVRTC builtins library in `dir`: `libnvrtc-builtins.so.13.N`, the
/// newest minor version there (a 13.1 wheel has `.13.1`, not `.13.0`).
pub fn builtins_in(dir: &Path) -> Option<PathBuf> {
    let minor = |name: &str| -> Option<u32> {
        name.strip_prefix("libnvrtc-builtins.so.13.")?
            .split('.')
            .next()?
            .parse()
            .ok()
    };
    std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| {
            let name = e.ok()?.file_name().into_string().ok()?;
            Some((minor(&name)?, name))
        })
        .max()
        .map(|(_, name)| dir.join(name))
}

impl Nvrtc {
    /// Opens NVRTC: from `dir` when given (the wheel's `nvidia/cu13/lib`),
    /// else by name through the loader's search path.
    pub fn open(dir: Option<&Path>) -> Result<Nvrtc, String> {
        let open = |path: &str, flags: c_int| -> *mut c_void {
            let Ok(c) = CString::new(path) else {
                return std::ptr::null_mut();
            };
            // SAFETY: a NUL-terminated name; the handle is kept for the
            // process's life (its functions are called through pointers).
            unsafe { libc::dlopen(c.as_ptr(), flags) }
        };
        let lib = match dir {
            Some(d) => {
                // NVRTC dlopens its builtins by name at the first compile:
                // loaded globally first, that name is already resolved.
                if let Some(builtins) = builtins_in(d) {
                    open(
                        &builtins.to_string_lossy(),
                        libc::RTLD_NOW | libc::RTLD_GLOBAL,
                    );
                }
                open(&d.join("libnvrtc.so.13").to_string_lossy(), libc::RTLD_NOW)
            }
            None => open("libnvrtc.so.13", libc::RTLD_NOW),
        };
        if lib.is_null() {
            return Err(match dir {
                Some(d) => format!("no NVRTC in {} (libnvrtc.so.13)", d.display()),
                None => "no NVRTC (libnvrtc.so.13 not found)".into(),
            });
        }
        let sym = |name: &CStr| -> Result<*mut c_void, String> {
            // SAFETY: a live handle and a NUL-terminated name.
            let p = unsafe { libc::dlsym(lib, name.as_ptr()) };
            if p.is_null() {
                Err(format!("NVRTC lacks {}", name.to_string_lossy()))
            } else {
                Ok(p)
            }
        };
        // SAFETY (all): these are NVRTC's C signatures (nvrtc.h) since
        // CUDA 11.1 (the CUBIN calls); function pointers are pointer-sized.
        let n = unsafe {
            Nvrtc {
                create: std::mem::transmute::<*mut c_void, Create>(sym(c"nvrtcCreateProgram")?),
                compile: std::mem::transmute::<*mut c_void, Compile>(sym(c"nvrtcCompileProgram")?),
                log_size: std::mem::transmute::<*mut c_void, Size>(sym(c"nvrtcGetProgramLogSize")?),
                log: std::mem::transmute::<*mut c_void, Get>(sym(c"nvrtcGetProgramLog")?),
                cubin_size: std::mem::transmute::<*mut c_void, Size>(sym(c"nvrtcGetCUBINSize")?),
                cubin: std::mem::transmute::<*mut c_void, Get>(sym(c"nvrtcGetCUBIN")?),
                destroy: std::mem::transmute::<*mut c_void, Destroy>(sym(c"nvrtcDestroyProgram")?),
                version: (0, 0),
            }
        };
        let version: Version =
            // SAFETY: as above.
            unsafe { std::mem::transmute::<*mut c_void, Version>(sym(c"nvrtcVersion")?) };
        let (mut major, mut minor) = (0, 0);
        // SAFETY: two live out-pointers.
        unsafe { version(&mut major, &mut minor) };
        Ok(Nvrtc {
            version: (major, minor),
            ..n
        })
    }

    /// Compiles `source` for `sm_<arch>` (90 for an H100/H200) with
    /// ptxas's verbose report in the log.
    pub fn compile(&self, source: &str, name: &str, arch: u32) -> Result<Compiled, String> {
        let src = CString::new(source).map_err(|_| "a NUL byte in the source")?;
        let cname = CString::new(name).map_err(|_| "a NUL byte in the name")?;
        let opts: Vec<CString> = options(arch)
            .iter()
            .filter_map(|o| CString::new(o.as_str()).ok())
            .collect();
        let ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
        let mut prog: *mut c_void = std::ptr::null_mut();
        // SAFETY: live NUL-terminated strings; no headers (0, null, null).
        let rc = unsafe {
            (self.create)(
                &mut prog,
                src.as_ptr(),
                cname.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            )
        };
        if rc != 0 || prog.is_null() {
            return Err(format!("nvrtcCreateProgram failed ({rc})"));
        }
        // SAFETY: `prog` is live until the destroy below; the option
        // pointers outlive the call; the buffers are sized by NVRTC's own
        // size calls.
        unsafe {
            let rc = (self.compile)(prog, ptrs.len() as c_int, ptrs.as_ptr());
            let mut n = 0usize;
            (self.log_size)(prog, &mut n);
            let mut log = vec![0u8; n.max(1)];
            (self.log)(prog, log.as_mut_ptr().cast());
            let log = CStr::from_bytes_until_nul(&log)
                .map(|c| c.to_string_lossy().into_owned())
                .unwrap_or_default();
            let out = if rc != 0 {
                Err(format!("{name} does not compile for sm_{arch}:\n{log}"))
            } else {
                let mut n = 0usize;
                (self.cubin_size)(prog, &mut n);
                let mut cubin = vec![0u8; n];
                (self.cubin)(prog, cubin.as_mut_ptr().cast());
                Ok(Compiled { cubin, log })
            };
            (self.destroy)(&mut prog);
            out
        }
    }

    /// [`Nvrtc::compile`] through a disk cache in `dir`, keyed by a hash
    /// of the source, the options and NVRTC's version: the first start on
    /// a GPU compiles, later ones load.
    pub fn compile_cached(
        &self,
        source: &str,
        name: &str,
        arch: u32,
        dir: &Path,
    ) -> Result<Vec<u8>, String> {
        let path = cache_path(dir, source, arch, self.version);
        if let Ok(bytes) = std::fs::read(&path) {
            if !bytes.is_empty() {
                return Ok(bytes);
            }
        }
        let c = self.compile(source, name, arch)?;
        // A cache that cannot be written only costs the next start a
        // compile; write through a temporary name so a reader never sees
        // half a file.
        if std::fs::create_dir_all(dir).is_ok() {
            let tmp = path.with_extension(format!("tmp{}", std::process::id()));
            if std::fs::write(&tmp, &c.cubin).is_ok() {
                let _ = std::fs::rename(&tmp, &path);
            }
        }
        Ok(c.cubin)
    }
}

/// NVRTC's options for `sm_<arch>`.
pub fn options(arch: u32) -> Vec<String> {
    vec![
        format!("--gpu-architecture=sm_{arch}"),
        "--std=c++17".into(),
        "--use_fast_math".into(),
        "--ptxas-options=-v".into(),
        "-default-device".into(),
    ]
}

/// Where the CUBIN of `source` for `sm_<arch>` is cached in `dir`.
pub fn cache_path(dir: &Path, source: &str, arch: u32, version: (i32, i32)) -> PathBuf {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    ctx.update(source.as_bytes());
    for o in options(arch) {
        ctx.update(b"\0");
        ctx.update(o.as_bytes());
    }
    ctx.update(format!("\0nvrtc {}.{}", version.0, version.1).as_bytes());
    let hex: String = ctx
        .finish()
        .as_ref()
        .iter()
        .take(16)
        .map(|b| format!("{b:02x}"))
        .collect();
    dir.join(format!("sm{arch}-{hex}.cubin"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spills_are_read_from_the_ptxas_report() {
        let log = "ptxas info    : Compiling entry function 'a' for 'sm_90'\n\
                   ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
                   ptxas info    : Compiling entry function 'b' for 'sm_90'\n\
                   ptxas         .     8 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads\n";
        let c = Compiled {
            cubin: Vec::new(),
            log: log.into(),
        };
        assert_eq!(c.spills(), vec!["b".to_string()]);
    }

    #[test]
    fn the_builtins_are_found_whatever_their_minor_version() {
        let d = std::env::temp_dir().join(format!("nvrtc-builtins-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        assert_eq!(builtins_in(&d), None);
        for name in [
            "libnvrtc.so.13",
            "libnvrtc-builtins.so.13.0",
            "libnvrtc-builtins.so.13.2",
            "libnvrtc-builtins.so.12.9",
        ] {
            std::fs::write(d.join(name), b"").unwrap();
        }
        assert_eq!(builtins_in(&d), Some(d.join("libnvrtc-builtins.so.13.2")));
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn the_cache_key_follows_source_options_and_version() {
        let d = Path::new("/c");
        let a = cache_path(d, "x", 90, (13, 0));
        assert_eq!(a, cache_path(d, "x", 90, (13, 0)));
        assert_ne!(a, cache_path(d, "y", 90, (13, 0)));
        assert_ne!(a, cache_path(d, "x", 80, (13, 0)));
        assert_ne!(a, cache_path(d, "x", 90, (13, 1)));
    }
}
