"""What a running vLLM server reports on its /metrics: the tests that must act while a request is being generated
(a SIGTERM, a weight sync in `abort` or `keep` mode) wait for it there instead of sleeping a guessed time."""


def requests_running(url: str, key: str) -> float:
    """vllm:num_requests_running of the server at `url`, from its /metrics."""
    from vcpo.trainer.engines.servers import http_client

    with http_client(url, key, sync=True) as client:
        text = client.get("/metrics").raise_for_status().text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:num_requests_running"))
