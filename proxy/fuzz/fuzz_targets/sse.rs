//! Fuzz target: `ultrafast::fuzzing::sse` (see that function for the invariant).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| ultrafast::fuzzing::sse(data));
