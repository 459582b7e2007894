//! Fuzz target: `ultrafast::fuzzing::uri_path` (see that function for the invariant).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| ultrafast::fuzzing::uri_path(data));
