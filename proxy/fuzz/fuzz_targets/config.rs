//! Fuzz target: `ultrafast::fuzzing::config` (see that function for the invariant).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| ultrafast::fuzzing::config(data));
