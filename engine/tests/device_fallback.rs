//! `device = "auto"` and `"cuda"` on the real model: the start-up check
//! that a device runner agrees with the CPU (`backend::probe`) passes a
//! runner that computes what the CPU computes and refuses one that does
//! not; where no GPU can run the model, `auto` falls back to the CPU
//! (never a panic) and `cuda` is an error naming the device.

#![allow(clippy::unwrap_used)]
use std::sync::Arc;
use ultrafast_engine::backend::{self, cpu_runner, probe, Device, KvDtype, ModelRunner};
use ultrafast_engine::fetch::{self, SMOLLM2};
use ultrafast_engine::generate;
use ultrafast_engine::model::paged::SeqStep;

/// A runner whose logits are off: one logit raised by `by`.
struct Off {
    inner: Box<dyn ModelRunner>,
    by: f32,
}

impl ModelRunner for Off {
    fn describe(&self) -> String {
        "off".into()
    }
    fn step(
        &mut self,
        seqs: &[SeqStep],
        stop: &(dyn Fn(usize) -> bool + Sync),
        logits: &mut Vec<f32>,
    ) -> ultrafast_engine::error::Result<bool> {
        let ran = self.inner.step(seqs, stop, logits)?;
        if let Some(l) = logits.get_mut(7) {
            *l += self.by;
        }
        Ok(ran)
    }
    fn kv_bytes(&self) -> usize {
        self.inner.kv_bytes()
    }
}

#[test]
fn a_device_runner_must_agree_with_the_cpu_and_auto_falls_back_to_it() {
    let path = fetch::pull(&SMOLLM2).unwrap();
    let loaded = Arc::new(generate::load(&path).unwrap());
    let cpu = || cpu_runner(&loaded, 8, 16, KvDtype::F16, || {}).unwrap();
    let mut same = Off {
        inner: cpu(),
        by: 0.0,
    };
    let ok = probe::agrees_with_cpu(&mut same, &loaded, 16, KvDtype::F16, || {});
    assert!(ok.is_ok(), "{ok:?}");
    let mut off = Off {
        inner: cpu(),
        by: 5.0,
    };
    let e = probe::agrees_with_cpu(&mut off, &loaded, 16, KvDtype::F16, || {}).unwrap_err();
    assert!(e.contains("differs by"), "{e}");

    if std::path::Path::new("/dev/nvidiactl").exists() {
        eprintln!(
            "skipped the fallback half: this machine has an NVIDIA GPU (the GPU check covers it)"
        );
        return;
    }
    let auto =
        backend::runner_for(Device::Cuda(0), &loaded, 8, 16, KvDtype::F16, || {}, true).unwrap();
    assert_eq!(auto.device(), Device::Cpu, "auto runs on the CPU here");
    let e = backend::runner_for(Device::Cuda(0), &loaded, 8, 16, KvDtype::F16, || {}, false)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("device \"cuda:0\""), "{e}");
}
