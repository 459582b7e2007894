//! Token ids equal to an independent reference tokenizer (pure Python
//! byte-level BPE over the GGUF's vocabulary and merges, in
//! `tests/reference/tokenizer_ref.py`), on multilingual text, emoji, code,
//! digits and a rendered chat template with special tokens.
#![allow(clippy::unwrap_used)]

use std::io::Write;
use std::process::{Command, Stdio};
use ultrafast_engine::tokenizer::ChatMessage;
use ultrafast_engine::{fetch, generate};

#[test]
fn token_ids_match_the_reference_tokenizer() {
    let path = fetch::pull(&fetch::SMOLLM2).unwrap();
    let l = generate::load(&path).unwrap();
    let chat = l
        .codec
        .render_chat(&[
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", "Hi there!"),
        ])
        .unwrap();
    let texts = vec![
        "Hello, world! How's it going?".to_string(),
        "Der Straßenbahnfahrer fährt über die Brücke. Ça coûte 12,50 €.".into(),
        "東京は日本の首都です。北京是中国的首都。Привет, как дела?".into(),
        "emoji 🎉🚀 family 👨‍👩‍👧‍👦 flags 🇫🇷 and ✨sparkles✨".into(),
        "fn main() {\n    let x: u64 = 1234567;\n    println!(\"{x:>8}\");\n}\n\t\ttabs  and   spaces   ".into(),
        "year 2026, pi 3.14159, 1e-9, 0xDEADBEEF".into(),
        "  leading spaces\n\n\nnewlines\r\nwindows".into(),
        chat,
    ];
    let mut child = Command::new("python3")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/reference/tokenizer_ref.py"
        ))
        .arg(&path)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 with the gguf and regex packages (.ci/run installs them)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(serde_json::to_string(&texts).unwrap().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "reference tokenizer failed");
    let want: Vec<Vec<u32>> = serde_json::from_slice(&out.stdout).unwrap();
    for (text, want) in texts.iter().zip(want) {
        let mut got = l.codec.encode(text).unwrap();
        if l.codec.add_bos && l.codec.bos == got.first().copied() {
            got.remove(0);
        }
        assert_eq!(got, want, "token ids differ for {text:?}");
        assert_eq!(
            l.codec.decode(&got, false).unwrap(),
            *text,
            "round trip of {text:?}"
        );
    }
}
