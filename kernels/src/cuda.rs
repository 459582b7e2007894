//! Finding the CUDA driver and its GPUs at run time.
//!
//! The driver library is opened with `dlopen` and asked through five of
//! its C functions (`cuInit`, `cuDeviceGetCount`, `cuDeviceGet`,
//! `cuDeviceGetName`, `cuDeviceGetAttribute`); nothing is linked, so a
//! machine without CUDA gets a reason, never a crash.

// The C calls into the driver need `unsafe`; each block says why it holds.
#![allow(unsafe_code)]

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};

/// One GPU the driver reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gpu {
    /// Ordinal (what `cuda:N` names).
    pub index: usize,
    /// Marketing name, as the driver gives it.
    pub name: String,
    /// Compute capability, major and minor (9, 0 for an H100/H200).
    pub capability: (i32, i32),
}

/// The sonames tried, newest first.
const LIBS: [&CStr; 2] = [c"libcuda.so.1", c"libcuda.so"];

const ATTR_CC_MAJOR: c_int = 75;
const ATTR_CC_MINOR: c_int = 76;

type Init = unsafe extern "C" fn(c_uint) -> c_int;
type Count = unsafe extern "C" fn(*mut c_int) -> c_int;
type Get = unsafe extern "C" fn(*mut c_int, c_int) -> c_int;
type Name = unsafe extern "C" fn(*mut c_char, c_int, c_int) -> c_int;
type Attr = unsafe extern "C" fn(*mut c_int, c_int, c_int) -> c_int;

/// The GPUs of this machine, or why there are none usable (no driver
/// library, a driver that fails to start, no device).
pub fn probe() -> Result<Vec<Gpu>, String> {
    let lib = LIBS
        .iter()
        // SAFETY: dlopen with a NUL-terminated name; the handle is only
        // used for dlsym below and deliberately never closed (the driver
        // keeps process-wide state).
        .map(|n| unsafe { libc::dlopen(n.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) })
        .find(|h| !h.is_null())
        .ok_or("no CUDA driver (libcuda.so.1 not found)")?;
    let sym = |name: &CStr| -> Result<*mut c_void, String> {
        // SAFETY: a live handle and a NUL-terminated name.
        let p = unsafe { libc::dlsym(lib, name.as_ptr()) };
        if p.is_null() {
            Err(format!("the CUDA driver lacks {}", name.to_string_lossy()))
        } else {
            Ok(p)
        }
    };
    // SAFETY (all five): the symbols have these C signatures in every CUDA
    // driver API version (cuda.h); function pointers are pointer-sized.
    let (init, count, get, name, attr) = unsafe {
        (
            std::mem::transmute::<*mut c_void, Init>(sym(c"cuInit")?),
            std::mem::transmute::<*mut c_void, Count>(sym(c"cuDeviceGetCount")?),
            std::mem::transmute::<*mut c_void, Get>(sym(c"cuDeviceGet")?),
            std::mem::transmute::<*mut c_void, Name>(sym(c"cuDeviceGetName")?),
            std::mem::transmute::<*mut c_void, Attr>(sym(c"cuDeviceGetAttribute")?),
        )
    };
    // SAFETY: cuInit takes flags 0; the out-pointers below point at live
    // locals of the right types and sizes.
    unsafe {
        let rc = init(0);
        if rc != 0 {
            return Err(format!("the CUDA driver did not start (cuInit error {rc})"));
        }
        let mut n: c_int = 0;
        let rc = count(&mut n);
        if rc != 0 {
            return Err(format!("cannot count CUDA devices (error {rc})"));
        }
        if n <= 0 {
            return Err("the CUDA driver reports no device".into());
        }
        let mut gpus = Vec::new();
        for i in 0..n {
            let mut dev: c_int = 0;
            if get(&mut dev, i) != 0 {
                continue;
            }
            let mut buf = [0 as c_char; 256];
            let named = name(buf.as_mut_ptr(), buf.len() as c_int - 1, dev) == 0;
            let (mut major, mut minor) = (0, 0);
            attr(&mut major, ATTR_CC_MAJOR, dev);
            attr(&mut minor, ATTR_CC_MINOR, dev);
            gpus.push(Gpu {
                index: i as usize,
                name: if named {
                    CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned()
                } else {
                    "unknown GPU".into()
                },
                capability: (major, minor),
            });
        }
        if gpus.is_empty() {
            return Err("no CUDA device could be opened".into());
        }
        Ok(gpus)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs everywhere: without a driver it must say so (not panic); with
    /// one, every GPU has a name and a real compute capability.
    #[test]
    fn probe_finds_gpus_or_says_why_not() {
        match probe() {
            Ok(gpus) => {
                assert!(!gpus.is_empty());
                for g in gpus {
                    assert!(!g.name.is_empty() && g.capability.0 >= 3, "{g:?}");
                }
            }
            Err(why) => {
                eprintln!("no GPU here: {why}");
                assert!(why.contains("CUDA"), "the reason names CUDA: {why}");
            }
        }
    }
}
