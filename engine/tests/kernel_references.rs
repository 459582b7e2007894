//! The CUDA kernels' CPU references (`ultrafast_kernels::reference`) held
//! to the engine's CPU code: the GGUF dequantization against candle's
//! (which loads every model) and its bfloat16 copy for prompt GEMMs, RMSNorm, RoPE and SiLU against the CPU
//! runner's loops, the KV slot against `model::paged::slot_of`, top-k
//! against the sampler's argmax, attention against the softmax by its
//! definition in f64. The GPU check then holds the kernels to the same
//! references, so a kernel that agrees there agrees with the engine here.
#![allow(clippy::unwrap_used)]

mod common;
use candle_core::quantized::{ggml_file::qtensor_from_ggml, GgmlDType};
use candle_core::Device;
use ultrafast_engine::backend::cpu::{ops, transcode};
use ultrafast_kernels::reference::{self as r, Format, PagedKv, XorShift as Gen};

/// `format`'s blocks with realistic random scales.
fn blocks(g: &mut Gen, format: Format, rows: usize, cols: usize) -> Vec<u8> {
    r::random_blocks(g, format, rows, cols, r::realistic_scale(format))
}

/// `rows x cols` weights of `dtype` blocks as candle dequantizes them.
fn candle_dequantized(dtype: GgmlDType, raw: &[u8], rows: usize, cols: usize) -> Vec<f32> {
    qtensor_from_ggml(dtype, raw, vec![rows, cols], &Device::Cpu)
        .unwrap()
        .dequantize(&Device::Cpu)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

#[test]
fn gguf_blocks_dequantize_as_candle_reads_them() {
    let mut g = Gen(0x9e37_79b9);
    for (format, dtype) in [
        (Format::Q4_1, GgmlDType::Q4_1),
        (Format::Q8_0, GgmlDType::Q8_0),
        (Format::Q4K, GgmlDType::Q4K),
        (Format::Q6K, GgmlDType::Q6K),
    ] {
        let (rows, cols) = (3, 512);
        let w = blocks(&mut g, format, rows, cols);
        let want = candle_dequantized(dtype, &w, rows, cols);
        let got: Vec<f32> = w
            .chunks(format.block_bytes())
            .flat_map(|b| r::dequantize(format, b))
            .collect();
        assert_eq!(got.len(), want.len());
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!(
                (a - b).abs() <= 1e-6 * b.abs().max(1e-3),
                "{format:?} weight {i}: {a} vs candle's {b}"
            );
        }
        // The GEMV's meaning: the dequantized rows times the activations.
        let tokens = 3;
        let x: Vec<f32> = (0..tokens * cols).map(|_| g.f()).collect();
        let y = r::gemv(format, &w, &x, rows, cols, tokens);
        for t in 0..tokens {
            for row in 0..rows {
                let exact: f64 = (0..cols)
                    .map(|k| want[row * cols + k] as f64 * x[t * cols + k] as f64)
                    .sum();
                let got = y[t * rows + row] as f64;
                assert!(
                    (got - exact).abs() <= 1e-4 * (1.0 + exact.abs()),
                    "{format:?}"
                );
            }
        }
        // The prompt GEMM's meaning: candle's weights and the activations
        // each rounded to bfloat16 (nearest even), products summed in f32.
        let wb = r::dequant_bf16(format, &w, rows, cols);
        for (a, b) in wb.iter().zip(&want) {
            let bits = b.to_bits();
            let even = (bits >> 16) & 1;
            let rounded = ((bits + 0x7fff + even) >> 16) as u16;
            assert_eq!(*a, rounded, "{format:?}: bfloat16 of {b}");
        }
        let mut yb = vec![0.0f32; tokens * rows];
        r::gemm_bf16(&wb, &x, rows, cols, tokens, false, &mut yb);
        for t in 0..tokens {
            for row in 0..rows {
                // Each factor moves by at most 2^-9 of itself when rounded
                // to bfloat16, so each product by at most about 2^-8.
                let bound: f32 = (0..cols)
                    .map(|k| (want[row * cols + k] * x[t * cols + k]).abs())
                    .sum::<f32>()
                    * 2f32.powi(-8)
                    + 1e-5;
                let (a, b) = (yb[t * rows + row], y[t * rows + row]);
                assert!(
                    (a - b).abs() <= bound,
                    "{format:?}: {a} vs {b} (bound {bound})"
                );
            }
        }
        let once = yb.clone();
        r::gemm_bf16(&wb, &x, rows, cols, tokens, true, &mut yb);
        for (a, b) in yb.iter().zip(&once) {
            assert!((a - 2.0 * b).abs() <= 1e-6 * (1.0 + b.abs()), "accumulates");
        }
    }
}

