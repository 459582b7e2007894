#!/usr/bin/env python3
"""The GPU check's reference: Hugging Face transformers' `generate` on a
random-weight Llama with SmolLM2-135M's shapes (the shapes of the CUDA
runner's synthetic model in engine/examples/gpu_model_check.rs), bf16, on
the same GPU, in the same run. Prints single-stream and batch-64 decode
tokens/s and a 512-token prefill. Run by benches/scripts/gpu_check.sh.
"""
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def main():
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                      max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to("cuda", dtype=torch.bfloat16).eval()

    def decode(batch, new):
        ids = torch.randint(1, 49000, (batch, 32), device="cuda")
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=0, attention_mask=torch.ones_like(ids))
        torch.cuda.synchronize()
        return batch * new / (time.perf_counter() - t)

    decode(1, 8)
    single = decode(1, 128)
    batch64 = decode(64, 128)
    ids = torch.randint(1, 49000, (1, 512), device="cuda")
    with torch.no_grad():
        model(ids)
        torch.cuda.synchronize()
        t = time.perf_counter()
        model(ids)
        torch.cuda.synchronize()
    prefill_ms = (time.perf_counter() - t) * 1e3
    print("\n| transformers generate (bf16, random weights, SmolLM2-135M shapes) | value |")
    print("|---|---|")
    print(f"| prefill, 512-token prompt | {prefill_ms:.1f} ms |")
    print(f"| single-stream decode | {single:.1f} tokens/s |")
    print(f"| aggregate decode, batch 64 | {batch64:.1f} tokens/s |")


if __name__ == "__main__":
    main()
