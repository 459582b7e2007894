//! Print the top next tokens for a chat prompt and a greedy answer (a
//! debugging aid): `cargo run -p ultrafast-engine --example probe --
//! "question" [MODEL.gguf]` (default: SmolLM2 from the cache).
#![allow(clippy::unwrap_used)]
use candle_core::D;
use ultrafast_engine::{fetch, generate, tokenizer::ChatMessage};

fn main() {
    let q = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "What is the capital of France?".into());
    let path = match std::env::args().nth(2) {
        Some(p) => std::path::PathBuf::from(p),
        None => fetch::pull(&fetch::SMOLLM2).unwrap(),
    };
    let t0 = std::time::Instant::now();
    let l = generate::load(&path).unwrap();
    println!("loaded {} in {:?}", path.display(), t0.elapsed());
    let prompt = l.codec.render_chat(&[ChatMessage::new("user", q)]).unwrap();
    let ids = l.codec.encode(&prompt).unwrap();
    println!("{} prompt tokens", ids.len());
    let mut cache = l.model.new_cache();
    let logits = l.model.forward(&ids, &mut cache).unwrap();
    let v = logits.to_vec1::<f32>().unwrap();
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|a, b| v[*b].partial_cmp(&v[*a]).unwrap());
    for i in &idx[..5] {
        println!(
            "{:>8.3} {:?}",
            v[*i],
            l.codec.decode(&[*i as u32], false).unwrap()
        );
    }
    let _ = logits.argmax(D::Minus1);
    let out = generate::greedy(&l, &ids, 30).unwrap();
    println!("{:?}", l.codec.decode(&out, true).unwrap());
}
