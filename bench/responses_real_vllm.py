"""The Responses API through inferlb with the real OpenAI Python SDK, against real vLLM.

    bench/responses_real_vllm.py LB_URL LB2_URL BACKEND_URL [BACKEND_URL ...]

LB_URL and LB2_URL are two inferlb replicas over the same vLLM servers (response store on:
VLLM_ENABLE_RESPONSES_API_STORE=1). Prints one line per check and exits non-zero when a check
fails. Run by bench/responses_real_vllm.sh, which starts everything and records the output.
"""
import sys

import httpx
import openai

lb, lb2, backends = sys.argv[1], sys.argv[2], sys.argv[3:]
failed = 0


def check(name, ok, detail=""):
    global failed
    failed += 0 if ok else 1
    print(f"- {'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)


def holder_of(response_id):
    """Which vLLM server holds the id, asked directly (not through inferlb)."""
    found = [b for b in backends if httpx.get(f"{b}/v1/responses/{response_id}").status_code == 200]
    return found


def served_by(raw):
    return raw.headers.get("x-inferlb-backend")


client = openai.OpenAI(base_url=f"{lb}/v1", api_key="none", max_retries=0)
client2 = openai.OpenAI(base_url=f"{lb2}/v1", api_key="none", max_retries=0)
model = "tiny-llama"

# Three turns by previous_response_id, each through the first replica.
raw = client.responses.with_raw_response.create(
    model=model, instructions="Answer briefly.", input="Hello, who are you?", max_output_tokens=8)
first = raw.parse()
home = served_by(raw)
ids = [first.id]
check("turn 1 created", first.status in ("completed", "incomplete"), f"id {first.id} on {home}")
for turn in (2, 3):
    raw = client.responses.with_raw_response.create(
        model=model, input=f"Turn {turn}: and then?", previous_response_id=ids[-1], max_output_tokens=8)
    r = raw.parse()
    check(f"turn {turn} by previous_response_id", served_by(raw) == home and r.previous_response_id == ids[-1],
          f"id {r.id} on {served_by(raw)}, usage.input_tokens {r.usage.input_tokens}")
    ids.append(r.id)
check("each turn's holder, asked directly", all(holder_of(i) == [home] for i in ids),
      ", ".join(f"{i}: {holder_of(i)}" for i in ids))

# Retrieve through both replicas: the second never saw these ids and looks them up.
for name, c in (("replica 1", client), ("replica 2", client2)):
    got = [c.responses.retrieve(i).id for i in ids]
    check(f"retrieve all three through {name}", got == ids)

# A streamed create, learnt from its first event, followed up at once.
with client.responses.stream(model=model, input="Stream a few words.", max_output_tokens=8) as s:
    events = [e.type for e in s]
    streamed = s.get_final_response()
check("streamed create", events[0] == "response.created" and events[-1] == "response.completed",
      f"{len(events)} events, id {streamed.id}")
raw = client.responses.with_raw_response.create(
    model=model, input="After the stream.", previous_response_id=streamed.id, max_output_tokens=4)
check("follow-up of the streamed response", raw.http_response.status_code == 200,
      f"on {served_by(raw)}; holder {holder_of(streamed.id)}")

# Cancel of a finished response: its holder says it is not cancellable (400); any other server
# would have said it does not know the id (404).
try:
    client2.responses.cancel(ids[0])
    check("cancel of a finished response reaches its holder", False, "no error")
except openai.BadRequestError as e:
    check("cancel of a finished response reaches its holder", "Cannot cancel" in str(e), str(e)[:120])
except openai.APIStatusError as e:
    check("cancel of a finished response reaches its holder", False, f"{e.status_code} {str(e)[:120]}")

# An id nobody has: vLLM's own not-found, through the router.
try:
    client.responses.retrieve("resp_0000000000000000")
    check("unknown id", False, "no error")
except openai.NotFoundError as e:
    check("unknown id is vLLM's 404", "not found" in str(e), str(e)[:120])

sys.exit(1 if failed else 0)
