//! The GPU check's kernel parity: every kernel on the GPU against its CPU
//! reference (`ultrafast_kernels::reference`) on SmolLM2-135M's shapes,
//! random inputs, with the tolerance stated per kernel. Prints one table
//! row per check; exits 1 if any fails, 2 when there is no GPU (with the
//! reason), 3 when there is one but its kernels cannot be compiled or
//! loaded. Run through `bash benches/scripts/gpu_check.sh`.
//!
//! NVRTC: `$ULTRAFAST_NVRTC_DIR` (a folder with `libnvrtc.so.13`, such as
//! the `nvidia-cuda-nvrtc` wheel's `nvidia/cu13/lib`), else the loader's
//! path (`/usr/local/cuda/lib64` on a machine with the toolkit).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::time::Instant;
use ultrafast_kernels::gpu::{AttnShape, Gpu};
use ultrafast_kernels::nvrtc::Nvrtc;
use ultrafast_kernels::reference::{self as r, Format, PagedKv, XorShift as Gen};

/// `format`'s blocks with realistic random scales.
fn blocks(g: &mut Gen, format: Format, rows: usize, cols: usize) -> Vec<u8> {
    r::random_blocks(g, format, rows, cols, r::realistic_scale(format))
}

thread_local! {
    /// Where the last [`err`] was worst: index, GPU value, reference value
    /// (printed by a failing row, so that it names the mismatch).
    static WORST: std::cell::Cell<(usize, f32, f32)> = const { std::cell::Cell::new((0, 0.0, 0.0)) };
}

/// Largest `|a - b| / (1 + |b|)` (NaN counts as infinite).
fn err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let mut worst = (0.0f32, 0usize);
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let e = (x - y).abs() / (1.0 + y.abs());
        let e = if e.is_nan() { f32::INFINITY } else { e };
        if e > worst.0 || i == 0 {
            worst = (e, i);
        }
    }
    let i = worst.1;
    WORST.set((
        i,
        a.get(i).copied().unwrap_or(0.0),
        b.get(i).copied().unwrap_or(0.0),
    ));
    worst.0
}

struct Report {
    failed: bool,
}

impl Report {
    fn row(&mut self, name: &str, e: f32, tol: f32, us: f64) {
        let ok = e <= tol && e.is_finite();
        self.failed |= !ok;
        println!(
            "| {name} | {e:.2e} | {tol:.0e} | {us:.1} | {} |",
            if ok { "pass" } else { "FAIL" }
        );
        if !ok {
            let (i, got, want) = WORST.get();
            println!("  worst at [{i}]: GPU {got} against the reference's {want}");
        }
    }
}

