#!/usr/bin/env python3
"""Driver of bench/tokenizer_fidelity.sh: compares hf-tokenize's ids (the `ids` example) with a
real vLLM 0.32's POST /tokenize, and (KV events on) with the token_ids of its BlockStored events.
Usage: python tokenizer_fidelity.py IDS_BIN MODEL_DIR PORT"""
import json, subprocess, sys, time, urllib.request

ids_bin, model_dir, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
base = f"http://127.0.0.1:{port}"
BLOCK = 128

def post(path, body):
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)

def ours(kind, body):
    p = subprocess.run([ids_bin, model_dir], input=f"{kind} {json.dumps(body)}\n", capture_output=True, text=True, check=True)
    return json.loads(p.stdout)

system = "You are a helpful model of the router. " * 30
weather_tool = {"type": "function", "function": {"name": "get_weather", "description": "the weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
chats = {
    "single user": [{"role": "user", "content": "hello world"}],
    "several roles + system": [{"role": "system", "content": "you are a router"}, {"role": "user", "content": "what is the cache"},
                               {"role": "assistant", "content": "a prefix of tokens"}, {"role": "user", "content": "and the load?"}],
    "long system prompt": [{"role": "system", "content": system}, {"role": "user", "content": "number 12 84 then 7"}],
    "multi-turn": [{"role": "system", "content": system}, {"role": "user", "content": "first question"},
                   {"role": "assistant", "content": "first answer"}, {"role": "user", "content": "second question"},
                   {"role": "assistant", "content": "second answer"}, {"role": "user", "content": "third"}],
    "list-of-parts content": [{"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]}],
    "unicode and whitespace": [{"role": "user", "content": "héllo wörld — 日本語 \n\t  tabs  "}],
    "special tokens in content": [{"role": "user", "content": "a<|end|>b <s> c</s>"}],
    "developer role": [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}],
}
cases = []
for name, msgs in chats.items():
    cases.append((f"chat: {name}", "chat", {"messages": msgs}))
cases.append(("chat: add_generation_prompt false", "chat", {"messages": chats["several roles + system"], "add_generation_prompt": False}))
cases.append(("chat: continue_final_message", "chat", {"messages": chats["several roles + system"][:3], "add_generation_prompt": False, "continue_final_message": True}))
cases.append(("chat: tools (this template ignores tools)", "chat", {"messages": chats["single user"], "tools": [weather_tool]}))
cases.append(("chat: chat_template_kwargs", "chat", {"messages": chats["single user"], "chat_template_kwargs": {"unused": 1}}))
for name, prompt in [("plain", "the model cache prefix"), ("spaces/newlines", "  two  spaces\nnewline  "),
                     ("specials", "<|user|>hi<|end|>"), ("long", "number 1 7 1 the cache " * 60)]:
    cases.append((f"completion: {name}", "completion", {"prompt": prompt}))
    cases.append((f"completion: {name}, add_special_tokens false", "completion", {"prompt": prompt, "add_special_tokens": False}))

fails = 0
print(f"{'case':58} {'tokens':>6}  result")
for name, kind, body in cases:
    theirs = post("/tokenize", {"model": "tiny-llama", **body})["tokens"]
    mine = ours(kind, body)
    ok = mine == theirs
    fails += not ok
    print(f"{name:58} {len(theirs):>6}  {'equal' if ok else 'DIFFERENT: ours ' + json.dumps(mine)[:200] + ' vllm ' + json.dumps(theirs)[:200]}")

# Block chains: vLLM's BlockStored token_ids for real requests vs our ids cut into 128-token blocks.
try:
    import zmq, msgspec  # both are vLLM dependencies (vLLM encodes its events with msgspec)
except ImportError:
    zmq = None
if zmq is not None and len(sys.argv) > 4 and sys.argv[4] == "events":
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port + 10000}")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(1.0)  # let the subscription reach the publisher before the requests
    stored = []
    def drain(timeout_ms):
        end = time.time() + timeout_ms / 1000
        while time.time() < end:
            if sub.poll(200):
                topic, seq, payload = sub.recv_multipart()
                batch = msgspec.msgpack.decode(payload)
                for ev in batch[1]:
                    if isinstance(ev, dict) and ev.get("type") == "BlockStored":
                        stored.append(ev)
                    elif isinstance(ev, list) and ev and ev[0] == "BlockStored":
                        stored.append({"token_ids": ev[3], "parent_block_hash": ev[2], "block_hashes": ev[1]})
    print()
    print(f"{'block chain (chat requests, BlockStored events)':58} {'blocks':>6}  result")
    # A run-unique system prompt (a server that ran this before has the plain one cached);
    # the multi-turn request extends the first one past its cached blocks.
    nonce = f"run {time.time_ns()} "
    first = [{"role": "system", "content": nonce + system}, {"role": "user", "content": "number 12 84 then 7"}]
    turns = first + [{"role": "assistant", "content": "the answer is a cache " * 20}, {"role": "user", "content": "and the load of the server? " * 10}]
    for name, msgs in [("long system prompt", first), ("multi-turn (extends it)", turns)]:
        body = {"messages": msgs}
        stored.clear()
        post("/v1/chat/completions", {"model": "tiny-llama", "max_tokens": 1, **body})
        drain(3000)
        mine = ours("chat", body)
        full = mine[:len(mine) - len(mine) % BLOCK]
        # The blocks this request stored, in chain order; blocks already cached by an earlier
        # request (the shared system prompt) are not stored again, so they are a suffix.
        got = [t for ev in stored for t in ev["token_ids"]]
        ok = len(got) > 0 and len(got) % BLOCK == 0 and got == full[len(full) - len(got):]
        fails += not ok
        print(f"chat: {name:52} {len(got) // BLOCK:>6}  {'equal' if ok else 'DIFFERENT'} "
              f"(vLLM stored {len(got) // BLOCK} blocks = our blocks {(len(full) - len(got)) // BLOCK}..{len(full) // BLOCK - 1})")
print()
print("ALL EQUAL" if fails == 0 else f"{fails} DIFFERENT")
sys.exit(1 if fails else 0)