#[test]
fn norm_rope_and_silu_match_the_cpu_runner() {
    let mut g = Gen(7);
    let d = 576;
    let x: Vec<f32> = (0..d).map(|_| g.f() * 3.0).collect();
    let add: Vec<f32> = (0..d).map(|_| g.f()).collect();
    let w: Vec<f32> = (0..d).map(|_| g.f() + 1.0).collect();
    let mut xr = x.clone();
    let got = r::rmsnorm_residual(&mut xr, Some(&add), &w, 1e-5);
    let summed: Vec<f32> = x.iter().zip(&add).map(|(a, b)| a + b).collect();
    assert_eq!(xr, summed, "the residual stream is updated in place");
    let mut want = vec![0.0; d];
    ops::rmsnorm(&summed, &w, 1e-5, &mut want);
    for (a, b) in got.iter().zip(&want) {
        assert!(
            (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
            "rmsnorm {a} vs {b}"
        );
    }

    // RoPE: the runner's tables are built with the same formula.
    let (heads, hd, theta, pos) = (9, 64, 100_000.0f32, 37);
    let q: Vec<f32> = (0..heads * hd).map(|_| g.f()).collect();
    let (cos, sin): (Vec<f32>, Vec<f32>) = (0..hd / 2)
        .map(|i| {
            let a = pos as f32 * (1.0 / theta.powf(2.0 * i as f32 / hd as f32));
            (a.cos(), a.sin())
        })
        .unzip();
    for neox in [false, true] {
        let mut a = q.clone();
        r::rope(&mut a, pos, heads, hd, theta, neox);
        let mut b = q.clone();
        ops::rope(&mut b, hd, &cos, &sin, neox);
        assert_eq!(a, b, "rope, neox = {neox}");
    }

    // SiLU over the fused gate|up rows of two tokens.
    let ff = 1536;
    let gu: Vec<f32> = (0..2 * 2 * ff).map(|_| g.f() * 6.0).collect();
    let got = r::silu_mul(&gu, ff, 2);
    for t in 0..2 {
        let row = &gu[t * 2 * ff..][..2 * ff];
        let mut want = vec![0.0; ff];
        ops::silu_mul(&row[..ff], &row[ff..], &mut want);
        for (a, b) in got[t * ff..][..ff].iter().zip(&want) {
            assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "silu {a} vs {b}");
        }
    }
}

