#!/usr/bin/env python3
"""Golden token ids for crates/hf-tokenize's unit tests, from transformers itself (the code
vLLM 0.32 calls: apply_chat_template(tokenize=True) for chat, tokenizer(text) for completions).
Usage: ~/.cache/inferlb-real-vllm/venv/bin/python bench/tokenizer_golden.py tests/fixtures/tiny-llama \
           > tests/fixtures/tiny-llama-golden.json
"""
import json, sys
from transformers import AutoTokenizer

tok = AutoTokenizer.from_pretrained(sys.argv[1])
long_sys = "You are a helpful model. " * 40
cases = [
    ("user", {"messages": [{"role": "user", "content": "hello world"}]}),
    ("roles", {"messages": [{"role": "system", "content": "you are a router"},
                            {"role": "user", "content": "what is the cache"},
                            {"role": "assistant", "content": "a prefix of tokens"},
                            {"role": "user", "content": "and the load?"}]}),
    ("no_gen", {"messages": [{"role": "user", "content": "hello"}], "add_generation_prompt": False}),
    ("long_system", {"messages": [{"role": "system", "content": long_sys},
                                  {"role": "user", "content": "number 12 84 then 7"}]}),
    ("unicode", {"messages": [{"role": "user", "content": "héllo wörld — ünïcode 日本語 \n\t tabs"}]}),
    ("special_in_content", {"messages": [{"role": "user", "content": "a<|end|>b <s> c</s>"}]}),
]
out = []
for name, body in cases:
    msgs = body["messages"]
    agp = body.get("add_generation_prompt", True)
    ids = tok.apply_chat_template(msgs, add_generation_prompt=agp, tokenize=True, return_dict=False)
    text = tok.apply_chat_template(msgs, add_generation_prompt=agp, tokenize=False)
    out.append({"name": name, "kind": "chat", "body": body, "text": text, "ids": list(ids)})
for name, prompt in [("plain", "the model cache prefix"), ("spaces", "  two  spaces\nnewline"),
                     ("empty", ""), ("specials", "<|user|>hi<|end|>")]:
    out.append({"name": name, "kind": "completion", "body": {"prompt": prompt},
                "ids": tok(prompt)["input_ids"]})
    out.append({"name": name + "_nospecial", "kind": "completion",
                "body": {"prompt": prompt, "add_special_tokens": False},
                "ids": tok(prompt, add_special_tokens=False)["input_ids"]})
json.dump(out, sys.stdout, ensure_ascii=False, indent=1)
print()
