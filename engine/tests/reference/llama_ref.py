#!/usr/bin/env python3
"""Independent float32 reference for the llama-architecture GGUF forward pass.

Dequantizes every weight with the `gguf` package and runs the model in numpy
(float32 activations, no activation quantization), so it shares no code and
no numeric shortcuts with the Rust engine. Input (stdin, JSON):
{"model": path, "prompts": [[ids...], ...], "steps": N}. Output (stdout,
JSON): per prompt, the greedy tokens, the top-two logit margin at each step,
and the logits of the first step. With "score": k instead of "steps", each
prompt is scored instead: every token's log-probability given the ones
before it and the k likeliest tokens at its position.
"""
import json, math, sys
import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def load(path):
    r = GGUFReader(path)
    meta = {}
    for k, f in r.fields.items():
        if k.startswith("tokenizer."):
            continue
        try:
            meta[k] = f.contents()
        except Exception:
            pass
    w = {}
    for t in r.tensors:
        a = dequantize(t.data, t.tensor_type).astype(np.float32)
        w[t.name] = a.reshape([int(x) for x in reversed(t.shape)]) if a.ndim != len(t.shape) else a
    return meta, w


def rms(x, g, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g


def rope(x, pos, theta, neox=False):
    # x: (heads, len, hd); GGUF llama weights use interleaved pairs, qwen2
    # (NEOX) rotates the first half against the second.
    h, n, hd = x.shape
    inv = 1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float32) / hd)
    ang = np.outer(np.arange(pos, pos + n, dtype=np.float32), inv)
    c, s = np.cos(ang), np.sin(ang)
    if neox:
        x0, x1 = x[..., : hd // 2], x[..., hd // 2:]
        return np.concatenate([x0 * c - x1 * s, x0 * s + x1 * c], axis=-1)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * c - x1 * s
    out[..., 1::2] = x0 * s + x1 * c
    return out


class Ref:
    def __init__(self, path):
        m, self.w = load(path)
        a = m["general.architecture"]
        self.L = int(m[f"{a}.block_count"])
        self.d = int(m[f"{a}.embedding_length"])
        self.nh = int(m[f"{a}.attention.head_count"])
        self.nkv = int(m[f"{a}.attention.head_count_kv"])
        self.hd = self.d // self.nh
        self.theta = float(m.get(f"{a}.rope.freq_base", 10000.0))
        self.eps = float(m.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-5))
        self.out = self.w.get("output.weight", self.w["token_embd.weight"])
        self.neox = a == "qwen2"

    def forward(self, ids, cache, every=False):
        w, pos, n = self.w, cache["len"], len(ids)
        x = w["token_embd.weight"][ids]
        for i in range(self.L):
            p = f"blk.{i}."
            h = rms(x, w[p + "attn_norm.weight"], self.eps)
            def proj(name, heads):
                y = h @ w[p + name + ".weight"].T + w.get(p + name + ".bias", 0.0)
                return y.reshape(n, heads, self.hd).transpose(1, 0, 2)
            q, k, v = proj("attn_q", self.nh), proj("attn_k", self.nkv), proj("attn_v", self.nkv)
            q, k = rope(q, pos, self.theta, self.neox), rope(k, pos, self.theta, self.neox)
            if i in cache["k"]:
                k = np.concatenate([cache["k"][i], k], axis=1)
                v = np.concatenate([cache["v"][i], v], axis=1)
            cache["k"][i], cache["v"][i] = k, v
            rep = self.nh // self.nkv
            kk, vv = np.repeat(k, rep, axis=0), np.repeat(v, rep, axis=0)
            # A Python float: numpy's float64 scalar would promote every
            # activation after it to float64 (and each matmul's weights with it).
            att = q @ kk.transpose(0, 2, 1) / math.sqrt(self.hd)
            t = kk.shape[1]
            mask = np.arange(t)[None, :] > (pos + np.arange(n))[:, None]
            att = np.where(mask[None], -np.inf, att)
            att = np.exp(att - att.max(-1, keepdims=True))
            att /= att.sum(-1, keepdims=True)
            o = (att @ vv).transpose(1, 0, 2).reshape(n, self.d)
            x = x + o @ w[p + "attn_output.weight"].T
            h = rms(x, w[p + "ffn_norm.weight"], self.eps)
            g = h @ w[p + "ffn_gate.weight"].T
            u = h @ w[p + "ffn_up.weight"].T
            x = x + (g / (1 + np.exp(-g)) * u) @ w[p + "ffn_down.weight"].T
        cache["len"] += n
        if every:
            return rms(x, w["output_norm.weight"], self.eps) @ self.out.T
        last = rms(x[-1:], w["output_norm.weight"], self.eps)
        return (last @ self.out.T)[0]


def score(ref, ids, k):
    """Each token's log-probability given the ones before it (None for the
    first) and the k likeliest tokens at its position, from one forward
    pass over all of them (float64 log-softmax of every row)."""
    rows = ref.forward(list(ids), {"len": 0, "k": {}, "v": {}}, every=True).astype(np.float64)
    rows -= rows.max(-1, keepdims=True)
    rows -= np.log(np.exp(rows).sum(-1, keepdims=True))
    out = [{"logprob": None, "top": []}]
    for p in range(1, len(ids)):
        row = rows[p - 1]
        top = np.argsort(-row, kind="stable")[:k]
        second = np.sort(row)[-2:]
        out.append({
            "logprob": float(row[ids[p]]),
            "top": [[int(t), float(row[t])] for t in top],
            "margin": float(second[1] - second[0]),
        })
    return out


def main():
    req = json.load(sys.stdin)
    ref = Ref(req["model"])
    if "score" in req:
        json.dump([score(ref, ids, req["score"]) for ids in req["prompts"]], sys.stdout)
        return
    results = []
    for ids in req["prompts"]:
        cache = {"len": 0, "k": {}, "v": {}}
        logits = ref.forward(list(ids), cache)
        first = logits.tolist()
        toks, margins = [], []
        for _ in range(req["steps"]):
            top2 = np.sort(logits)[-2:]
            margins.append(float(top2[1] - top2[0]))
            t = int(np.argmax(logits))
            toks.append(t)
            logits = ref.forward([t], cache)
        results.append({"tokens": toks, "margins": margins, "first_logits": first})
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