#[test]
fn kv_slots_top_k_and_attention_keep_the_engines_meaning() {
    let mut g = Gen(11);
    let (heads, kv_heads, hd, bs) = (9, 3, 64, 16);
    let mut kv = PagedKv::new(8, bs, kv_heads * hd);
    // A sequence whose blocks are out of order, as the pool hands them out.
    let table = [5u32, 2, 7];
    let n = 40;
    for p in 0..n {
        let slot = kv.slot(&table, p);
        assert_eq!(
            slot,
            ultrafast_engine::model::paged::slot_of(&table, p, bs, 8 * bs).unwrap()
        );
        let k: Vec<f32> = (0..kv_heads * hd).map(|_| g.f()).collect();
        let v: Vec<f32> = (0..kv_heads * hd).map(|_| g.f()).collect();
        kv.write(slot, &k, &v);
    }
    let q: Vec<f32> = (0..heads * hd).map(|_| g.f() * 4.0).collect();
    let pos = n - 1;
    let got = kv.attend(&q, &table, pos, heads, hd);
    for h in 0..heads {
        let kvh = h / (heads / kv_heads);
        let kd = kv_heads * hd;
        let s: Vec<f64> = (0..=pos)
            .map(|p| {
                let slot = kv.slot(&table, p);
                (0..hd)
                    .map(|d| q[h * hd + d] as f64 * kv.k[slot * kd + kvh * hd + d].to_f64())
                    .sum::<f64>()
                    / (hd as f64).sqrt()
            })
            .collect();
        let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
        for d in 0..hd {
            let want: f64 = (0..=pos)
                .map(|p| {
                    let slot = kv.slot(&table, p);
                    (s[p] - m).exp() / z * kv.v[slot * kd + kvh * hd + d].to_f64()
                })
                .sum();
            let a = got[h * hd + d] as f64;
            assert!((a - want).abs() < 1e-5, "head {h} dim {d}: {a} vs {want}");
        }
    }

    // Top-k: its first is the sampler's argmax (ties to the first index).
    let mut row: Vec<f32> = (0..49_152).map(|_| g.f()).collect();
    row[100] = 5.0;
    row[200] = 5.0;
    let top = r::top_k(&row, 8);
    assert_eq!(top[0].0, ultrafast_engine::sampling::argmax(&row));
    assert_eq!((top[0].0, top[1].0), (100, 200));
    assert!(top.windows(2).all(|w| w[0].1 >= w[1].1));
}

/// The block types the CPU runner rewrites at load, dequantized by the
/// engine (`transcode::dequantize_into`, what its rewrites are held to)
/// against two independent readings of the GGUF format: the `gguf`
/// Python package (bit for bit) and candle's.
#[test]
fn rewritten_block_types_dequantize_as_gguf_py_and_candle_read_them() {
    let mut g = Gen(0x517c_c1b7);
    let types = [
        (GgmlDType::Q5_0, "Q5_0"),
        (GgmlDType::Q4K, "Q4_K"),
        (GgmlDType::Q5K, "Q5_K"),
        (GgmlDType::Q6K, "Q6_K"),
    ];
    let (rows, cols) = (2, 512);
    let mut ours = Vec::new();
    let mut req = Vec::new();
    for (t, name) in types {
        let (n, _) = transcode::block_shape(t).unwrap();
        let raw = transcode::random_blocks(&mut g, t, rows * cols / n);
        let mut got = vec![0f32; rows * cols];
        for (b, o) in raw
            .chunks_exact(transcode::block_shape(t).unwrap().1)
            .zip(got.chunks_exact_mut(n))
        {
            assert!(transcode::dequantize_into(t, b, o));
        }
        let candle = candle_dequantized(t, &raw, rows, cols);
        for (i, (a, b)) in got.iter().zip(&candle).enumerate() {
            assert!(
                (a - b).abs() <= 1e-6 * b.abs().max(1e-3),
                "{name} weight {i}: {a} vs candle's {b}"
            );
        }
        let hex: String = raw.iter().map(|b| format!("{b:02x}")).collect();
        req.push(serde_json::json!({"type": name, "hex": hex}));
        ours.push((name, got));
    }
    let script = r#"
import json, sys
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize
out = []
for r in json.load(sys.stdin):
    raw = np.frombuffer(bytes.fromhex(r["hex"]), dtype=np.uint8)
    out.append(dequantize(raw, T[r["type"]]).astype(np.float32).view(np.uint32).tolist())
json.dump(out, sys.stdout)
"#;
    let py: Vec<Vec<u32>> =
        serde_json::from_value(common::python_json(&["-c", script], &req.into())).unwrap();
    assert_eq!(py.len(), ours.len());
    for ((name, got), want) in ours.iter().zip(&py) {
        assert_eq!(got.len(), want.len(), "{name}");
        for (i, (a, b)) in got.iter().zip(want).enumerate() {
            assert_eq!(
                a.to_bits(),
                *b,
                "{name} weight {i}: {a} vs gguf-py's {}",
                f32::from_bits(*b)
            );
        }
    }
}
