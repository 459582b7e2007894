"""An independent byte-level BPE tokenizer (GPT-2 style) built from a GGUF's
metadata with the `gguf` package: special tokens split out first, digits
split one by one (the `smollm` pre-tokenizer), the GPT-2 regex, the GPT-2
byte-to-unicode map, then merges applied by rank. Reads a JSON list of texts
on stdin, prints a JSON list of id lists.

usage: python3 tokenizer_ref.py MODEL.gguf < texts.json"""
import json
import sys

import regex
from gguf import GGUFReader

GPT2_PAT = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


def field(r, key):
    f = r.fields[key]
    return [bytes(f.parts[i]).decode("utf-8") if f.types[-1].name == "STRING" else f.parts[i][0] for i in f.data]


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def main():
    r = GGUFReader(sys.argv[1])
    tokens = field(r, "tokenizer.ggml.tokens")
    merges = field(r, "tokenizer.ggml.merges")
    types = field(r, "tokenizer.ggml.token_type")
    pre = bytes(r.fields["tokenizer.ggml.pre"].parts[-1]).decode() if "tokenizer.ggml.pre" in r.fields else ""
    vocab = {t: i for i, t in enumerate(tokens)}
    ranks = {tuple(m.split(" ", 1)): i for i, m in enumerate(merges)}
    special = sorted((t for t, ty in zip(tokens, types) if int(ty) in (3, 4)), key=len, reverse=True)
    b2u = bytes_to_unicode()
    cache = {}

    def bpe(word):
        if word in cache:
            return cache[word]
        parts = list(word)
        while len(parts) > 1:
            best = min(((ranks.get((a, b), 1 << 30), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))))
            if best[0] == 1 << 30:
                break
            i = best[1]
            parts = parts[:i] + [parts[i] + parts[i + 1]] + parts[i + 2:]
        cache[word] = [vocab[p] for p in parts]
        return cache[word]

    def normal(text):
        pieces = [text]
        if pre == "smollm":
            pieces = [p for p in regex.split(r"(\p{N})", text) if p]
        ids = []
        for piece in pieces:
            for w in GPT2_PAT.findall(piece):
                ids += bpe("".join(b2u[b] for b in w.encode("utf-8")))
        return ids

    def encode(text):
        ids, i, start = [], 0, 0
        while i < len(text):
            m = next((s for s in special if text.startswith(s, i)), None)
            if m:
                ids += normal(text[start:i]) + [vocab[m]]
                i += len(m)
                start = i
            else:
                i += 1
        return ids + normal(text[start:])

    print(json.dumps([encode(t) for t in json.load(sys.stdin)]))


if __name__ == "__main__":
    main()
