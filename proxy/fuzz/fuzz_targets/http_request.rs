//! Fuzz target: `ultrafast::fuzzing::http_request` (see that function for the invariant).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| ultrafast::fuzzing::http_request(data));