fn main() {
    // Exit 2 only where there is no GPU: a GPU whose kernels cannot be
    // compiled or loaded (no NVRTC, a driver too old for its code) is a
    // failure the check must show, not a machine without a GPU.
    match ultrafast_kernels::cuda::probe() {
        Ok(gpus) if !gpus.is_empty() => {}
        Ok(_) => {
            println!("gpu_check: no GPU: the driver lists no device");
            std::process::exit(2);
        }
        Err(why) => {
            println!("gpu_check: no GPU: {why}");
            std::process::exit(2);
        }
    }
    let nvrtc_dir = std::env::var_os("ULTRAFAST_NVRTC_DIR").map(PathBuf::from);
    let nvrtc = match Nvrtc::open(nvrtc_dir.as_deref()) {
        Ok(n) => n,
        Err(why) => {
            println!("gpu_check: a GPU but no NVRTC: {why}");
            std::process::exit(3);
        }
    };
    let cache = std::env::temp_dir().join("ultrafast-cubin");
    let t = Instant::now();
    let gpu = match Gpu::open(0, &nvrtc, &cache) {
        Ok(g) => g,
        Err(why) => {
            println!("gpu_check: the GPU did not open or its kernels did not load: {why}");
            std::process::exit(3);
        }
    };
    println!(
        "gpu_check: {} (sm_{}{}), NVRTC {}.{}, kernels compiled and loaded in {:.2} s",
        gpu.name,
        gpu.capability.0,
        gpu.capability.1,
        nvrtc.version.0,
        nvrtc.version.1,
        t.elapsed().as_secs_f64()
    );
    println!(
        "\n| kernel parity (SmolLM2-135M shapes) | max rel. error | tolerance | us per launch | |"
    );
    println!("|---|---|---|---|---|");
    let mut rep = Report { failed: false };
    let mut g = Gen(0x5eed_1234_abcd);
    // Times `f` over 20 launches after one warm-up (microseconds each).
    let time = |gpu: &Gpu, f: &mut dyn FnMut()| {
        f();
        gpu.synchronize().unwrap();
        let t = Instant::now();
        for _ in 0..20 {
            f();
        }
        gpu.synchronize().unwrap();
        t.elapsed().as_secs_f64() * 1e6 / 20.0
    };

    // GEMV on each format, one token (decode) and eight.
    for (format, rows, cols) in [
        (Format::Q4_1, 3072, 576),
        (Format::Q4_1, 576, 1536),
        (Format::Q8_0, 49_152, 576),
        (Format::Q4K, 896, 512),
        (Format::Q6K, 896, 512),
    ] {
        for tokens in [1, 8] {
            let w = blocks(&mut g, format, rows, cols);
            let x = g.fs(tokens * cols, 1.0);
            let want = r::gemv(format, &w, &x, rows, cols, tokens);
            let (dw, dx) = (gpu.upload(&w).unwrap(), gpu.upload(&x).unwrap());
            let mut dy = gpu.zeros::<f32>(tokens * rows).unwrap();
            let run = |dy: &mut cudarc::driver::CudaSlice<f32>| {
                gpu.gemv(
                    format,
                    &dw,
                    &dx.slice(..),
                    &mut dy.slice_mut(..),
                    rows,
                    cols,
                    tokens,
                    false,
                )
                .unwrap()
            };
            run(&mut dy);
            let got = gpu.download(&dy).unwrap();
            let us = time(&gpu, &mut || run(&mut dy));
            rep.row(
                &format!("{} {rows}x{cols}, {tokens} token(s)", format.kernel()),
                err(&got, &want),
                1e-4,
                us,
            );
        }
    }

    // RMSNorm with the residual add, 8 tokens of 576.
    let (d, tokens) = (576, 8);
    let (x, add, w) = (g.fs(tokens * d, 3.0), g.fs(tokens * d, 1.0), g.fs(d, 1.0));
    let mut want_x = x.clone();
    let mut want = Vec::new();
    for t in 0..tokens {
        want.extend(r::rmsnorm_residual(
            &mut want_x[t * d..][..d],
            Some(&add[t * d..][..d]),
            &w,
            1e-5,
        ));
    }
    let (mut dx, da, dw) = (
        gpu.upload(&x).unwrap(),
        gpu.upload(&add).unwrap(),
        gpu.upload(&w).unwrap(),
    );
    let mut dout = gpu.zeros::<f32>(tokens * d).unwrap();
    gpu.rmsnorm_residual(&mut dx, Some(&da), &dw, &mut dout, d, tokens, 1e-5)
        .unwrap();
    let (got, got_x) = (gpu.download(&dout).unwrap(), gpu.download(&dx).unwrap());
    rep.row(
        "rmsnorm_residual 8x576",
        err(&got, &want).max(err(&got_x, &want_x)),
        1e-5,
        0.0,
    );

    // RoPE on the query heads of fused q|k|v rows, both layouts.
    let (heads, hd, stride, theta) = (9, 64, 960, 100_000.0f32);
    let pos: Vec<i32> = (0..tokens as i32).map(|i| i * 97 + 3).collect();
    for neox in [false, true] {
        let x = g.fs(tokens * stride, 1.0);
        let mut want = x.clone();
        for t in 0..tokens {
            r::rope(
                &mut want[t * stride..][..heads * hd],
                pos[t] as usize,
                heads,
                hd,
                theta,
                neox,
            );
        }
        let (mut dx, dp) = (gpu.upload(&x).unwrap(), gpu.upload(&pos).unwrap());
        let table = gpu.upload(&r::rope_table(theta, hd, 1024)).unwrap();
        gpu.rope(&mut dx, &dp, heads, hd, stride, 0, tokens, &table, neox)
            .unwrap();
        rep.row(
            &format!("rope 8x9x64, neox {neox}"),
            err(&gpu.download(&dx).unwrap(), &want),
            1e-3,
            0.0,
        );
    }

    // SiLU-and-multiply over 8 fused gate|up rows of 1536.
    let ff = 1536;
    let gu = g.fs(tokens * 2 * ff, 6.0);
    let want = r::silu_mul(&gu, ff, tokens);
    let dgu = gpu.upload(&gu).unwrap();
    let mut dout = gpu.zeros::<f32>(tokens * ff).unwrap();
    gpu.silu_mul(&dgu, &mut dout, ff, tokens).unwrap();
    rep.row(
        "silu_mul 8x1536",
        err(&gpu.download(&dout).unwrap(), &want),
        1e-4,
        0.0,
    );

    // The KV write and paged attention: two sequences of 100 and 37
    // positions on shuffled blocks of 16, queries at several positions.
    let (kv_heads, bs, nblocks) = (3, 16, 16);
    let kv_dim = kv_heads * hd;
    let qkv_stride = heads * hd + 2 * kv_dim;
    let tables: [[u32; 8]; 2] = [[9, 2, 14, 5, 0, 11, 7, 3], [6, 13, 1, 8, 10, 4, 12, 15]];
    let lens = [100usize, 37];
    let mut kv = PagedKv::new(nblocks, bs, kv_dim);
    let (mut rows, mut slots) = (Vec::new(), Vec::new());
    for (s, len) in lens.iter().enumerate() {
        for p in 0..*len {
            let row = g.fs(qkv_stride, 1.0);
            let slot = kv.slot(&tables[s], p);
            kv.write(
                slot,
                &row[heads * hd..][..kv_dim],
                &row[heads * hd + kv_dim..],
            );
            rows.extend(row);
            slots.push(slot as i32);
        }
    }
    let n = slots.len();
    let (drows, dslots) = (gpu.upload(&rows).unwrap(), gpu.upload(&slots).unwrap());
    let mut kc = gpu.zeros::<u16>(nblocks * bs * kv_dim).unwrap();
    let mut vc = gpu.zeros::<u16>(nblocks * bs * kv_dim).unwrap();
    gpu.kv_write(
        &drows,
        qkv_stride,
        heads * hd,
        heads * hd + kv_dim,
        &mut kc,
        &mut vc,
        &dslots,
        kv_dim,
        n,
    )
    .unwrap();
    let bits = |v: &[half::f16]| v.iter().map(|h| h.to_bits()).collect::<Vec<u16>>();
    let (kc_host, vc_host) = (gpu.download(&kc).unwrap(), gpu.download(&vc).unwrap());
    let same = kc_host == bits(&kv.k) && vc_host == bits(&kv.v);
    rep.row(
        "kv_write 137 positions",
        if same { 0.0 } else { 1.0 },
        0.0,
        0.0,
    );
    let queries: [(usize, usize); 6] = [(0, 0), (0, 15), (0, 16), (0, 99), (1, 1), (1, 36)];
    let q: Vec<f32> = g.fs(queries.len() * heads * hd, 2.0);
    let mut want = Vec::new();
    for (i, (s, p)) in queries.iter().enumerate() {
        want.extend(kv.attend(
            &q[i * heads * hd..][..heads * hd],
            &tables[*s],
            *p,
            heads,
            hd,
        ));
    }
    let flat: Vec<i32> = tables.iter().flatten().map(|b| *b as i32).collect();
    let qseq: Vec<i32> = queries.iter().map(|q| q.0 as i32).collect();
    let qpos: Vec<i32> = queries.iter().map(|q| q.1 as i32).collect();
    let (dq, dt, ds, dp) = (
        gpu.upload(&q).unwrap(),
        gpu.upload(&flat).unwrap(),
        gpu.upload(&qseq).unwrap(),
        gpu.upload(&qpos).unwrap(),
    );
    let shape = AttnShape {
        heads,
        kv_heads,
        hd,
        block_size: bs,
    };
    // Whole contexts (one part), the split the runner would choose for six
    // rows of at most 128 positions, and parts of 32 positions (some past
    // a row's end, which must weigh nothing in the merge).
    let chosen = ultrafast_kernels::gpu::attention_split(queries.len(), kv_heads, 8 * bs);
    for (parts, chunk) in [(1, 8 * bs), chosen, (4, 32)] {
        let mut dout = gpu.zeros::<f32>(queries.len() * heads * hd).unwrap();
        let mut scratch = gpu
            .zeros::<f32>(queries.len() * parts * heads * (hd + 2))
            .unwrap();
        let split = ultrafast_kernels::gpu::Split {
            parts,
            chunk,
            scratch: &mut scratch,
        };
        let t = Instant::now();
        gpu.paged_attention(
            &dq,
            heads * hd,
            &kc,
            &vc,
            &dt,
            8,
            &ds,
            &dp,
            &mut dout,
            shape,
            queries.len(),
            split,
        )
        .unwrap();
        gpu.synchronize().unwrap();
        let us = t.elapsed().as_secs_f64() * 1e6;
        rep.row(
            &format!("paged_attention 9/3 heads, 6 queries, {parts} parts of {chunk}"),
            err(&gpu.download(&dout).unwrap(), &want),
            1e-3,
            us,
        );
    }

    // Top-k over two vocabulary rows: exact indices.
    let (vocab, k) = (49_152, 8);
    let logits = g.fs(2 * vocab, 10.0);
    let want: Vec<i32> = (0..2)
        .flat_map(|row| r::top_k(&logits[row * vocab..][..vocab], k))
        .map(|(i, _)| i as i32)
        .collect();
    let dl = gpu.upload(&logits).unwrap();
    let mut dc = gpu.zeros::<i32>(2 * 2 * k).unwrap();
    gpu.top_k(&dl, vocab, 2, k, &mut dc).unwrap();
    let raw = gpu.download(&dc).unwrap();
    let got: Vec<(i32, f32)> = (0..2)
        .flat_map(|row| ultrafast_kernels::gpu::candidates(&raw, 2, k, row))
        .collect();
    let want_vals: Vec<f32> = (0..2)
        .flat_map(|row| r::top_k(&logits[row * vocab..][..vocab], k))
        .map(|(_, v)| v)
        .collect();
    let same = got.iter().map(|c| c.0).collect::<Vec<_>>() == want
        && got.iter().map(|c| c.1).collect::<Vec<_>>() == want_vals;
    rep.row("top_k 2x49152, k 8", if same { 0.0 } else { 1.0 }, 0.0, 0.0);

    // The rows' log-normalisers (log-probabilities reported from
    // candidates): `__expf` and a block's sum against f64.
    let want: Vec<f32> = (0..2)
        .map(|row| r::log_norm(&logits[row * vocab..][..vocab]))
        .collect();
    let mut dn = gpu.zeros::<f32>(2).unwrap();
    gpu.log_norm(&dl, vocab, 2, &mut dn).unwrap();
    rep.row(
        "log_norm 2x49152",
        err(&gpu.download(&dn).unwrap(), &want),
        1e-4,
        0.0,
    );

    // Prompt GEMMs: dequantization into bfloat16 and the activations'
    // rounding bit-exact; cuBLAS against the same products in f32.
    if gpu.has_gemm() {
        for (format, rows, cols) in [
            (Format::Q4_1, 3072, 576),
            (Format::Q8_0, 576, 1536),
            (Format::Q4K, 896, 512),
            (Format::Q6K, 896, 512),
        ] {
            let w = blocks(&mut g, format, rows, cols);
            let dw = gpu.upload(&w).unwrap();
            let wb = gpu.dequant_bf16(format, &dw, rows, cols).unwrap();
            let want_w = r::dequant_bf16(format, &w, rows, cols);
            let same = gpu.download(&wb).unwrap() == want_w;
            let name = format!("{} {rows}x{cols} (bit-exact)", format.dequant_kernel());
            rep.row(&name, if same { 0.0 } else { 1.0 }, 0.0, 0.0);
            let tokens = 512;
            let x = g.fs(tokens * cols, 1.0);
            let dx = gpu.upload(&x).unwrap();
            let mut xb = gpu.zeros::<u16>(tokens * cols).unwrap();
            gpu.to_bf16(&dx.slice(..), &mut xb.slice_mut(..), tokens * cols)
                .unwrap();
            if format == Format::Q4_1 {
                let want: Vec<u16> = x.iter().map(|v| r::bf16(*v)).collect();
                let same = gpu.download(&xb).unwrap() == want;
                rep.row(
                    "to_bf16 (bit-exact)",
                    if same { 0.0 } else { 1.0 },
                    0.0,
                    0.0,
                );
            }
            let mut want = vec![0.0f32; tokens * rows];
            r::gemm_bf16(&want_w, &x, rows, cols, tokens, false, &mut want);
            let mut dy = gpu.zeros::<f32>(tokens * rows).unwrap();
            let run = |dy: &mut cudarc::driver::CudaSlice<f32>| {
                gpu.gemm_bf16(
                    &wb,
                    &xb.slice(..),
                    &mut dy.slice_mut(..),
                    rows,
                    cols,
                    tokens,
                    false,
                )
                .unwrap()
            };
            run(&mut dy);
            let got = gpu.download(&dy).unwrap();
            let us = time(&gpu, &mut || run(&mut dy));
            rep.row(
                &format!("cuBLAS bf16 GEMM {rows}x{cols}, {tokens} tokens"),
                err(&got, &want),
                1e-4,
                us,
            );
        }
    } else {
        println!("| cuBLAS bf16 GEMM | - | - | - | FAIL: cuBLAS did not load |");
        rep.failed = true;
    }

    if rep.failed {
        println!("\ngpu_check: kernel parity FAILED");
        std::process::exit(1);
    }
    println!("\ngpu_check: kernel parity passed");
}
