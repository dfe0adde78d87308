-- POST the body in env BODY (default: bench/wrk/post.lua's non-streaming body)
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = os.getenv("BODY")
