-- wrk script for bench/overhead.sh: POST an OpenAI chat completion (48-token-ish prompt,
-- max_tokens 100). STREAM=true asks for Server-Sent Events.
local stream = os.getenv("STREAM") == "true"
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"bench","stream":' .. tostring(stream) ..
  ',"max_tokens":100,"messages":[{"role":"system","content":"You are a concise assistant that answers ' ..
  'questions about load balancing."},{"role":"user","content":"How does a proxy keep connections ' ..
  'to its backends alive between requests?"}]}'

-- No response() callback: a Lua call per response would slow wrk down; wrk counts
-- non-2xx answers itself.
