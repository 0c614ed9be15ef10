#!/usr/bin/python3
"""Writes the GGUF of the speed anchor (DESIGN.md section 6): a LLaMA decoder with
LLaVA-1.5-7B's shapes (hidden 4096, FFN 11008, 32 heads, vocabulary 32000) and random bf16
weights, `--layers` deep (4 by default, as `llava-bench`'s decoder suite), for llama.cpp's
`llama-bench`. Uses llama.cpp's own gguf-py (pass its folder) and Debian's python3-numpy.

usage: /usr/bin/python3 scripts/anchor_gguf.py --gguf-py LLAMA_CPP/gguf-py --out bench.gguf
"""
import argparse
import sys
import types

import numpy as np


def bf16_bytes(rng, shape, scale):
    """Random normal values rounded to bf16, as the raw bytes gguf-py expects for BF16."""
    f = (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float32)
    bits = f.view(np.uint32)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # round to nearest even
    return bits.astype(np.uint16).view(np.uint8).reshape(*shape[:-1], shape[-1] * 2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf-py", required=True, help="llama.cpp's gguf-py folder")
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    sys.path.insert(0, args.gguf_py)
    # gguf-py imports sentencepiece for its vocabulary helpers, which this script does not use.
    stub = types.ModuleType("sentencepiece")
    stub.SentencePieceProcessor = None
    sys.modules.setdefault("sentencepiece", stub)
    import gguf  # noqa: E402 (from the folder given)

    hidden, ffn, heads, vocab = 4096, 11008, 32, 32000
    rng = np.random.default_rng(3)
    w = gguf.GGUFWriter(args.out, "llama")
    w.add_name("llava-7b-shapes-random")
    w.add_context_length(4096)
    w.add_embedding_length(hidden)
    w.add_block_count(args.layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(heads)
    w.add_rope_dimension_count(hidden // heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    # A vocabulary of placeholder pieces: llama-bench feeds random token ids.
    w.add_tokenizer_model("llama")
    w.add_token_list([b"<unk>", b"<s>", b"</s>"] + [f"t{i}".encode() for i in range(3, vocab)])
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (vocab - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    bf16 = gguf.GGMLQuantizationType.BF16
    w.add_tensor("token_embd.weight", bf16_bytes(rng, (vocab, hidden), 0.02), raw_dtype=bf16)
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    w.add_tensor("output.weight", bf16_bytes(rng, (vocab, hidden), 0.02), raw_dtype=bf16)
    for i in range(args.layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(hidden, dtype=np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(p + name + ".weight", bf16_bytes(rng, (hidden, hidden), 0.02),
                         raw_dtype=bf16)
        w.add_tensor(p + "ffn_gate.weight", bf16_bytes(rng, (ffn, hidden), 0.02), raw_dtype=bf16)
        w.add_tensor(p + "ffn_up.weight", bf16_bytes(rng, (ffn, hidden), 0.02), raw_dtype=bf16)
        w.add_tensor(p + "ffn_down.weight", bf16_bytes(rng, (hidden, ffn), 0.02), raw_dtype=bf16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
